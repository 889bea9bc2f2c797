"""The Megatron-Core convention the way back (split ``--to megatron``): its global tensors as slices of the
on-disk HuggingFace ones.

Which global tensors megatron-core's GPT model (the local layer spec) saves with ``sharded_state_dict()`` is
listed here from the HuggingFace model's own tensors: per-layer tensors stacked with a leading layer axis
(``decoder.layers.self_attention.linear_qkv.weight`` is ``(L, rows, H)``), experts with a second axis
(``decoder.layers.mlp.experts.experts.linear_fc1.weight`` is ``(L, E, 2F, H)``), norms under Transformer
Engine's names (``linear_qkv.layer_norm_weight``), the vocab padded. *Where* each HuggingFace element goes is
not written here a second time: those tensors are run through :func:`.megatron_core.to_hf` (the merge's cut:
fused QKV per query group, SwiGLU ``[gate; up]``, experts, padding stripped) and every box it gives is turned
around, as :func:`.rules.memory_slices` does for the HF rules, so the two directions cannot disagree.

A family whose Megatron-Core cut is its own (:meth:`FamilyAdapter.cut_for`, gpt-oss's) is run backwards the same
way. A HuggingFace target that cut builds through a transform (gpt-oss's experts: ``gate_up_proj`` is fc1
interleaved and transposed) comes back as a Megatron-Core tensor that is the *inverse* transform, lifted over the
leading layer axis, of a pre tensor whose slices are whole HuggingFace boxes (:attr:`MegatronTensor.transform`); the
split composes it chunk by chunk (:func:`ckpttool.plan.compose.compose`), so a chunk must hold whole blocks of the
transform, or one part of a de-interleave (:func:`ckpttool.plan.transforms.within_part`): gpt-oss's experts whole
(``expert_tensor_parallel_size`` 1, as Megatron-Bridge trains it, the default) or cut by expert tensor parallelism
(:data:`EXPERT_TP_RULES`), where a rank's gate rows and its up rows are each one part of HuggingFace's columns.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple
from dataclasses import replace

from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import Layout, Padding, Shape, TensorLayout
from ckpttool.plan.tiling import Slice
from ckpttool.plan.transforms import Chain, Permute, Transform, Transpose
from ckpttool.errors import ConfigError
from ckpttool.families.adapter import REPLICATE, SHARD0, PlacementRules, placement_of
from ckpttool.families.conventions import megatron_back_hybrid, megatron_back_mla, megatron_core
from ckpttool.families.conventions import megatron_mla as mla
from ckpttool.families.registry import adapter_for
from ckpttool.families import mtp
from ckpttool.layout.placements import Placement

#: tensors whose rows are the (padded) vocab
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
#: stacked tensors with an expert axis (dim 1): the experts' weights, then their biases (gpt-oss's)
EXPERT_TENSORS = ("decoder.layers.mlp.experts.experts.linear_fc1.weight",
                  "decoder.layers.mlp.experts.experts.linear_fc2.weight",
                  "decoder.layers.mlp.experts.experts.linear_fc1.bias",
                  "decoder.layers.mlp.experts.experts.linear_fc2.bias")
#: the end of a per-layer expert tensor's name (:func:`expert_axis`)
_PER_LAYER_EXPERT = tuple(n.removeprefix("decoder.layers.") for n in EXPERT_TENSORS)
#: model types whose HuggingFace tensors this convention places
MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe", "gpt_oss", *megatron_back_mla.MODEL_TYPES,
               *megatron_back_hybrid.MODEL_TYPES)

#: Megatron-Core tensor name (regex, searched) -> its tensor-parallel placement; the first match applies
TP_RULES: PlacementRules = (
    (r"^(embedding\.word_embeddings|output_layer)\.weight$", SHARD0),
    (r"^decoder\.layers\.mlp\.experts\.experts\.linear_fc1\.weight$", Placement("strided", 2, 2)),
    (r"^decoder\.layers\.mlp\.experts\.experts\.linear_fc2\.weight$", Placement("shard", 3)),
    (r"\.linear_qkv\.(weight|bias)$", Placement("shard", 1)),
    (r"\.linear_fc1\.weight$", Placement("strided", 1, 2)),
    (r"\.(linear_proj|linear_fc2)\.weight$", Placement("shard", 2)),
    (r"(layer_norm_weight|layernorm\.weight|router\.weight|gate_weight)$", REPLICATE),
)
#: model type -> the placements its own tensors take, tried before :data:`TP_RULES`. gpt-oss: the sinks are one
#: per head (cut like the heads), the biases of ``linear_proj`` and the router whole, and the experts not cut by
#: tensor parallelism (``expert_tensor_parallel_size`` 1): their fc1 is ``[gate; up]`` de-interleaved from
#: HuggingFace's columns, a transform whose blocks are a whole expert
FAMILY_TP_RULES: Mapping[str, PlacementRules] = {
    "gpt_oss": (
        (r"\.core_attention\.softmax_offset$", Placement("shard", 1)),
        (r"\.(linear_proj|router)\.bias$", REPLICATE),
        (r"^decoder\.layers\.mlp\.experts\.experts\.linear_fc[12]\.(weight|bias)$", REPLICATE),
    ),
    **{model_type: megatron_back_mla.TP_RULES for model_type in megatron_back_mla.MODEL_TYPES},
    **{model_type: megatron_back_hybrid.TP_RULES for model_type in megatron_back_hybrid.MODEL_TYPES},
}
#: the experts' placements when expert tensor parallelism cuts them (``expert_tensor_parallel_size`` = tp), for every
#: family: fc1 ``[gate_r; up_r]`` on each rank (its bias too), fc2 by input columns, fc2's bias whole (added once,
#: after the partial sums)
EXPERT_TP_RULES: PlacementRules = (
    (r"\.linear_fc1\.(weight|bias)$", Placement("strided", 2, 2)),
    (r"\.linear_fc2\.weight$", Placement("shard", 3)),
    (r"\.linear_fc2\.bias$", REPLICATE),
)
#: the linear layers whose ``_extra_state`` megatron-core saves beside their weights
EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2",
               "mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2", "mlp.shared_experts.linear_fc1",
               "mlp.shared_experts.linear_fc2")


def tp_placement(name: str, model_type: str = "", expert_tp: int = 0) -> Placement:
    """The tensor-parallel placement of Megatron-Core global tensor ``name`` of a ``model_type`` model
    (:data:`FAMILY_TP_RULES`, then :data:`TP_RULES`). With ``expert_tp`` (the expert tensor-parallel size; 0: the
    model's own rules), an expert tensor (:data:`EXPERT_TENSORS`) is whole on every TP rank at 1, else placed by
    :data:`EXPERT_TP_RULES`.

    Raises:
        ConfigError: no rule places it (a tensor :func:`megatron_shapes` does not list: a bug or a new tensor).
    """
    if expert_tp and name in EXPERT_TENSORS:
        return REPLICATE if expert_tp == 1 else placement_of(name, EXPERT_TP_RULES) or REPLICATE
    placement = placement_of(name, FAMILY_TP_RULES.get(model_type, ()) + TP_RULES)
    if placement is None:
        raise ConfigError(f"'{name}': the Megatron-Core convention knows no tensor-parallel placement for it")
    return placement


def expert_axis(name: str) -> int | None:
    """The expert axis of Megatron-Core global tensor ``name``: 1 for the stacked layers' experts
    (:data:`EXPERT_TENSORS`), 0 for a per-layer one's (``decoder.layers.{i}.mlp.experts.experts.*``), None for a
    tensor that is no expert's."""
    if name in EXPERT_TENSORS:
        return 1
    if megatron_back_mla.PER_LAYER.match(name) and name.endswith(_PER_LAYER_EXPERT):
        return 0
    return None


def hf_vocab(info: ModelInfo) -> int:
    """The vocab of the HuggingFace model's embedding (``model.embed_tokens``, Nemotron-H's
    ``backbone.embeddings``).

    Raises:
        ConfigError: a model type :func:`megatron_shapes` has no form for (its embedding is not known here).
    """
    name = megatron_back_hybrid.EMBEDDING if info.model_type in megatron_back_hybrid.MODEL_TYPES else "model.embed_tokens.weight"
    if name not in info.disk_shapes:
        raise ConfigError(f"model_type {info.model_type!r}: ckpttool knows no Megatron-Core form for it; split "
                          f"--to megatron writes {', '.join(MODEL_TYPES)}")
    return info.disk_shapes[name][0]


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: ``vocab`` rounded up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def refuse_model_type(model_type: str) -> None:
    """Refuse a model type this convention has no Megatron-Core form for (the config alone decides it).

    Raises:
        ConfigError: naming the model type and the ones written.
    """
    if model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type {model_type!r}: ckpttool knows no Megatron-Core form for it; split "
                          f"--to megatron writes {', '.join(MODEL_TYPES)}")


