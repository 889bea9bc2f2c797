"""Qwen2-MoE and the families transformers converts the same way (Qwen3-MoE, OLMoE, DeepSeek-V2/V3 experts):
stacked in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``), per expert
on disk (``mlp.experts.E.gate_proj``, ``up_proj``, ``down_proj``). Of a Megatron-LM run, DeepSeek's training args
are checked too (multi-latent attention, sigmoid routers: :func:`ckpttool.families.deepseek.megatron_args`)."""

from __future__ import annotations

from ckpttool.families import deepseek
from ckpttool.families.adapter import FamilyAdapter
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
