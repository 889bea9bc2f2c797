"""Mixtral: transformers 5 keeps experts stacked in memory (``mlp.experts.gate_up_proj [E, 2I, H]``,
``mlp.experts.down_proj [E, H, I]``, router ``mlp.gate``); ``save_pretrained`` writes them per expert under
``block_sparse_moe`` (``experts.E.w1`` gate, ``w3`` up, ``w2`` down, and ``block_sparse_moe.gate``)."""

from __future__ import annotations

from ckpttool.families.adapter import FamilyAdapter
from ckpttool.families.layers import alike
from ckpttool.families.rules import Rename, Rules, Unstack

NAME = "mixtral"
RULES: Rules = (
    Rename(r"^(.*)\.mlp\.gate\.weight$", r"\1.block_sparse_moe.gate.weight"),
    Unstack(
        r"^(.*)\.mlp\.experts\.gate_up_proj$",
        ("{prefix}.block_sparse_moe.experts.{expert}.w1.weight", "{prefix}.block_sparse_moe.experts.{expert}.w3.weight"),
    ),
    Unstack(r"^(.*)\.mlp\.experts\.down_proj$", ("{prefix}.block_sparse_moe.experts.{expert}.w2.weight",)),
)

ADAPTER = FamilyAdapter(NAME, rules=RULES)

#: every decoder layer is MoE
LAYERS = alike(NAME)