def megatron_shapes(info: ModelInfo, vocab_rows: int, mtp_layers: int = 0) -> dict[str, Shape]:
    """The global tensors megatron-core's GPT model of ``info`` saves (local spec, stacked layers; DeepSeek-V3's
    per layer, with ``mtp_layers`` MTP layers: :mod:`.megatron_back_mla`), in the order its ``sharded_state_dict``
    lists them, with ``vocab_rows`` (padded) vocab rows.

    Raises:
        ConfigError: a model type or a layer structure this convention has no Megatron-Core form for (layers
            that are not all alike: some MoE, some dense).
    """
    refuse_model_type(info.model_type)
    disk, config = info.disk_shapes, info.config
    if info.model_type in megatron_back_hybrid.MODEL_TYPES:
        return megatron_back_hybrid.megatron_shapes(disk, config, vocab_rows, "lm_head.weight" in info.tied)
    layers = int(config.get("num_hidden_layers") or 0)
    shapes: dict[str, Shape] = {"embedding.word_embeddings.weight": (vocab_rows, disk["model.embed_tokens.weight"][1])}
    if info.model_type == "gpt_oss":
        return _gpt_oss_shapes(info, layers, shapes, vocab_rows)
    if info.model_type in megatron_back_mla.MODEL_TYPES:
        disk = {**disk, **{n: s for layer in mtp.expected(info).values() for n, s in layer.items()}}
        return megatron_back_mla.megatron_shapes(disk, config, vocab_rows, "lm_head.weight" in info.tied, mtp_layers)
    kinds = {_layer_kind(disk, i) for i in range(layers)}
    if len(kinds) != 1:
        raise ConfigError(f"{info.model_type}: its layers are not all alike ({', '.join(sorted(kinds))}); Megatron-Core "
                          "stacks every layer under one name, so ckpttool writes only models whose layers all match")
    kind = kinds.pop()
    h = "model.layers.0."
    q, k, o = disk[h + "self_attn.q_proj.weight"], disk[h + "self_attn.k_proj.weight"], disk[h + "self_attn.o_proj.weight"]
    d = "decoder.layers."
    shapes[d + "self_attention.linear_qkv.layer_norm_weight"] = (layers, *disk[h + "input_layernorm.weight"])
    shapes[d + "self_attention.linear_proj.weight"] = (layers, *o)
    shapes[d + "self_attention.linear_qkv.weight"] = (layers, q[0] + 2 * k[0], q[1])
    if h + "self_attn.q_proj.bias" in disk:
        shapes[d + "self_attention.linear_qkv.bias"] = (layers, q[0] + 2 * k[0])
    shapes[d + "mlp.linear_fc1.layer_norm_weight"] = (layers, *disk[h + "post_attention_layernorm.weight"])
    if kind == "dense":
        gate, down = disk[h + "mlp.gate_proj.weight"], disk[h + "mlp.down_proj.weight"]
        shapes[d + "mlp.linear_fc1.weight"] = (layers, 2 * gate[0], gate[1])
        shapes[d + "mlp.linear_fc2.weight"] = (layers, *down)
    else:
        router = disk.get(h + "block_sparse_moe.gate.weight") or disk[h + "mlp.gate.weight"]
        experts = router[0]
        gate = disk.get(h + "block_sparse_moe.experts.0.w1.weight") or disk[h + "mlp.experts.0.gate_proj.weight"]
        down = disk.get(h + "block_sparse_moe.experts.0.w2.weight") or disk[h + "mlp.experts.0.down_proj.weight"]
        shapes[d + "mlp.router.weight"] = (layers, *router)
        shapes[EXPERT_TENSORS[0]] = (layers, experts, 2 * gate[0], gate[1])
        shapes[EXPERT_TENSORS[1]] = (layers, experts, *down)
        if h + "mlp.shared_expert.gate_proj.weight" in disk:
            sgate, sdown = disk[h + "mlp.shared_expert.gate_proj.weight"], disk[h + "mlp.shared_expert.down_proj.weight"]
            shapes[d + "mlp.shared_experts.linear_fc1.weight"] = (layers, 2 * sgate[0], sgate[1])
            shapes[d + "mlp.shared_experts.linear_fc2.weight"] = (layers, *sdown)
            if h + "mlp.shared_expert_gate.weight" in disk:
                shapes[d + "mlp.shared_experts.gate_weight"] = (layers, *disk[h + "mlp.shared_expert_gate.weight"])
    shapes["decoder.final_layernorm.weight"] = disk["model.norm.weight"]
    if "lm_head.weight" not in info.tied:  # tied: megatron-core shares the embedding and saves no output layer
        shapes["output_layer.weight"] = (vocab_rows, disk["lm_head.weight"][1])
    return shapes


