"""Nemotron-H (transformers ``NemotronHForCausalLM``): Mamba-2 mixers beside attention, MLP and MoE layers, one kind a
layer as the config's ``layers_block_type`` (or a release's ``hybrid_override_pattern``) says.

Names: transformers 5 keeps the model under ``model.*`` in memory and ``save_pretrained`` writes ``backbone.*`` (its
conversion mapping renames ``backbone.`` to ``model.`` on load); ``lm_head`` keeps its name. Every layer's mixer is
``mixer``: a Mamba-2 layer holds ``mixer.in_proj [2*I + 2*G*N + Nh, H]``, ``conv1d.{weight,bias}``, ``A_log``, ``D``,
``dt_bias``, ``norm.weight`` and ``out_proj``; an attention layer ``mixer.{q,k,v,o}_proj``; an MLP layer
``mixer.{up,down}_proj``. A MoE layer's routed experts are stacked in memory (``mixer.experts.up_proj [E, I, H]``,
``down_proj [E, H, I]``) and saved per expert (``mixer.experts.E.up_proj.weight``), as transformers' conversion
merges them.

From Megatron-Core (``MambaModel`` with a ``hybrid_override_pattern``, ``torch_dist``): :func:`megatron_core_cut`.
The Mamba-2 mixers are :mod:`.conventions.megatron_mamba`'s; attention (QKV grouped per query group, no position
embedding) and the MLP's ``linear_fc2`` are the Megatron-Core convention's cut under Nemotron-H's names
(``mixer.{q,k,v,o}_proj``, ``mixer.down_proj``; every layer's pre-norm is ``norm``); the MLP's ``linear_fc1`` is
squared-ReLU and not gated, so it is ``mixer.up_proj`` whole; ``decoder.final_norm`` is ``backbone.norm_f``. A MoE
layer (``E``) is :data:`.megatron_mamba.MOE`'s: the router into ``mixer.gate`` (its expert bias into
``e_score_correction_bias``), each stacked expert's ``linear_fc1`` / ``linear_fc2`` into ``mixer.experts.{e}.up_proj`` /
``down_proj`` (not gated), the shared expert into ``mixer.shared_experts``. Which layer is which comes from the config's
pattern, and a tensor of another kind of layer is refused.

Tensor parallel (``split --to dcp --tp N``), as transformers' plan for Nemotron-H cuts it
(``NemotronHConfig.base_model_tp_plan``): only the embeddings (``embedding_rowwise``: vocab rows) and the MoE experts
are sharded; the mixers (Mamba-2, attention, MLP) and ``lm_head`` are whole on every rank. The stacked experts are
cut as that plan cuts them (``up_proj`` colwise, ``down_proj`` rowwise) by :mod:`ckpttool.families.expert_tp`, for
every MoE family; ``ep`` shards them instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from ckpttool.errors import ConfigError
from ckpttool.families import hybrid
from ckpttool.families.adapter import REPLICATE, SHARD0, CutResult, FamilyAdapter, PlacementRules
from ckpttool.families.conventions import megatron_core, megatron_mamba
from ckpttool.families.layers import LayerRule
from ckpttool.families.rules import Rename, Rules, Unstack
from ckpttool.layout.layout import Box, Layout
from ckpttool.model.description import ModelInfo
from ckpttool.plan.tiling import Slice
from ckpttool.plan.plan import TargetSpec

NAME = "nemotron_h"
RULES: Rules = (
    Unstack(r"^model\.(.*)\.mixer\.experts\.up_proj$", ("backbone.{prefix}.mixer.experts.{expert}.up_proj.weight",)),
    Unstack(r"^model\.(.*)\.mixer\.experts\.down_proj$",
            ("backbone.{prefix}.mixer.experts.{expert}.down_proj.weight",)),
    Rename(r"^model\.(.*)$", r"backbone.\1"),
)
#: transformers' plan: the vocab rows of the embeddings, nothing else of the dense model
TP_RULES: PlacementRules = (
    (r"(^|\.)embeddings\.weight$", SHARD0),
    (r".", REPLICATE),
)


_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.+)$")
_FINAL_NORMS = ("decoder.final_norm.weight", "decoder.final_layernorm.weight")
#: the Megatron-Core convention's (Llama) names -> Nemotron-H's on-disk names
_FROM_LLAMA = (
    (re.compile(r"^model\.embed_tokens\.weight$"), "backbone.embeddings.weight"),
    (re.compile(r"^model\.layers\.(\d+)\.self_attn\.([qkvo])_proj\.(weight|bias)$"), r"backbone.layers.\1.mixer.\2_proj.\3"),
    (re.compile(r"^model\.layers\.(\d+)\.(?:input_layernorm|post_attention_layernorm)\.weight$"),
     r"backbone.layers.\1.norm.weight"),
    (re.compile(r"^model\.layers\.(\d+)\.mlp\.down_proj\.weight$"), r"backbone.layers.\1.mixer.down_proj.weight"),
)


def megatron_core_cut(layout: Layout, info: ModelInfo) -> CutResult:
    """A Megatron-Core hybrid ``MambaModel`` layout under Nemotron-H's on-disk names (see the module docstring).

    Returns:
        ``(specs, notes, problems)``; a problem names the source tensor and what does not fit (a Mamba tensor in a
        layer the config's pattern makes another kind, a part of a shape the config contradicts, a fused legacy
        ``in_proj``, a MoE layer tensor the table does not name).
    """
    legacy = _legacy_mixer(layout)
    if legacy is not None:
        return [], [], [legacy]
    config = info.config
    kinds = hybrid.layer_kinds(config) or []
    key = hybrid.kind_key(config)
    problems: list[tuple[str, str]] = []
    specs: list[TargetSpec] = []
    mixers: dict[str, tuple[int, list]] = {}  # HF mixer tensor -> (rows in all, its pieces)
    rest = {}
    for fqn, tensor in layout.tensors.items():
        shape = tensor.true_shape
        match = _LAYER.match(fqn)
        if fqn in _FINAL_NORMS:
            specs.append(_whole("backbone.norm_f.weight", fqn, shape))
            continue
        if match is None:
            rest[fqn] = tensor
            continue
        layer, suffix = int(match[1]), match[2]
        kind = kinds[layer] if layer < len(kinds) else None
        h = f"backbone.layers.{layer}."
        mamba = megatron_mamba.MIXER.match(suffix)
        try:
            if mamba is not None and (mamba["part"] is not None or kind == "linear_attention"):
                if kind != "linear_attention":
                    raise ConfigError(f"'{fqn}': a Mamba-2 mixer tensor in layer {layer}, which the config's {key} "
                                      f"makes {_kind(kind)}")
                name, first, total = megatron_mamba.cut(fqn, mamba["part"], h, shape, config)
                mixers.setdefault(name, (total, []))[1].append((fqn, first, shape))
            elif kind == "moe":  # router, expert bias, experts and shared expert: megatron_mamba.MOE
                if suffix not in megatron_mamba.MOE:
                    raise ConfigError(f"'{fqn}': layer {layer} is a MoE layer ('E' in the config's {key}), whose "
                                      f"Megatron-Core tensors are {', '.join(sorted(megatron_mamba.MOE))}; not "
                                      f"'{suffix}'")
                specs.extend(megatron_mamba.moe_specs(fqn, suffix, h, shape))
            elif kind == "mlp" and suffix == "mlp.linear_fc1.weight":  # squared ReLU, not gated: fc1 is up_proj
                specs.append(_whole(h + "mixer.up_proj.weight", fqn, shape))
            else:
                rest[fqn] = tensor
        except ConfigError as e:
            problems.append((fqn, str(e)))
    for name, (total, pieces) in mixers.items():
        specs.append(megatron_mamba.spec(name, pieces, total))
    llama, notes, more = megatron_core.to_hf(replace(layout, tensors=rest), info)
    specs += [replace(s, name=_nemotron_name(s.name)) for s in llama]
    return specs, notes, problems + more


def _legacy_mixer(layout: Layout) -> tuple[str, str] | None:
    """One refusal for a ``--ckpt-format torch`` source holding Mamba mixers: each rank saved its own heads' fused
    ``in_proj`` and per-head tensors, which the legacy reader (with no TP table for them) would not regroup."""
    if layout.format != "megatron-legacy":
        return None
    for fqn in layout.tensors:
        match = _LAYER.match(fqn)
        mamba = megatron_mamba.MIXER.match(match[2]) if match is not None else None
        if mamba is not None and mamba["part"] is not None:
            return (fqn, f"'{fqn}': a Mamba-2 mixer saved with --ckpt-format torch (each TP rank's fused in_proj "
                         "[z, x, B, C, dt] and its own heads' conv1d, A_log, D, dt_bias and norm), which ckpttool "
                         "does not regroup; merge the same run's --ckpt-format torch_dist checkpoint, whose mixer "
                         "parts are global")
    return None


def _kind(kind: str | None) -> str:
    words = {"full_attention": "an attention layer", "mlp": "an MLP layer", "moe": "a MoE layer"}
    return words.get(kind or "", "no layer (past its length)")


def _whole(name: str, source: str, shape: tuple[int, ...]) -> TargetSpec:
    return TargetSpec(name, tuple(shape), (Slice(source, Box.whole(tuple(shape)), Box.whole(tuple(shape))),))


def _nemotron_name(name: str) -> str:
    for pattern, to in _FROM_LLAMA:
        if pattern.match(name):
            return pattern.sub(to, name)
    return name


def megatron_args(args: Any, info: ModelInfo) -> list[str]:
    """The layer pattern a Megatron-LM run's args record (``hybrid_override_pattern``) against the config's: the
    same tensors in another order of layers would load into the wrong layers. Not compared when either is absent.

    Returns:
        One line when they differ, expected vs found.
    """
    got = args.get("hybrid_override_pattern") if isinstance(args, dict) else getattr(args, "hybrid_override_pattern",
                                                                                      None)
    kinds = hybrid.layer_kinds(info.config)
    if not isinstance(got, str) or not got or kinds is None:
        return []
    by_kind = {kind: symbol for symbol, kind in hybrid.PATTERN_KINDS.items()}
    want = "".join(by_kind.get(kind, "?") for kind in kinds)
    if got != want:
        return [f"hybrid_override_pattern: {want!r} expected (the config's {hybrid.kind_key(info.config)}), "
                f"found {got!r} in the args"]
    return []


ADAPTER = FamilyAdapter(NAME, rules=RULES, tp_rules=TP_RULES, cuts=((megatron_core.NAME, megatron_core_cut),),
                        args_checks=(megatron_args,))


def _block_types(config: Mapping[str, object]) -> list[str]:
    """Each decoder layer's block (Mamba-2, attention, MLP, MoE): ``layers_block_type`` as transformers 5 saves it,
    else a release's ``hybrid_override_pattern`` (``M``, ``*``, ``-``, ``E``), one character a layer."""
    blocks = config.get("layers_block_type")
    if blocks is None:
        blocks = config["hybrid_override_pattern"]
        if not isinstance(blocks, str):
            raise TypeError(f"hybrid_override_pattern is {blocks!r}")
        return list(blocks)
    if not isinstance(blocks, list):
        raise TypeError(f"layers_block_type is {blocks!r}")
    return [str(b) for b in blocks]


def _keep_blocks(config: Mapping[str, object], layers: list[int]) -> dict[str, object]:
    blocks = _block_types(config)
    reduced = {**config, "num_hidden_layers": len(layers)}
    if config.get("layers_block_type") is None:
        reduced["hybrid_override_pattern"] = "".join(blocks[i] for i in layers)
    else:
        reduced["layers_block_type"] = [blocks[i] for i in layers]
    return reduced


#: a layer's kind is its block; transformers names the layers ``model.layers.N`` in memory, ``backbone.layers.N``
#: on disk
LAYERS = LayerRule((NAME,), kinds=_block_types, shrink=_keep_blocks, prefixes=("model.layers.", "backbone.layers."))
