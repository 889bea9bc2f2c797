"""Megatron-Core's Mamba-2 mixer (``megatron.core.ssm.mamba_mixer.MambaMixer``) as HuggingFace's Mamba-2 mixers
(Nemotron-H's ``NemotronHMamba2Mixer``) hold it, as boxes.

How megatron-core 0.16 saves a mixer in ``torch_dist`` (``MambaMixer.sharded_state_dict``): each TP rank holds
``in_proj`` rows ``[z, x, B, C, dt]`` of its own heads and groups, fused; the checkpoint splits them into five
tensors, each sharded over TP on dim 0 and so *global* in the checkpoint: ``in_proj.weight.z [I, H]``, ``.x [I, H]``,
``.B [G*N, H]``, ``.C [G*N, H]``, ``.dt [Nh, H]`` (``I`` = heads x head_dim, ``G`` groups, ``N`` the state size,
``Nh`` heads); ``conv1d.weight`` / ``conv1d.bias`` likewise as ``.x``, ``.B``, ``.C``. ``A_log``, ``D``,
``dt_bias`` (``[Nh]``), the gated norm's ``norm.weight`` (``[I]``) and ``out_proj.weight [H, I]`` are whole global
tensors. Transformers' mixer fuses them back in that order: ``in_proj.weight [2I + 2GN + Nh, H]`` split
``[z | x, B, C | dt]`` and ``conv1d [I + 2GN, 1, K]`` as ``[x, B, C]``; every part is a row range.

The layer's pre-norm is ``norm.weight`` on the local spec and Transformer Engine's fused
``mixer.in_proj.layer_norm_weight`` on the TE spec: both are the layer's ``norm``.

A fused ``mixer.in_proj.weight`` (``--ckpt-format torch``, one file per TP rank) interleaves the parts per rank;
it is refused, not cut.

The rows of every part (:func:`fused_rows`) and a MoE layer's names (:data:`MOE`) are tables both directions read:
the merge (:func:`ckpttool.families.nemotron_h.megatron_core_cut`) and ``split --to megatron``
(:mod:`.megatron_back_hybrid`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ckpttool.errors import ConfigError
from ckpttool.layout.layout import Box, Shape
from ckpttool.model.architecture import config_value
from ckpttool.plan.tiling import Slice
from ckpttool.plan.plan import TargetSpec

#: a Mamba layer tensor (after ``decoder.layers.{L}.``): group ``part`` names what it is
MIXER = re.compile(r"^(?:mixer\.(?P<part>in_proj\.weight\.(?:z|x|B|C|dt)|conv1d\.(?:weight|bias)\.(?:x|B|C)"
                   r"|in_proj\.weight|in_proj\.layer_norm_weight|A_log|D|dt_bias|norm\.weight|out_proj\.weight)"
                   r"|(?P<norm>norm\.weight))$")
#: the mixer tensors saved whole (one global tensor each, Megatron-Core's name = transformers')
WHOLE = ("A_log", "D", "dt_bias", "norm.weight", "out_proj.weight")
#: the fused tensors megatron-core saves as parts, each part's name in transformers' order of rows
FUSED = {"in_proj.weight": ("z", "x", "B", "C", "dt"), "conv1d.weight": ("x", "B", "C"), "conv1d.bias": ("x", "B", "C")}


def sizes(config: Mapping[str, object]) -> tuple[int, int, int]:
    """``(I, G*N, Nh)`` of the config's Mamba-2 mixer: inner size (heads x head_dim), groups x state, heads.

    Raises:
        ConfigError: the config lacks one of ``mamba_num_heads``, ``mamba_head_dim``, ``n_groups``,
            ``ssm_state_size``.
    """
    heads = config_value(config, "mamba_num_heads")
    head_dim = config_value(config, "mamba_head_dim")
    groups = config_value(config, "n_groups", "mamba_n_groups")
    state = config_value(config, "ssm_state_size", "mamba_state_dim")
    if not all(isinstance(v, int) and v > 0 for v in (heads, head_dim, groups, state)):
        raise ConfigError("the config does not give the Mamba-2 mixer's sizes (mamba_num_heads, mamba_head_dim, "
                          "n_groups, ssm_state_size)")
    return heads * head_dim, groups * state, heads


def cut(fqn: str, part: str | None, target: str, shape: Shape, config: Mapping[str, object]) -> tuple[str, int, int]:
    """Where Megatron-Core mixer tensor ``fqn`` goes: ``(HF name under target, first row, rows in all)``.

    ``part`` is :data:`MIXER`'s group (None: the layer's pre-norm); ``target`` the HF layer prefix
    (``backbone.layers.3.``). The tensor fills rows ``first..first+shape[0]`` of a target of ``rows in all`` rows.

    Raises:
        ConfigError: a fused ``in_proj.weight`` (legacy format), or a shape the config contradicts.
    """
    inner, _, heads = sizes(config)
    if part is None or part == "in_proj.layer_norm_weight":
        return target + "norm.weight", 0, shape[0] if shape else 0
    if part == "in_proj.weight":
        raise ConfigError(f"'{fqn}': a fused Mamba in_proj (rows [z, x, B, C, dt] of one TP rank's heads, as "
                          "--ckpt-format torch saves it) is not cut; save the checkpoint with --ckpt-format torch_dist, "
                          "whose in_proj.weight.{z,x,B,C,dt} are global")
    if part in WHOLE:
        expected = {"A_log": heads, "D": heads, "dt_bias": heads, "norm.weight": inner,
                    "out_proj.weight": config_value(config, "hidden_size")}[part]
        _check(fqn, shape, expected, part)
        return target + "mixer." + part, 0, expected
    tensor, section = part.rsplit(".", 1)
    rows, total = fused_rows(tensor, config)
    first, count = rows[section]
    _check(fqn, shape, count, part)
    return target + "mixer." + tensor, first, total

def fused_rows(tensor: str, config: Mapping[str, object]) -> tuple[dict[str, tuple[int, int]], int]:
    """The rows of every part of fused mixer tensor ``tensor`` (a key of :data:`FUSED`) in transformers' tensor:
    ``({part: (first row, rows)}, rows in all)``; the one table both directions read (merge: :func:`cut`; split:
    :mod:`.megatron_back_hybrid`).

    Raises:
        ConfigError: as :func:`sizes`.
    """
    inner, gn, heads = sizes(config)
    counts = {"z": inner, "x": inner, "B": gn, "C": gn, "dt": heads}
    rows, first = {}, 0
    for part in FUSED[tensor]:
        rows[part] = (first, counts[part])
        first += counts[part]
    return rows, first


def _check(fqn: str, shape: Shape, rows: int, part: str) -> None:
    if not shape or shape[0] != rows:
        found = shape[0] if shape else 0
        # a whole fraction of the rows: one TP rank's heads and groups saved as the global part (the padded-vocab
        # incident's kind), the cause to name
        cut = (f"; {found} rows is one of {rows // found} TP pieces: was one tensor-parallel rank's part saved as "
               "the whole?") if found and rows % found == 0 and rows // found > 1 else ""
        raise ConfigError(f"'{fqn}': {shape[0] if shape else 'no'} rows, expected {rows} for the Mamba-2 mixer's "
                          f"'{part}' from the config (mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size){cut}")


def spec(name: str, pieces: list[tuple[str, int, Shape]], total: int) -> TargetSpec:
    """One HF target of ``total`` rows tiled by ``(source, first row, source shape)`` pieces, each whole."""
    rest = pieces[0][2][1:]
    slices = tuple(Slice(src, Box.whole(shape), Box((first, *(0 for _ in rest)), shape))
                   for src, first, shape in pieces)
    return TargetSpec(name, (total, *rest), slices)


#: a MoE layer (``E``) of a hybrid ``MambaModel``, after ``decoder.layers.{L}.`` -> Nemotron-H's names after
#: ``backbone.layers.{L}.``; ``{e}``: one tensor per routed expert of the stacked tensor's leading axis (SequentialMLP
#: in ``torch_dist``: ``(E, F, H)`` and ``(E, H, F)``). Squared-ReLU experts are not gated: ``linear_fc1`` is
#: ``up_proj`` whole. The one table both directions read.
MOE = {
    "pre_mlp_layernorm.weight": "norm.weight",
    "mlp.router.weight": "mixer.gate.weight",
    "mlp.router.expert_bias": "mixer.gate.e_score_correction_bias",
    "mlp.experts.experts.linear_fc1.weight": "mixer.experts.{e}.up_proj.weight",
    "mlp.experts.experts.linear_fc2.weight": "mixer.experts.{e}.down_proj.weight",
    "mlp.shared_experts.linear_fc1.weight": "mixer.shared_experts.up_proj.weight",
    "mlp.shared_experts.linear_fc2.weight": "mixer.shared_experts.down_proj.weight",
}


def moe_specs(fqn: str, suffix: str, target: str, shape: Shape) -> list[TargetSpec]:
    """The HF tensors of MoE layer tensor ``fqn`` (``suffix`` after its layer, ``target`` the HF layer prefix):
    one whole, or one per expert (a box of the leading axis each).

    Raises:
        ConfigError: a tensor :data:`MOE` does not name.
    """
    name = MOE.get(suffix)
    if name is None:
        raise ConfigError(f"'{fqn}': '{suffix}' is not a tensor of Nemotron-H's MoE layer ({', '.join(sorted(MOE))})")
    if "{e}" not in name:
        return [TargetSpec(target + name, tuple(shape), (Slice(fqn, Box.whole(tuple(shape)), Box.whole(tuple(shape))),))]
    inner = tuple(shape[1:])
    return [TargetSpec(target + name.format(e=e), inner,
                       (Slice(fqn, Box((e, *(0 for _ in inner)), (1, *inner)), Box.whole(inner)),))
            for e in range(shape[0])]