def _gpt_oss_shapes(info: ModelInfo, layers: int, shapes: dict[str, Shape], vocab_rows: int) -> dict[str, Shape]:
    """gpt-oss's global tensors as megatron-core 0.16 saves them (``softmax_type="learnable"``, ``add_bias_linear``,
    SequentialMLP experts stacked), in its order; ``shapes`` holds the embedding already.

    Raises:
        ConfigError: a layer without gpt-oss's tensors (the on-disk names transformers gives its layer 0).
    """
    disk = info.disk_shapes
    h, d = "model.layers.0.", "decoder.layers."
    need = [h + n for n in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.o_proj.weight",
                            "self_attn.sinks", "mlp.router.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj")]
    missing = [n for n in need if n not in disk]
    if missing:
        raise ConfigError(f"gpt_oss: transformers' model has no {', '.join(repr(n) for n in missing)}; ckpttool's "
                          "Megatron-Core form of gpt-oss needs its sinks, router and stacked experts")
    q, k, o = disk[h + "self_attn.q_proj.weight"], disk[h + "self_attn.k_proj.weight"], disk[h + "self_attn.o_proj.weight"]
    gate_up, down, router = disk[h + "mlp.experts.gate_up_proj"], disk[h + "mlp.experts.down_proj"], disk[h + "mlp.router.weight"]
    shapes[d + "self_attention.linear_qkv.layer_norm_weight"] = (layers, *disk[h + "input_layernorm.weight"])
    shapes[d + "self_attention.core_attention.softmax_offset"] = (layers, *disk[h + "self_attn.sinks"])
    shapes[d + "self_attention.linear_proj.weight"] = (layers, *o)
    shapes[d + "self_attention.linear_proj.bias"] = (layers, o[0])
    shapes[d + "self_attention.linear_qkv.weight"] = (layers, q[0] + 2 * k[0], q[1])
    shapes[d + "self_attention.linear_qkv.bias"] = (layers, q[0] + 2 * k[0])
    shapes[d + "mlp.linear_fc1.layer_norm_weight"] = (layers, *disk[h + "post_attention_layernorm.weight"])
    shapes[d + "mlp.router.weight"] = (layers, *router)
    shapes[d + "mlp.router.bias"] = (layers, router[0])
    experts = gate_up[0]
    shapes[EXPERT_TENSORS[0]] = (layers, experts, gate_up[2], gate_up[1])  # [E, H, 2I] -> [gate; up] rows, [2I, H]
    shapes[EXPERT_TENSORS[2]] = (layers, experts, gate_up[2])
    shapes[EXPERT_TENSORS[1]] = (layers, experts, down[2], down[1])  # [E, I, H] -> an nn.Linear weight, [H, I]
    shapes[EXPERT_TENSORS[3]] = (layers, experts, down[2])
    shapes["decoder.final_layernorm.weight"] = disk["model.norm.weight"]
    if "lm_head.weight" not in info.tied:
        shapes["output_layer.weight"] = (vocab_rows, disk["lm_head.weight"][1])
    return shapes


