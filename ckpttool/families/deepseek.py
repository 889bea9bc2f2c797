"""DeepSeek-V2/V3 (multi-latent attention, sigmoid routers): what a Megatron-LM run's training args must say for
its checkpoint to compute the model transformers builds from the config, which no tensor shape betrays.

transformers converts their experts as it does Qwen2-MoE's, so the ``qwen2_moe`` adapter
(:mod:`ckpttool.families.qwen2_moe`) serves them and declares :func:`megatron_args` among its ``args_checks``; the
Megatron-Core convention runs it after its own checks (:mod:`.conventions.megatron_args`).

Multi-latent attention (``multi_latent_attention``) has no ``head_dim``: ``kv_channels`` is the value head size
there (the convention then leaves it out), while a DeepseekV3 config's ``head_dim`` is its ``qk_rope_head_dim``.
MLA's own sizes are compared instead (``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim`` = ``qk_nope_head_dim``,
``qk_pos_emb_head_dim`` = ``qk_rope_head_dim``, ``v_head_dim``), with the rotary layout (Megatron's MLA rotates
interleaved pairs: transformers' ``rope_interleave``). So is the routing a DeepSeek-V3 model computes from its
tensors: sigmoid scores, the expert bias, group-limited choice, the scaling factor, normalised top-k weights.

Its decoder layers are dense below ``first_k_dense_replace`` and MoE from there on (transformers reads no
``moe_layer_freq``); the MTP layer is built apart. :data:`LAYERS` says so (:mod:`ckpttool.families.layers`).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckpttool.families.conventions.megatron_args import Pair, arg, disagreements, has, rope
from ckpttool.families.layers import LayerRule, layer_count
from ckpttool.model.description import ModelInfo

#: model types whose router scores experts with a sigmoid (transformers' ``DeepseekV3TopkRouter``) and scores a group
#: by the sum of its top 2 (a config may say so itself: DeepSeek's releases write ``scoring_func``)
SIGMOID_ROUTERS = frozenset({"deepseek_v3"})


def _dense_then_moe(config: Mapping[str, object]) -> list[str]:
    """Each decoder layer's kind: ``dense`` below ``first_k_dense_replace`` (which the config must set: the default
    differs between model types), ``moe`` from there on."""
    dense = config["first_k_dense_replace"]
    if not isinstance(dense, int):
        raise TypeError(f"first_k_dense_replace is {dense!r}")
    return ["dense" if i < dense else "moe" for i in range(layer_count(config))]


def _keep_dense_then_moe(config: Mapping[str, object], layers: list[int]) -> dict[str, object]:
    dense = config["first_k_dense_replace"]
    return {**config, "num_hidden_layers": len(layers), "first_k_dense_replace": sum(i < dense for i in layers)}


#: DeepSeek-V2/V3's layer rule: dense layers first, then MoE (GLM-4-MoE reads the same key)
LAYERS = LayerRule(("deepseek_v2", "deepseek_v3", "glm4_moe"), kinds=_dense_then_moe, shrink=_keep_dense_then_moe)


def megatron_args(args: Any, info: ModelInfo) -> list[str]:
    """Every disagreement of the args' MLA sizes and routing with the config, one line each (expected vs found);
    none for a run without MLA and a model without a sigmoid router."""
    if args is None:
        return []
    mla = bool(arg(args, "multi_latent_attention"))
    found = disagreements([*(_mla(args, info.config) if mla else []), *_routing(args, info)])
    return found + _semantics(args, info, mla)


def _mla(args: Any, config: Mapping[str, object]) -> list[Pair]:
    """The MLA sizes (``q_lora_rank``, which may be None on both sides, is :func:`_semantics`')."""
    pairs: list[Pair] = [
        ("kv_lora_rank", arg(args, "kv_lora_rank"), "kv_lora_rank", config.get("kv_lora_rank")),
        ("qk_head_dim", arg(args, "qk_head_dim"), "qk_nope_head_dim", config.get("qk_nope_head_dim")),
        ("qk_pos_emb_head_dim", arg(args, "qk_pos_emb_head_dim"), "qk_rope_head_dim", config.get("qk_rope_head_dim")),
        ("v_head_dim", arg(args, "v_head_dim"), "v_head_dim", config.get("v_head_dim")),
    ]
    parameters, rope_type = rope(config), arg(args, "rope_type")
    if rope_type is not None:  # "rope" is transformers' "default"
        pairs.append(("rope_type", rope_type, "rope_parameters.rope_type",
                      {"default": "rope"}.get(str(parameters.get("rope_type") or "default"), parameters.get("rope_type"))))
    if rope_type == "yarn":
        pairs += [("rotary_scaling_factor", arg(args, "rotary_scaling_factor"), "rope_parameters.factor",
                   parameters.get("factor")),
                  ("mscale", arg(args, "mscale"), "rope_parameters.mscale", parameters.get("mscale")),
                  ("mscale_all_dim", arg(args, "mscale_all_dim"), "rope_parameters.mscale_all_dim",
                   parameters.get("mscale_all_dim"))]
    return pairs


def _routing(args: Any, info: ModelInfo) -> list[Pair]:
    """How a DeepSeek-V3 router turns scores into weights, where the config says it (sigmoid routers only)."""
    config = info.config
    if not arg(args, "num_experts") or not _sigmoid_router(info):
        return []
    scale = arg(args, "moe_router_topk_scaling_factor")
    return [
        ("moe_router_score_function", arg(args, "moe_router_score_function") or "softmax", "scoring_func",
         config.get("scoring_func") or "sigmoid"),
        ("moe_router_topk_scaling_factor", 1.0 if scale is None else scale, "routed_scaling_factor",
         config.get("routed_scaling_factor")),
        ("moe_router_num_groups/moe_router_group_topk",
         _group_limit(arg(args, "moe_router_num_groups"), arg(args, "moe_router_group_topk")),
         "n_group/topk_group", _group_limit(config.get("n_group"), config.get("topk_group"))),
    ]


def _semantics(args: Any, info: ModelInfo, mla: bool) -> list[str]:
    """Contradictions that are no pair of values: what transformers' model cannot compute as Megatron did."""
    found = []
    config = info.config
    q_lora = arg(args, "q_lora_rank")
    named = mla and "q_lora_rank" in config and has(args, "q_lora_rank")
    if named and (q_lora or None) != (config["q_lora_rank"] or None):
        found.append(f"q_lora_rank: config.json q_lora_rank = {config['q_lora_rank']!r} expected, found {q_lora!r} in "
                     "the args (None: the query is not compressed)")
    if mla and arg(args, "rotary_interleaved"):
        found.append("rotary_interleaved: Megatron's MLA then rotates interleaved pairs within de-interleaved halves, "
                     "which transformers' DeepseekV3 has no setting for")
    if mla and info.model_type in SIGMOID_ROUTERS and config.get("rope_interleave", True) is not True:
        found.append(f"multi_latent_attention: Megatron's MLA rotates the rope dims as interleaved pairs, what "
                     f"transformers does with rope_interleave true; config.json says {config.get('rope_interleave')!r}")
    if not arg(args, "num_experts") or not _sigmoid_router(info):
        return found
    bias = any(name.endswith("e_score_correction_bias") for name in info.disk_shapes)
    if bool(arg(args, "moe_router_enable_expert_bias")) != bias:
        found.append(f"moe_router_enable_expert_bias: {bool(arg(args, 'moe_router_enable_expert_bias'))} in the args, "
                     f"but a {info.model_type} model {'adds' if bias else 'has no'} a router bias "
                     "(mlp.gate.e_score_correction_bias)")
    groups, chosen, topk = (arg(args, n) for n in ("moe_router_num_groups", "moe_router_group_topk", "moe_router_topk"))
    if _limits(groups, chosen) and isinstance(topk, int) and topk // chosen != 2:
        found.append(f"moe_router_group_topk: Megatron scores a group by its top moe_router_topk // "
                     f"moe_router_group_topk = {topk // chosen} experts, transformers' {info.model_type} by its top 2")
    if (arg(args, "moe_router_score_function") == "sigmoid" and isinstance(topk, int) and topk > 1
            and config.get("norm_topk_prob") is False):
        found.append("norm_topk_prob: Megatron normalises the sigmoid weights of its top moe_router_topk experts; "
                     "config.json says false")
    return found


def _sigmoid_router(info: ModelInfo) -> bool:
    return info.model_type in SIGMOID_ROUTERS or info.config.get("scoring_func") == "sigmoid"


def _limits(groups: Any, chosen: Any) -> bool:
    """Whether group-limited routing limits anything (more than one group, not every group chosen)."""
    return isinstance(groups, int) and isinstance(chosen, int) and groups > 1 and 0 < chosen < groups


def _group_limit(groups: Any, chosen: Any) -> str:
    return f"{chosen} of {groups} groups" if _limits(groups, chosen) else "no group limit"
