"""Qwen2-MoE and the families transformers converts the same way (Qwen3-MoE, OLMoE, DeepSeek-V2/V3 experts):
stacked in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``), per expert
on disk (``mlp.experts.E.gate_proj``, ``up_proj``, ``down_proj``). Of a Megatron-LM run, DeepSeek's training args
are checked too (multi-latent attention, sigmoid routers: :func:`ckpttool.families.deepseek.megatron_args`).

A decoder layer is MoE unless ``mlp_only_layers`` lists it or ``decoder_sparse_step`` skips it (:data:`LAYERS`)."""

from __future__ import annotations

from collections.abc import Mapping

from ckpttool.families import deepseek
from ckpttool.families.adapter import FamilyAdapter
from ckpttool.families.layers import LayerRule, layer_count
from ckpttool.families.rules import Rules, Unstack

NAME = "qwen2_moe"
RULES: Rules = (
    Unstack(
        r"^(.*)\.mlp\.experts\.gate_up_proj$",
        ("{prefix}.mlp.experts.{expert}.gate_proj.weight", "{prefix}.mlp.experts.{expert}.up_proj.weight"),
    ),
    Unstack(r"^(.*)\.mlp\.experts\.down_proj$", ("{prefix}.mlp.experts.{expert}.down_proj.weight",)),
)

ADAPTER = FamilyAdapter(NAME, rules=RULES, args_checks=(deepseek.megatron_args,))


def sparse_layers(config: Mapping[str, object]) -> list[str]:
    """Each decoder layer's kind as transformers' Qwen2-MoE, Qwen3-MoE and Qwen3-Next decoder layers choose it:
    ``moe`` unless ``mlp_only_layers`` lists the layer, the model has no experts, or ``(index + 1)`` is not a
    multiple of ``decoder_sparse_step`` (defaults as transformers': none listed, every layer, experts)."""
    listed = config.get("mlp_only_layers") or []
    step = config.get("decoder_sparse_step", 1)
    experts = config.get("num_experts", 1)
    if not isinstance(listed, list) or not isinstance(step, int) or step < 1 or not isinstance(experts, int):
        raise TypeError(f"mlp_only_layers {listed!r}, decoder_sparse_step {step!r}, num_experts {experts!r}")
    return ["moe" if i not in listed and experts > 0 and (i + 1) % step == 0 else "dense"
            for i in range(layer_count(config))]


def keep_sparse_layers(config: Mapping[str, object], layers: list[int]) -> dict[str, object]:
    """``config`` with only ``layers``: every kept layer MoE (``decoder_sparse_step`` 1) but the dense ones, listed
    in ``mlp_only_layers`` by their new index."""
    kinds = sparse_layers(config)
    dense = [j for j, i in enumerate(layers) if kinds[i] == "dense"]
    return {**config, "num_hidden_layers": len(layers), "decoder_sparse_step": 1, "mlp_only_layers": dense}


#: Qwen2-MoE's and Qwen3-MoE's layer rule
LAYERS = LayerRule(("qwen2_moe", "qwen3_moe"), kinds=sparse_layers, shrink=keep_sparse_layers)