def _layer_kind(disk: Mapping[str, Shape], i: int) -> str:
    h = f"model.layers.{i}."
    if h + "mlp.gate_proj.weight" in disk:
        return "dense"
    if h + "block_sparse_moe.gate.weight" in disk or h + "mlp.gate.weight" in disk:
        return "moe"
    return "unknown MLP"


class MegatronTensor(NamedTuple):
    """One global tensor megatron-core saves, as slices of on-disk HuggingFace tensors (:func:`megatron_tensors`)."""

    name: str
    shape: Shape
    #: boxes of HuggingFace tensors filling boxes of this tensor (of its pre tensor, with a ``transform``)
    slices: tuple[Slice, ...]
    #: the vocab rows that hold data (None: not padded); rows beyond it are padding, written as zeros
    true_rows: int | None
    #: None, or the map that makes this tensor of the pre tensor ``slices`` tile (:mod:`ckpttool.plan.transforms`)
    transform: Transform | None


def from_hf(info: ModelInfo, vocab_rows: int) -> list[tuple[str, Shape, tuple[Slice, ...], int | None]]:
    """:func:`megatron_tensors` as ``(name, shape, slices, true_rows)``, for models whose Megatron-Core tensors are
    all plain boxes of the HuggingFace ones.

    Raises:
        ConfigError: as :func:`megatron_tensors`, or a tensor made through a transform (gpt-oss's experts): its
            slices alone do not say where each element goes; use :func:`megatron_tensors`.
    """
    tensors = megatron_tensors(info, vocab_rows)
    turned = [t.name for t in tensors if t.transform is not None]
    if turned:
        raise ConfigError(f"{info.model_type}: {', '.join(repr(n) for n in turned[:3])} are made through a transform; "
                          "from_hf gives only boxes: use megatron_tensors")
    return [(t.name, t.shape, t.slices, t.true_rows) for t in tensors]


