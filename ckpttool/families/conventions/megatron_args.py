"""The Megatron-Core convention's checks of a Megatron checkpoint's training ``args`` against the HuggingFace config
it is merged with: what every Megatron-Core GPT model's args say, whatever its family.

Megatron-LM names a model's sizes its own way; :func:`problems` compares each argument with the config field that
means the same (layers, hidden size, heads and query groups, FFN and expert sizes, top-k, norm epsilon, rope base,
tied embeddings, MTP layers, which layers are dense), expected vs found: a merge under the wrong config would give
tensors that fit and a model that computes something else. What only one family's args say is that family
adapter's :attr:`~ckpttool.families.adapter.FamilyAdapter.args_checks` (DeepSeek's MLA and sigmoid router:
:mod:`ckpttool.families.deepseek`; gpt-oss's sinks and clamped SwiGLU: :mod:`ckpttool.families.gpt_oss`);
:class:`~.megatron_tp.MegatronTP` runs both and raises :func:`refusal`, before the reader checks vocab padding.

The helpers here (:func:`arg`, :func:`disagreements`, :func:`rope`) are what a family's checks use too.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from ckpttool.errors import ConfigError
from ckpttool.model.description import ModelInfo
from ckpttool.model.architecture import config_value

#: one comparison: (argument, its value, config field, the config's value); None on either side is not compared
Pair = tuple[str, Any, str, Any]


def problems(args: Any, info: ModelInfo) -> list[str]:
    """Every disagreement of the training ``args`` with ``info``'s config that any Megatron-Core model would show,
    one line each (expected vs found); an argument the args do not record is not compared."""
    if args is None:
        return []
    config = info.config
    mla = bool(arg(args, "multi_latent_attention"))
    found = disagreements([*_sizes(args, config, mla), *_layers(args, config)])
    pattern, layers, first = moe_pattern(args), config.get("num_hidden_layers"), config.get("first_k_dense_replace")
    if pattern is not None and isinstance(layers, int) and isinstance(first, int):
        dense_first = [0] * first + [1] * (layers - first)
        if pattern != dense_first:
            found.append(f"moe_layer_freq: {pattern} in the args (0: a dense layer, 1: MoE), but config.json "
                         f"first_k_dense_replace = {first} gives {dense_first}")
    return found


def refusal(found: list[str], where: str) -> ConfigError:
    """The error for ``found`` disagreements of the args in ``where`` (a file of the checkpoint) with the config."""
    return ConfigError(
        f"'{where}': the checkpoint's training args disagree with the config ({len(found)}):\n"
        + "\n".join(f"  - {f}" for f in found)
        + "\nPass the config of the model this checkpoint trained (--config)."
    )


def disagreements(pairs: list[Pair]) -> list[str]:
    """A line for every pair whose two sides are both known and differ."""
    return [f"{arg_name}: config.json {config_name} = {expected!r} expected, found {got!r} in the args"
            for arg_name, got, config_name, expected in pairs
            if got is not None and expected is not None and not _same(got, expected)]


def arg(args: Any, name: str, default: Any = None) -> Any:
    """One training argument: ``args`` is a mapping (what the Megatron readers give, enum values already their
    values), or an ``argparse.Namespace``-like object (a scanned pickle's record, a test's Namespace)."""
    if args is None:
        return default
    if isinstance(args, Mapping) or callable(getattr(type(args), "get", None)):
        return args.get(name, default)
    return getattr(args, name, default)


def has(args: Any, name: str) -> bool:
    """Whether the args record ``name`` at all (None counts: it says "not set")."""
    missing = object()
    return arg(args, name, missing) is not missing


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
        ("rotary_base", arg(args, "rotary_base"), "rope_theta", rope(config).get("rope_theta")),
    ]
    if not mla:  # MLA: kv_channels is the value head size, head_dim the rope one
        pairs.append(("kv_channels", arg(args, "kv_channels"), "head_dim", head_dim))
    if moe and ffn_name == "moe_intermediate_size" and _dense_layers(args):  # the dense layers' FFN too
        pairs.append(("ffn_hidden_size", arg(args, "ffn_hidden_size"), "intermediate_size",
                      config.get("intermediate_size")))
    shared = arg(args, "moe_shared_expert_intermediate_size")
    if shared and isinstance(config.get("moe_shared_expert_intermediate_size"), int):  # Nemotron-H names it as Megatron
        pairs.append(("moe_shared_expert_intermediate_size", shared, "moe_shared_expert_intermediate_size",
                      config["moe_shared_expert_intermediate_size"]))
    elif shared and config.get("n_shared_experts") is not None and isinstance(config.get("moe_intermediate_size"), int):
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


def _layers(args: Any, config: Mapping[str, object]) -> list[Pair]:
    """How many MTP layers there are (a config declaring MTP layers the source lacks is a warning of the merge)."""
    mtp = arg(args, "mtp_num_layers")
    return [("mtp_num_layers", mtp, "num_nextn_predict_layers",
             config_value(config, "num_nextn_predict_layers", "num_mtp_layers") or 0)] if mtp else []


def moe_pattern(args: Any) -> list[int] | None:
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
    pattern = moe_pattern(args)
    return pattern is not None and 0 in pattern


def rope(config: Mapping[str, object]) -> Mapping[str, Any]:
    """The rope parameters: transformers 5's ``rope_parameters``, else the older ``rope_theta``/``rope_scaling``."""
    parameters = config.get("rope_parameters")
    if isinstance(parameters, Mapping):
        return parameters
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
