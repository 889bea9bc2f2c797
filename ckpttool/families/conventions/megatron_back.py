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
"""

from __future__ import annotations

from collections.abc import Mapping

from ckpttool.model.architecture import ModelInfo
from ckpttool.layout.layout import Layout, Padding, Shape, TensorLayout
from ckpttool.plan.plan import Slice
from ckpttool.errors import ConfigError
from ckpttool.families.adapter import REPLICATE, SHARD0, PlacementRules, placement_of
from ckpttool.families.conventions import megatron_core
from ckpttool.layout.placements import Placement

#: tensors whose rows are the (padded) vocab
VOCAB = ("embedding.word_embeddings.weight", "output_layer.weight")
#: stacked tensors with an expert axis (dim 1)
EXPERT_TENSORS = ("decoder.layers.mlp.experts.experts.linear_fc1.weight",
                  "decoder.layers.mlp.experts.experts.linear_fc2.weight")
#: model types whose HuggingFace tensors this convention places
MODEL_TYPES = ("llama", "mistral", "qwen2", "mixtral", "qwen2_moe")

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
#: the linear layers whose ``_extra_state`` megatron-core saves beside their weights
EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_qkv", "mlp.linear_fc1", "mlp.linear_fc2",
               "mlp.experts.experts.linear_fc1", "mlp.experts.experts.linear_fc2", "mlp.shared_experts.linear_fc1",
               "mlp.shared_experts.linear_fc2")


def tp_placement(name: str) -> Placement:
    """The tensor-parallel placement of Megatron-Core global tensor ``name`` (:data:`TP_RULES`).

    Raises:
        ConfigError: no rule places it (a tensor :func:`megatron_shapes` does not list: a bug or a new tensor).
    """
    placement = placement_of(name, TP_RULES)
    if placement is None:
        raise ConfigError(f"'{name}': the Megatron-Core convention knows no tensor-parallel placement for it")
    return placement


def padded_vocab(vocab: int, divisible_by: int, tp: int) -> int:
    """Megatron-LM's ``_vocab_size_with_padding``: ``vocab`` rounded up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return -(-vocab // multiple) * multiple


def megatron_shapes(info: ModelInfo, vocab_rows: int) -> dict[str, Shape]:
    """The global tensors megatron-core's GPT model of ``info`` saves (local spec, stacked layers), in the order
    its ``sharded_state_dict`` lists them, with ``vocab_rows`` (padded) vocab rows.

    Raises:
        ConfigError: a model type or a layer structure this convention has no Megatron-Core form for (layers
            that are not all alike: some MoE, some dense).
    """
    if info.model_type not in MODEL_TYPES:
        raise ConfigError(f"model_type {info.model_type!r}: ckpttool knows no Megatron-Core form for it; split "
                          f"--to megatron writes {', '.join(MODEL_TYPES)}")
    disk, config = info.disk_shapes, info.config
    layers = int(config.get("num_hidden_layers") or 0)
    shapes: dict[str, Shape] = {"embedding.word_embeddings.weight": (vocab_rows, disk["model.embed_tokens.weight"][1])}
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


def _layer_kind(disk: Mapping[str, Shape], i: int) -> str:
    h = f"model.layers.{i}."
    if h + "mlp.gate_proj.weight" in disk:
        return "dense"
    if h + "block_sparse_moe.gate.weight" in disk or h + "mlp.gate.weight" in disk:
        return "moe"
    return "unknown MLP"