def megatron_tensors(info: ModelInfo, vocab_rows: int, mtp_layers: int = 0) -> list[MegatronTensor]:
    """Every global tensor megatron-core saves for ``info`` (with its first ``mtp_layers`` MTP layers), in its
    order, as slices of on-disk HuggingFace tensors: the family's Megatron-Core cut (or the convention's) run on
    those tensors, turned around. A HuggingFace target the cut builds through a transform comes back through its
    inverse. The copies of the embedding and output layer a release keeps in each MTP layer
    (:data:`.megatron_mla.MTP_SHARED`) are no Megatron-Core tensor's: Megatron shares the main ones.

    Raises:
        ConfigError: as :func:`megatron_shapes`, or a tensor the cut cannot place (the config contradicts it), or
            a HuggingFace tensor with no place in the Megatron-Core form (never dropped silently).

    Example:
        >>> [t.name for t in megatron_tensors(info, 1024)][:2]  # doctest: +SKIP
        ['embedding.word_embeddings.weight', 'decoder.layers.self_attention.linear_qkv.layer_norm_weight']
    """
    shapes = megatron_shapes(info, vocab_rows, mtp_layers)
    vocab = hf_vocab(info)
    tensors = {name: TensorLayout(name, shape, "", (), (Padding(0, vocab),) if name in VOCAB and shape[0] != vocab else ())
               for name, shape in shapes.items()}
    layout = Layout("", megatron_core.FORMATS[0], tensors)
    cut = adapter_for(info).cut_for(megatron_core.NAME)
    specs, _, problems = cut(layout, info) if cut is not None else megatron_core.to_hf(layout, info)
    if problems:
        raise ConfigError(f"{info.model_type}: the Megatron-Core convention cannot place "
                          + "; ".join(message for _, message in problems[:5]))
    slices: dict[str, list[Slice]] = {name: [] for name in shapes}
    transforms: dict[str, Transform | None] = {}
    copies = tuple(f".{part}" for part in mla.MTP_SHARED.values())
    for spec in specs:
        name = info.tied.get(spec.name, spec.name)
        if spec.name.startswith("model.layers.") and spec.name.endswith(copies) and all(sl.source in mla.MTP_SHARED for sl in spec.slices):
            continue
        inverse = spec.transform.bound(spec.shape, spec.name).inverse() if spec.transform is not None else None
        for sl in spec.slices:
            if inverse is None:
                slices[sl.source].append(Slice(name, sl.dst, sl.src))
            else:
                slices[sl.source].append(_turned(name, sl, inverse, shapes[sl.source], spec.shape))
            lifted = None if inverse is None else _lifted(inverse, len(shapes[sl.source]) - len(spec.shape))
            if transforms.setdefault(sl.source, lifted) != lifted:
                raise ConfigError(f"'{sl.source}': is made of HuggingFace tensors through different transforms "
                                  f"({_named(transforms[sl.source])} and {_named(lifted)}); ckpttool writes one "
                                  "transform per Megatron-Core tensor")
    placed = {spec.name for spec in specs}
    left = sorted(name for name in info.disk_shapes if name not in placed)
    if left:  # e.g. biases of o_proj or the MLP (Megatron's add_bias_linear): never dropped silently
        raise ConfigError(f"{info.model_type}: {len(left)} tensor{'s' if len(left) != 1 else ''} of the model have no "
                          f"place in the Megatron-Core form ckpttool writes: {', '.join(repr(n) for n in left[:5])}")
    return [MegatronTensor(name, shape, tuple(slices[name]), vocab if name in VOCAB and shape[0] != vocab else None,
                           transforms.get(name)) for name, shape in shapes.items()]


