"""The DeepSpeed MoE source convention: ``deepspeed.moe.layer.MoE`` wraps the experts and the router of the MoE
block it replaces in modules of its own, so its tensors are named

- ``<moe>.deepspeed_moe.experts.deepspeed_experts.<E>.<param>`` for the expert module given to ``MoE(expert=...)``
  (the DeepSpeed reader reports the global expert id ``E``, already renumbered from each EP rank's local ids);
- ``<moe>.deepspeed_moe.gate.wg.weight`` for the router, ``TopKGate``'s ``Linear(hidden, num_experts, bias=False)``.

The declared rename drops these wrappers: ``<moe>.experts.<E>.<param>`` and ``<moe>.gate.weight``. Every other
name, and ``<moe>`` and ``<param>`` themselves, are kept as the module named them: a DeepSpeed MoE model is a
module its user built, and maps onto a HuggingFace family when it is laid out like that family's checkpoints (a
Mixtral with the MoE block at ``model.layers.N.block_sparse_moe`` and an expert with ``w1``/``w2``/``w3`` gives
Mixtral's on-disk names; a Qwen2-MoE with it at ``mlp`` and ``gate_proj``/``up_proj``/``down_proj`` gives
Qwen2-MoE's). Anything else shows up when the plan's names are checked against transformers', tensor by tensor.
"""

from __future__ import annotations

import re
from collections.abc import Collection

from ckpttool.families.adapter import Convention, CutResult, FamilyAdapter
from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import Layout
from ckpttool.plan.plan import TargetSpec
from ckpttool.families.rules import Rename, Rules, cut

NAME = "DeepSpeed MoE"
#: the layout formats written in this convention (the DeepSpeed reader's, for a checkpoint with MoE layers)
FORMATS = ("deepspeed-moe",)
RULES: Rules = (
    Rename(r"^(.+)\.deepspeed_moe\.experts\.deepspeed_experts\.(\d+)\.(.+)$", r"\1.experts.\2.\3"),
    Rename(r"^(.+)\.deepspeed_moe\.gate\.wg\.weight$", r"\1.gate.weight"),
)


class DeepSpeedMoeConvention(Convention):
    """``deepspeed.moe.layer.MoE``'s wrapper names (see the module docstring)."""

    name = NAME
    formats = FORMATS
    looks_for = "*.deepspeed_moe.experts.deepspeed_experts.*, *.deepspeed_moe.gate.wg.weight (DeepSpeed MoE)"

    def holds_names(self, names: Collection[str], info: ModelInfo | None) -> bool:
        """Some name is inside a ``deepspeed_moe`` wrapper."""
        return any(".deepspeed_moe." in name for name in names)

    def cut(self, layout: Layout, info: ModelInfo, family: FamilyAdapter) -> CutResult:
        """:func:`to_hf`: the wrappers' renames; every other name is kept for the family's check."""
        return to_hf(layout, info)


CONVENTION = DeepSpeedMoeConvention()


def to_hf(layout: Layout, info: ModelInfo) -> tuple[list[TargetSpec], list[str], list[tuple[str, str]]]:
    """DeepSpeed MoE names -> HuggingFace on-disk names (:data:`RULES`; other names kept).

    Returns:
        ``(specs, notes, problems)``; no problems here: a name the family does not know is a mismatch later.
    """
    specs = [spec for tensor in layout.tensors.values() for spec in cut(tensor, tensor.fqn, RULES)]
    renamed = sum(1 for fqn in layout.tensors if any(re.match(rule.pattern, fqn) for rule in RULES))
    note = ("DeepSpeed MoE names: '.deepspeed_moe.experts.deepspeed_experts.E.' -> '.experts.E.', "
            f"'.deepspeed_moe.gate.wg.weight' -> '.gate.weight' ({renamed} tensors)")
    return specs, [note] if renamed else [], []
