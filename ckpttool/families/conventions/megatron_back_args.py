"""The Megatron-LM training arguments a split ``--to megatron`` records in ``common.pt``: the ones megatron-core's
``load_checkpoint`` compares with the job's own, and the ones a reader needs to tell vocab padding from vocab.

They are read off the Megatron-Core global tensors :mod:`.megatron_back` lists (layers, hidden size, query groups, FFN
and expert sizes, the padded vocab) and the HuggingFace config (heads, rope base, norm epsilon, top-k), with
gpt-oss's own (:func:`_gpt_oss_args`) and DeepSeek-V3's MLA ones (:func:`.megatron_back_mla.training_args`). The way
in, a checkpoint's args checked against a config, is :mod:`.megatron_args`.
"""

from __future__ import annotations

from collections.abc import Mapping

from ckpttool.families.conventions import megatron_back_hybrid, megatron_back_mla
from ckpttool.families.conventions.megatron_back import EXPERT_TENSORS
from ckpttool.layout.layout import Shape
from ckpttool.model.description import ModelInfo

__all__ = ["training_args"]


def training_args(info: ModelInfo, shapes: Mapping[str, Shape], *, tp: int, pp: int, ep: int, divisible_by: int,
                  iteration: int, etp: int = 0, mtp_layers: int = 0) -> dict[str, object]:
    """The Megatron-LM training arguments ``common.pt`` records for this model (its Megatron-Core global tensors'
    ``shapes``) on ``tp`` x ``pp`` x ``ep`` ranks, experts cut by ``etp`` (0: the model's default): those its
    ``load_checkpoint`` compares and the ones a reader needs to tell padding from vocab."""
    config = info.config
    per_layer = info.model_type in megatron_back_mla.MODEL_TYPES
    hybrid = info.model_type in megatron_back_hybrid.MODEL_TYPES
    if per_layer:  # the sizes below read off stacked names
        shapes = {**shapes, **megatron_back_mla.stacked_view(shapes, config)}
    if hybrid:
        shapes = {**shapes, **megatron_back_hybrid.stacked_view(shapes, config)}
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
    if info.model_type == "gpt_oss":
        args.update(_gpt_oss_args(config))
    if etp:
        args["expert_tensor_parallel_size"] = etp
    if per_layer:
        args.update(megatron_back_mla.training_args(config, shapes, qkv[0], mtp_layers))
    if shared:
        args.update(moe_shared_expert_intermediate_size=shared[1] // 2,
                    moe_shared_expert_gate="decoder.layers.mlp.shared_experts.gate_weight" in shapes)
    if hybrid:  # last: its experts and shared expert are not gated (their FFN is fc1's rows, not half of them)
        args.update(megatron_back_hybrid.training_args(config))
    return args


def _gpt_oss_args(config: Mapping[str, object]) -> dict[str, object]:
    """The arguments megatron-core builds gpt-oss with (what :func:`ckpttool.families.gpt_oss.megatron_args`
    checks on the way in): biases on every linear layer, the sinks as a learnable softmax offset, the clamped
    SwiGLU as ``quick_geglu`` with ``glu_linear_offset`` 1, the router's softmax after its top-k, the sliding
    window, and experts not cut by tensor parallelism."""
    window = config.get("sliding_window")
    return {"add_bias_linear": True, "add_qkv_bias": True, "softmax_type": "learnable", "swiglu": False,
            "quick_geglu": True, "glu_linear_offset": 1.0, "activation_func_clamp_value": config.get("swiglu_limit"),
            "moe_router_pre_softmax": False, "expert_tensor_parallel_size": 1,
            **({"window_size": (window - 1, 0)} if isinstance(window, int) else {})}
