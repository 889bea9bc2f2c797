"""Nemotron-H the way back (split ``--to megatron``): the global tensors megatron-core 0.16's hybrid ``MambaModel``
(``hybrid_override_pattern``, the local modules: ``ColumnParallelLinear``, ``RowParallelLinear``, torch norms) saves,
listed from the HuggingFace model's tensors.

Its layers are of several kinds, so megatron-core does not stack them: every layer is saved under its own global
number, ``decoder.layers.{i}.*``, as the kind the pattern gives it:

- a Mamba-2 layer (``M``): the pre-norm ``norm.weight``, the mixer's ``dt_bias``, ``A_log``, ``D``, its fused
  ``in_proj`` as five global parts ``mixer.in_proj.weight.{z,x,B,C,dt}`` and ``conv1d.{weight,bias}`` as
  ``.{x,B,C}`` (the rows of :func:`.megatron_mamba.fused_rows`, the table the merge reads), ``mixer.norm.weight``
  and ``mixer.out_proj.weight``;
- attention (``*``): ``input_layernorm``, ``self_attention.linear_qkv`` (per query group) and ``linear_proj``;
- a squared-ReLU MLP (``-``): ``pre_mlp_layernorm``, ``mlp.linear_fc1`` (``up_proj``, not gated) and ``linear_fc2``;
- a MoE layer (``E``): :data:`.megatron_mamba.MOE`'s tensors, the merge's table: ``pre_mlp_layernorm``, the router
  and its expert bias, the experts stacked over a leading expert axis (``mlp.experts.experts.linear_fc1.weight`` is
  ``(E, F, H)``, not gated) and the shared expert;

then ``decoder.final_norm`` and ``output_layer``. Which HuggingFace element goes where is the merge's cut
(:func:`ckpttool.families.nemotron_h.megatron_core_cut`) turned around by :func:`.megatron_back.megatron_tensors`.
Tensor-parallel placements (:data:`TP_RULES`) are those megatron-core 0.16.1 saves with (read from
``fixtures/megatron_nemotron_h_tp2_pp2``): every Mamba part, ``A_log``, ``D``, ``dt_bias`` and the mixer's gated norm
by rows (each rank its own heads and groups), ``out_proj`` by columns; ``linear_qkv`` and the MLP's ``linear_fc1``
by rows, ``linear_proj`` and ``linear_fc2`` by columns; the layer norms, router and expert bias whole; the experts
over ``ep`` by their axis and, with expert tensor parallelism (``--etp`` = tp), ``linear_fc1`` by rows and
``linear_fc2`` by columns (``--etp 1``, as the producer trained: whole). Every linear layer saves an ``_extra_state``
(``shard_0_1``; the experts' one per expert, ``shard_{e}_{E}``), the output layer too.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ckpttool.errors import ConfigError
from ckpttool.families import hybrid
from ckpttool.families.adapter import REPLICATE, SHARD0, PlacementRules
from ckpttool.families.conventions import megatron_mamba
from ckpttool.layout.layout import Shape
from ckpttool.layout.placements import Placement

#: model types whose Megatron-Core form is this one
MODEL_TYPES = ("nemotron_h",)
#: the HuggingFace embedding of these models (``save_pretrained``'s names)
EMBEDDING = "backbone.embeddings.weight"
#: Megatron-Core tensor name (regex, searched) -> its tensor-parallel placement, per-layer names (no layer axis)
TP_RULES: PlacementRules = (
    (r"^(embedding\.word_embeddings|output_layer)\.weight$", SHARD0),
    (r"\.mlp\.experts\.experts\.linear_fc1\.weight$", Placement("shard", 1)),
    (r"\.mlp\.experts\.experts\.linear_fc2\.weight$", Placement("shard", 2)),
    (r"\.router\.(weight|expert_bias)$", REPLICATE),
    (r"\.mixer\.(in_proj\.weight\.\w+|conv1d\.(weight|bias)\.\w+|A_log|D|dt_bias|norm\.weight)$", SHARD0),
    (r"\.mixer\.out_proj\.weight$", Placement("shard", 1)),
    (r"\.(linear_qkv\.(weight|bias)|linear_fc1\.weight)$", SHARD0),
    (r"\.(linear_proj|linear_fc2)\.weight$", Placement("shard", 1)),
    (r"norm\.weight$", REPLICATE),
)
#: the linear layers (within a layer) whose ``_extra_state`` megatron-core saves (``shard_0_1``)
EXTRA_STATE = ("mixer.in_proj", "mixer.out_proj", "self_attention.linear_qkv", "self_attention.linear_proj",
               "mlp.linear_fc1", "mlp.linear_fc2", "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2",
               "mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2")
_MODULE = re.compile(r"^decoder\.layers\.(\d+)\.(.+?)\.weight(?:\.\w+)?$")


def megatron_shapes(disk: Mapping[str, Shape], config: Mapping[str, object], vocab_rows: int,
                    tied: bool) -> dict[str, Shape]:
    """The global tensors of a Nemotron-H model megatron-core's ``MambaModel`` saves, in its order, from the on-disk
    HuggingFace shapes ``disk``.

    Raises:
        ConfigError: a config without a layer pattern, a MoE layer, a layer without its kind's tensors.
    """
    kinds = hybrid.layer_kinds(config)
    if kinds is None:
        raise ConfigError("nemotron_h: the config gives no layer pattern (layers_block_type or "
                          "hybrid_override_pattern); Megatron-Core's MambaModel builds its layers from it")
    shapes: dict[str, Shape] = {"embedding.word_embeddings.weight": (vocab_rows, disk[EMBEDDING][1])}
    for i, kind in enumerate(kinds):
        h, m = f"backbone.layers.{i}.", f"decoder.layers.{i}."
        missing = [h + n for n in _NEEDS.get(kind, ()) if h + n not in disk]
        if missing or kind not in _NEEDS:
            raise ConfigError(f"nemotron_h: layer {i} ({kind!r} in the config's {hybrid.kind_key(config)}) has no "
                              f"{', '.join(repr(n) for n in missing) or 'Megatron-Core form'}")
        if kind == "linear_attention":
            shapes.update(_mamba(disk, h, m, config))
        elif kind == "moe":
            shapes.update(_moe(disk, h, m, config))
        elif kind == "full_attention":
            q, k = disk[h + "mixer.q_proj.weight"], disk[h + "mixer.k_proj.weight"]
            shapes[m + "input_layernorm.weight"] = disk[h + "norm.weight"]
            shapes[m + "self_attention.linear_proj.weight"] = disk[h + "mixer.o_proj.weight"]
            shapes[m + "self_attention.linear_qkv.weight"] = (q[0] + 2 * k[0], q[1])
            if h + "mixer.q_proj.bias" in disk:
                shapes[m + "self_attention.linear_qkv.bias"] = (q[0] + 2 * k[0],)
        else:
            shapes[m + "pre_mlp_layernorm.weight"] = disk[h + "norm.weight"]
            shapes[m + "mlp.linear_fc1.weight"] = disk[h + "mixer.up_proj.weight"]
            shapes[m + "mlp.linear_fc2.weight"] = disk[h + "mixer.down_proj.weight"]
    shapes["decoder.final_norm.weight"] = disk["backbone.norm_f.weight"]
    if not tied:  # tied: megatron-core shares the embedding and saves no output layer
        shapes["output_layer.weight"] = (vocab_rows, disk["lm_head.weight"][1])
    return shapes


#: the on-disk tensors (under ``backbone.layers.{i}.``) each layer kind must hold
_NEEDS = {
    "linear_attention": ("norm.weight", "mixer.in_proj.weight", "mixer.conv1d.weight", "mixer.A_log", "mixer.D",
                         "mixer.dt_bias", "mixer.norm.weight", "mixer.out_proj.weight"),
    "full_attention": ("norm.weight", "mixer.q_proj.weight", "mixer.k_proj.weight", "mixer.o_proj.weight"),
    "mlp": ("norm.weight", "mixer.up_proj.weight", "mixer.down_proj.weight"),
    "moe": ("norm.weight", "mixer.gate.weight", "mixer.experts.0.up_proj.weight", "mixer.experts.0.down_proj.weight"),
}


def _moe(disk: Mapping[str, Shape], h: str, m: str, config: Mapping[str, object]) -> dict[str, Shape]:
    """One MoE layer's tensors, named by the merge's table (:data:`.megatron_mamba.MOE`), the experts stacked.

    Raises:
        ConfigError: a latent MoE (``moe_latent_size``: megatron-core 0.16's MoE layer has no latent projections).
    """
    if config.get("moe_latent_size") is not None:
        raise ConfigError(f"nemotron_h: '{h}mixer' projects its experts through moe_latent_size "
                          f"{config['moe_latent_size']} (fc1_latent_proj, fc2_latent_proj), which megatron-core "
                          "0.16's MoE layer does not hold")
    experts = disk[h + "mixer.gate.weight"][0]
    out: dict[str, Shape] = {}
    for meg, hf in megatron_mamba.MOE.items():
        if "{e}" in hf:
            out[m + meg] = (experts, *disk[h + hf.format(e=0)])
        elif h + hf in disk:  # the expert bias and the shared expert: only where the model has them
            out[m + meg] = disk[h + hf]
    return out


def _mamba(disk: Mapping[str, Shape], h: str, m: str, config: Mapping[str, object]) -> dict[str, Shape]:
    """One Mamba-2 layer's tensors, in megatron-core's order, its fused tensors cut by the merge's own table."""
    out: dict[str, Shape] = {m + "mixer." + n: disk[h + "mixer." + n] for n in ("dt_bias", "A_log", "D")}
    for tensor in megatron_mamba.FUSED:
        if h + "mixer." + tensor not in disk:  # conv1d.bias: only with use_conv_bias
            continue
        rows, _ = megatron_mamba.fused_rows(tensor, config)
        rest = disk[h + "mixer." + tensor][1:]
        out.update({f"{m}mixer.{tensor}.{part}": (count, *rest) for part, (_, count) in rows.items()})
    out[m + "mixer.norm.weight"] = disk[h + "mixer.norm.weight"]
    out[m + "mixer.out_proj.weight"] = disk[h + "mixer.out_proj.weight"]
    out[m + "norm.weight"] = disk[h + "norm.weight"]
    return out


def extra_state_modules(shapes: Mapping[str, Shape]) -> list[tuple[str, int | None, int]]:
    """Every module whose ``_extra_state`` megatron-core saves, with its layer (None: the output layer, on the last
    stage) and its experts (0: one ``shard_0_1``; ``E``: one ``shard_{e}_{E}`` per expert, on the expert's EP rank)."""
    out: list[tuple[str, int | None, int]] = []
    for name, shape in shapes.items():
        match = _MODULE.match(name)
        if match is not None and match[2] in EXTRA_STATE:
            experts = shape[0] if match[2].startswith("mlp.experts.") else 0
            entry = (name[:match.end(2)], int(match[1]), experts)
            if entry not in out:
                out.append(entry)
    if "output_layer.weight" in shapes:
        out.append(("output_layer", None, 0))
    return out


def mesh_problems(config: Mapping[str, object], tp: int, vpp: int = 1) -> list[str]:
    """What of the mesh megatron-core's ``MambaModel`` does not build, one line each: virtual pipeline stages
    (``MambaStack`` asserts there are none), a ``tp`` that cuts through the Mamba-2 mixers' heads or groups."""
    problems = []
    if vpp > 1:
        problems.append(f"vpp={vpp}: megatron-core's MambaStack (the hybrid model) has no virtual pipeline stages")
    if not any(kind == "linear_attention" for kind in hybrid.layer_kinds(config) or ()):
        return problems
    heads = config.get("mamba_num_heads")
    groups = config.get("n_groups", config.get("mamba_n_groups"))
    for value, key in ((heads, "mamba_num_heads"), (groups, "n_groups")):
        if isinstance(value, int) and value % tp:
            problems.append(f"tp={tp} does not divide the Mamba-2 mixer's {value} {key}: megatron-core gives each "
                            "rank whole heads and groups")
    return problems


def stacked_view(shapes: Mapping[str, Shape], config: Mapping[str, object]) -> dict[str, Shape]:
    """The sizes :func:`.megatron_back.training_args` reads off stacked names (the layer count, the attention's
    rows per query group, the hidden size), whether or not the pattern has an attention layer."""
    layers = len(hybrid.layer_kinds(config) or ())
    heads = int(config.get("num_attention_heads") or 0)
    groups = int(config.get("num_key_value_heads") or heads)
    head_dim = int(config.get("head_dim") or 0)
    hidden = shapes["embedding.word_embeddings.weight"][1]
    view: dict[str, Shape] = {"decoder.layers.self_attention.linear_qkv.weight": (layers, (heads + 2 * groups) * head_dim,
                                                                                  hidden)}
    for name, shape in shapes.items():  # the first MoE layer's experts and shared expert
        for part in ("mlp.experts.experts.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight"):
            if name.endswith("." + part):
                view.setdefault("decoder.layers." + part, (layers, *shape))
    return view


def training_args(config: Mapping[str, object]) -> dict[str, object]:
    """The arguments Megatron-LM's ``pretrain_mamba.py`` builds this Nemotron-H with, beside the common ones (what
    :func:`ckpttool.families.nemotron_h.megatron_args` checks on the way in): the layer pattern, the Mamba-2 sizes,
    no position embedding, the squared-ReLU MLP."""
    by_kind = {kind: symbol for symbol, kind in hybrid.PATTERN_KINDS.items()}
    return {
        "is_hybrid_model": True, "hybrid_override_pattern": "".join(by_kind[k] for k in hybrid.layer_kinds(config) or ()),
        "hybrid_attention_ratio": 0.0, "hybrid_mlp_ratio": 0.0,
        "mamba_state_dim": config.get("ssm_state_size"), "mamba_head_dim": config.get("mamba_head_dim"),
        "mamba_num_groups": config.get("n_groups"), "mamba_num_heads": config.get("mamba_num_heads"),
        "position_embedding_type": "none", "swiglu": False, "squared_relu": True,
        "ffn_hidden_size": config.get("intermediate_size"), "kv_channels": config.get("head_dim"),
        "norm_epsilon": config.get("layer_norm_epsilon"),
        **(_moe_args(config) if "moe" in (hybrid.layer_kinds(config) or ()) else {}),
    }


def _moe_args(config: Mapping[str, object]) -> dict[str, object]:
    """Nemotron-H's router and experts in Megatron-LM's words: sigmoid scores, the expert bias for the choice, the
    top-k weights normalised and scaled, group-limited when ``n_group`` > 1, squared-ReLU experts and shared expert."""
    groups = config.get("n_group")
    return {"num_experts": config.get("n_routed_experts"), "moe_router_topk": config.get("num_experts_per_tok"),
            "moe_ffn_hidden_size": config.get("moe_intermediate_size"),
            "moe_shared_expert_intermediate_size": config.get("moe_shared_expert_intermediate_size"),
            "moe_shared_expert_gate": False, "moe_router_score_function": "sigmoid",
            "moe_router_enable_expert_bias": True, "moe_router_topk_scaling_factor": config.get("routed_scaling_factor"),
            "moe_router_pre_softmax": False,
            "moe_router_num_groups": groups if isinstance(groups, int) and groups > 1 else None,
            "moe_router_group_topk": config.get("topk_group") if isinstance(groups, int) and groups > 1 else None,
            "moe_grouped_gemm": False}