def from_hf(info: ModelInfo, vocab_rows: int) -> list[tuple[str, Shape, tuple[Slice, ...], int | None]]:
    """Every global tensor megatron-core saves for ``info``, as slices of on-disk HuggingFace tensors:
    ``(name, shape, slices, true_rows)``, ``true_rows`` the vocab rows that hold data (None: not padded; rows
    beyond it are padding, written as zeros). :func:`.megatron_core.to_hf` run on those tensors, turned around.

    Raises:
        ConfigError: as :func:`megatron_shapes`, or a tensor the cut cannot place (the config contradicts it).

    Example:
        >>> [name for name, *_ in from_hf(info, 1024)][:2]  # doctest: +SKIP
        ['embedding.word_embeddings.weight', 'decoder.layers.self_attention.linear_qkv.layer_norm_weight']
    """
    shapes = megatron_shapes(info, vocab_rows)
    vocab = info.disk_shapes["model.embed_tokens.weight"][0]
    tensors = {name: TensorLayout(name, shape, "", (), (Padding(0, vocab),) if name in VOCAB and shape[0] != vocab else ())
               for name, shape in shapes.items()}
    specs, _, problems = megatron_core.to_hf(Layout("", megatron_core.FORMATS[0], tensors), info)
    if problems:
        raise ConfigError(f"{info.model_type}: the Megatron-Core convention cannot place "
                          + "; ".join(message for _, message in problems[:5]))
    slices: dict[str, list[Slice]] = {name: [] for name in shapes}
    for spec in specs:
        for sl in spec.slices:
            slices[sl.source].append(Slice(info.tied.get(spec.name, spec.name), sl.dst, sl.src))
    placed = {spec.name for spec in specs}
    left = sorted(name for name in info.disk_shapes if name not in placed)
    if left:  # e.g. biases of o_proj or the MLP (Megatron's add_bias_linear): never dropped silently
        raise ConfigError(f"{info.model_type}: {len(left)} tensor{'s' if len(left) != 1 else ''} of the model have no "
                          f"place in the Megatron-Core form ckpttool writes: {', '.join(repr(n) for n in left[:5])}")
    return [(name, shape, tuple(slices[name]), vocab if name in VOCAB and shape[0] != vocab else None)
            for name, shape in shapes.items()]


def training_args(info: ModelInfo, shapes: Mapping[str, Shape], *, tp: int, pp: int, ep: int, divisible_by: int,
                  iteration: int) -> dict[str, object]:
    """The Megatron-LM training arguments ``common.pt`` records for this model (its Megatron-Core global tensors'
    ``shapes``) on ``tp`` x ``pp`` x ``ep`` ranks: those its ``load_checkpoint`` compares and the ones a reader
    needs to tell padding from vocab."""
    config = info.config
    heads = int(config.get("num_attention_heads") or 0)
    groups = int(config.get("num_key_value_heads") or heads)
    qkv = shapes["decoder.layers.self_attention.linear_qkv.weight"]
    experts = shapes.get(EXPERT_TENSORS[0])
    shared = shapes.get("decoder.layers.mlp.shared_experts.linear_fc1.weight")
    dense = shapes.get("decoder.layers.mlp.linear_fc1.weight")
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    theta = config.get("rope_theta") or rope.get("rope_theta") or 10000.0
    args: dict[str, object] = {
        "num_layers": qkv[0], "hidden_size": qkv[2], "num_attention_heads": heads, "group_query_attention": groups != heads,
        "num_query_groups": groups, "kv_channels": qkv[1] // (heads + 2 * groups),
        "ffn_hidden_size": (dense[1] // 2 if dense else int(config.get("intermediate_size") or experts[2] // 2)),
        "max_position_embeddings": config.get("max_position_embeddings"), "position_embedding_type": "rope",
        "rotary_base": int(theta), "normalization": "RMSNorm", "norm_epsilon": config.get("rms_norm_eps"), "swiglu": True,
        "add_bias_linear": False, "add_qkv_bias": "decoder.layers.self_attention.linear_qkv.bias" in shapes,
        "untie_embeddings_and_output_weights": "output_layer.weight" in shapes,
        "tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp,
        "expert_model_parallel_size": ep, "expert_tensor_parallel_size": tp,
        "make_vocab_size_divisible_by": divisible_by,
        "padded_vocab_size": shapes["embedding.word_embeddings.weight"][0], "transformer_impl": "local",
        "ckpt_format": "torch_dist", "iteration": iteration, "num_experts": experts[1] if experts else None,
    }
    if experts:
        args.update(moe_ffn_hidden_size=experts[2] // 2, moe_router_topk=config.get("num_experts_per_tok"),
                    moe_grouped_gemm=False)
    if shared:
        args.update(moe_shared_expert_intermediate_size=shared[1] // 2,
                    moe_shared_expert_gate="decoder.layers.mlp.shared_experts.gate_weight" in shapes)
    return args
