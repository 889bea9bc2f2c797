"""A Megatron checkpoint's training ``args`` against the HuggingFace config it is merged with.

Megatron-LM names a model's sizes its own way; :func:`check_args` compares each argument with the config field that
means the same, and refuses every contradiction at once (expected vs found), before anything is planned: a merge
under the wrong config would give tensors that fit and a model that computes something else.

Multi-latent attention (``multi_latent_attention``, DeepSeek-V2/V3) has no ``head_dim``: ``kv_channels`` is the
value head size there, while a DeepseekV3 config's ``head_dim`` is its ``qk_rope_head_dim``. Its own sizes are
compared instead (``q_lora_rank``, ``kv_lora_rank``, ``qk_head_dim`` = ``qk_nope_head_dim``, ``qk_pos_emb_head_dim`` =
``qk_rope_head_dim``, ``v_head_dim``), with the rotary layout (Megatron's MLA rotates interleaved pairs: transformers'
``rope_interleave``). So is the routing a DeepSeek-V3 model computes from its tensors, which no shape would betray:
sigmoid scores, the expert bias, group-limited choice, the scaling factor, normalised top-k weights; and the dense
first layers and MTP layers the config declares.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ckpttool.model.architecture import ModelInfo, config_value
from ckpttool.errors import ConfigError
from ckpttool.readers.megatron.common import arg

#: model types whose router scores experts with a sigmoid (transformers' ``DeepseekV3TopkRouter``) and scores a group
#: by the sum of its top 2 (a config may say so itself: DeepSeek's releases write ``scoring_func``)
_SIGMOID_ROUTERS = frozenset({"deepseek_v3"})

#: one comparison: (argument, its value, config field, the config's value); None on either side is not compared
Pair = tuple[str, Any, str, Any]


def check_args(args: Any, info: ModelInfo, where: str) -> None:
    """Compare the checkpoint's training args with the config; every disagreement, expected vs found.

    Raises:
        ConfigError: listing each argument, what the config says and what the args say.
    """
    if args is None:
        return
    config = info.config
    mla = bool(arg(args, "multi_latent_attention"))
    pairs = [*_sizes(args, config, mla), *(_mla(args, config) if mla else []), *_routing(args, info),
             *_layers(args, config)]
    found = [f"{arg_name}: config.json {config_name} = {expected!r} expected, found {got!r} in the args"
             for arg_name, got, config_name, expected in pairs
             if got is not None and expected is not None and not _same(got, expected)]
    found += _semantics(args, info, mla)
    if found:
        raise ConfigError(
            f"'{where}': the checkpoint's training args disagree with the config ({len(found)}):\n"
            + "\n".join(f"  - {f}" for f in found)
            + "\nPass the config of the model this checkpoint trained (--config)."
        )


def _sizes(args: Any, config: Mapping[str, object], mla: bool) -> list[Pair]:
    moe = bool(arg(args, "num_experts"))
    heads = config.get("num_attention_heads")
    groups = arg(args, "num_query_groups") if arg(args, "group_query_attention") else arg(args, "num_attention_heads")
    ffn = (arg(args, "moe_ffn_hidden_size") or arg(args, "ffn_hidden_size")) if moe else arg(args, "ffn_hidden_size")
    ffn_name = "moe_intermediate_size" if moe and "moe_intermediate_size" in config else "intermediate_size"
    hidden = config.get("hidden_size")
    head_dim = config.get("head_dim") or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                          and heads else None)
    experts = next((n for n in ("num_local_experts", "num_experts", "n_routed_experts") if config.get(n) is not None),
                   "num_local_experts")
    pairs: list[Pair] = [
        ("num_layers", arg(args, "num_layers"), "num_hidden_layers", config.get("num_hidden_layers")),
        ("hidden_size", arg(args, "hidden_size"), "hidden_size", hidden),
        ("num_attention_heads", arg(args, "num_attention_heads"), "num_attention_heads", heads),
        ("num_query_groups", groups, "num_key_value_heads", config_value(config, "num_key_value_heads") or heads),
        ("ffn_hidden_size", ffn, ffn_name, config.get(ffn_name)),
        ("num_experts", arg(args, "num_experts"), experts, config.get(experts)),
        ("moe_router_topk", arg(args, "moe_router_topk") if moe else None, "num_experts_per_tok",
         config.get("num_experts_per_tok")),
        ("norm_epsilon", arg(args, "norm_epsilon"), "rms_norm_eps", config.get("rms_norm_eps")),
        ("rotary_base", arg(args, "rotary_base"), "rope_theta", _rope(config).get("rope_theta")),
    ]
    if not mla:  # MLA: kv_channels is the value head size, head_dim the rope one
        pairs.append(("kv_channels", arg(args, "kv_channels"), "head_dim", head_dim))
    if moe and ffn_name == "moe_intermediate_size" and _dense_layers(args):  # the dense layers' FFN too
        pairs.append(("ffn_hidden_size", arg(args, "ffn_hidden_size"), "intermediate_size",
                      config.get("intermediate_size")))
    shared = arg(args, "moe_shared_expert_intermediate_size")
    if shared and config.get("n_shared_experts") is not None and isinstance(config.get("moe_intermediate_size"), int):
        pairs.append(("moe_shared_expert_intermediate_size", shared, "n_shared_experts x moe_intermediate_size",
                      config["n_shared_experts"] * config["moe_intermediate_size"]))  # type: ignore[operator]
    elif shared:
        pairs.append(("moe_shared_expert_intermediate_size", shared, "shared_expert_intermediate_size",
                      config.get("shared_expert_intermediate_size")))
    untie = arg(args, "untie_embeddings_and_output_weights")
    if untie is not None and config.get("tie_word_embeddings") is not None:
        pairs.append(("not untie_embeddings_and_output_weights", not untie, "tie_word_embeddings",
                      bool(config["tie_word_embeddings"])))
    return pairs


def _mla(args: Any, config: Mapping[str, object]) -> list[Pair]:
    """The MLA sizes (``q_lora_rank``, which may be None on both sides, is :func:`_semantics`')."""
    pairs: list[Pair] = [
        ("kv_lora_rank", arg(args, "kv_lora_rank"), "kv_lora_rank", config.get("kv_lora_rank")),
        ("qk_head_dim", arg(args, "qk_head_dim"), "qk_nope_head_dim", config.get("qk_nope_head_dim")),
        ("qk_pos_emb_head_dim", arg(args, "qk_pos_emb_head_dim"), "qk_rope_head_dim", config.get("qk_rope_head_dim")),
        ("v_head_dim", arg(args, "v_head_dim"), "v_head_dim", config.get("v_head_dim")),
    ]
    rope, rope_type = _rope(config), arg(args, "rope_type")
    if rope_type is not None:  # "rope" is transformers' "default"
        pairs.append(("rope_type", rope_type, "rope_parameters.rope_type",
                      {"default": "rope"}.get(str(rope.get("rope_type") or "default"), rope.get("rope_type"))))
    if rope_type == "yarn":
        pairs += [("rotary_scaling_factor", arg(args, "rotary_scaling_factor"), "rope_parameters.factor",
                   rope.get("factor")),
                  ("mscale", arg(args, "mscale"), "rope_parameters.mscale", rope.get("mscale")),
                  ("mscale_all_dim", arg(args, "mscale_all_dim"), "rope_parameters.mscale_all_dim",
                   rope.get("mscale_all_dim"))]
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


def _layers(args: Any, config: Mapping[str, object]) -> list[Pair]:
    """How many MTP layers there are (a config declaring MTP layers the source lacks is a warning of the merge)."""
    mtp = arg(args, "mtp_num_layers")
    return [("mtp_num_layers", mtp, "num_nextn_predict_layers",
             config_value(config, "num_nextn_predict_layers", "num_mtp_layers") or 0)] if mtp else []


def _semantics(args: Any, info: ModelInfo, mla: bool) -> list[str]:
    """Contradictions that are no pair of values: what transformers' model cannot compute as Megatron did."""
    found = []
    config = info.config
    q_lora = arg(args, "q_lora_rank")
    named = mla and "q_lora_rank" in config and _has(args, "q_lora_rank")
    if named and (q_lora or None) != (config["q_lora_rank"] or None):
        found.append(f"q_lora_rank: config.json q_lora_rank = {config['q_lora_rank']!r} expected, found {q_lora!r} in "
                     "the args (None: the query is not compressed)")
    if mla and arg(args, "rotary_interleaved"):
        found.append("rotary_interleaved: Megatron's MLA then rotates interleaved pairs within de-interleaved halves, "
                     "which transformers' DeepseekV3 has no setting for")
    if mla and info.model_type in _SIGMOID_ROUTERS and config.get("rope_interleave", True) is not True:
        found.append(f"multi_latent_attention: Megatron's MLA rotates the rope dims as interleaved pairs, what "
                     f"transformers does with rope_interleave true; config.json says {config.get('rope_interleave')!r}")
    pattern, layers, first = _moe_pattern(args), config.get("num_hidden_layers"), config.get("first_k_dense_replace")
    if pattern is not None and isinstance(layers, int) and isinstance(first, int):
        dense_first = [0] * first + [1] * (layers - first)
        if pattern != dense_first:
            found.append(f"moe_layer_freq: {pattern} in the args (0: a dense layer, 1: MoE), but config.json "
                         f"first_k_dense_replace = {first} gives {dense_first}")
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
    return info.model_type in _SIGMOID_ROUTERS or info.config.get("scoring_func") == "sigmoid"


def _limits(groups: Any, chosen: Any) -> bool:
    """Whether group-limited routing limits anything (more than one group, not every group chosen)."""
    return isinstance(groups, int) and isinstance(chosen, int) and groups > 1 and 0 < chosen < groups


def _group_limit(groups: Any, chosen: Any) -> str:
    return f"{chosen} of {groups} groups" if _limits(groups, chosen) else "no group limit"


def _moe_pattern(args: Any) -> list[int] | None:
    """``moe_layer_freq`` as Megatron-Core reads it: a list of 0 (dense) / 1 (MoE) per layer, or every N-th layer."""
    freq, layers = arg(args, "moe_layer_freq"), arg(args, "num_layers")
    if not arg(args, "num_experts") or not isinstance(layers, int):
        return None
    if isinstance(freq, list) and all(isinstance(f, int) for f in freq):
        return list(freq)
    if isinstance(freq, int) and not isinstance(freq, bool) and freq > 0:
        return [1 if i % freq == 0 else 0 for i in range(layers)]
    return None


def _dense_layers(args: Any) -> bool:
    pattern = _moe_pattern(args)
    return pattern is not None and 0 in pattern


def _has(args: Any, name: str) -> bool:
    missing = object()
    return arg(args, name, missing) is not missing


def _rope(config: Mapping[str, object]) -> Mapping[str, Any]:
    """The rope parameters: transformers 5's ``rope_parameters``, else the older ``rope_theta``/``rope_scaling``."""
    rope = config.get("rope_parameters")
    if isinstance(rope, Mapping):
        return rope
    scaling = config.get("rope_scaling")
    old = dict(scaling) if isinstance(scaling, Mapping) else {}
    if "type" in old and "rope_type" not in old:
        old["rope_type"] = old["type"]
    return {**old, "rope_theta": config.get("rope_theta")}


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return bool(a) == bool(b)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        try:
            return math.isclose(a, b, rel_tol=1e-9)
        except OverflowError:  # an integer beyond any float
            return a == b
    return a == b