def _turned(name: str, sl: Slice, inverse: Transform, shape: Shape, target: Shape) -> Slice:
    """A slice of a transformed HuggingFace target (``sl``: a box of Megatron-Core tensor ``sl.source``, of
    ``shape``, fills a box of the target's pre tensor) turned around: the box of the HF tensor ``name`` (of shape
    ``target``) fills the box of the Megatron-Core tensor's own pre tensor, both through ``inverse`` (the
    target's transform undone; :func:`_lifted` over the Megatron-Core tensor's leading dims)."""
    hf_box = inverse.pre_box(inverse.target_shape(target), sl.dst)
    pre_box = _lifted(inverse, len(shape) - len(target)).pre_box(shape, sl.src)
    if hf_box is None or pre_box is None:
        raise ConfigError(f"'{sl.source}': its slice of '{name}' cuts through the blocks of {inverse.name}; ckpttool "
                          "turns around only slices of whole blocks")
    return Slice(name, hf_box, pre_box)


def _lifted(transform: Transform, lead: int) -> Transform:
    """``transform`` (its dims plain) moved ``lead`` dims to the right: the same map on a tensor with ``lead``
    more leading dims (a stacked layer axis)."""
    if isinstance(transform, Permute):  # its words name the dim too (interleave's "along dim 1")
        dim = transform.dim + lead
        moved = f"along dim {dim}"
        return replace(transform, dim=dim, label=transform.label.replace(f"along dim {transform.dim}", moved),
                       inverse_label=transform.inverse_label.replace(f"along dim {transform.dim}", moved))
    if isinstance(transform, Transpose):
        return Transpose(transform.dim0 + lead, transform.dim1 + lead)
    return Chain(tuple(_lifted(step, lead) for step in transform.steps))


def _named(transform: Transform | None) -> str:
    return "none" if transform is None else transform.name
