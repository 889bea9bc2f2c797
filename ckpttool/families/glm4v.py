"""GLM-4V and GLM-4V-MoE (transformers ``Glm4vForConditionalGeneration``, ``Glm4vMoeForConditionalGeneration``).

Both keep their in-memory names on disk (``model.language_model.*``, ``model.visual.*``, ``lm_head``): no rename.
GLM-4V-MoE's experts are stacked in memory (``mlp.experts.gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) and
written per expert, the conversion transformers gives it from Qwen2-MoE (its family is ``qwen2_moe``), so its rules
are Qwen2-MoE's; the dense model has no stacked experts and none of them applies.

Tensor parallel (``split --to dcp --tp N``): transformers' plan shards only the language model (the text config's
``base_model_tp_plan``), so the vision tower and its merger are replicated. The dense model's MLP is one fused
``mlp.gate_up_proj``, which that plan places ``colwise_gather_output``: ``Shard(0)`` of the fused rows, whose output
is gathered before it is cut in two, so the rows need no regrouping per rank; its ``down_proj`` is ``Shard(1)``.
"""

from __future__ import annotations

from ckpttool.families import qwen2_moe
from ckpttool.families.adapter import HF_TP_RULES, REPLICATE, SHARD0, FamilyAdapter, PlacementRules

NAME = "glm4v"
#: the MoE model type, which transformers' conversion mapping sends to the ``qwen2_moe`` family
MODEL_TYPES = ("glm4v_moe",)

TP_RULES: PlacementRules = (
    (r"^model\.visual\.", REPLICATE),
    (r"\.mlp\.gate_up_proj\.weight$", SHARD0),  # the dense MLP's fused rows, gathered after the matmul
    *HF_TP_RULES,
)

ADAPTER = FamilyAdapter(NAME, model_types=MODEL_TYPES, rules=qwen2_moe.RULES, tp_rules=TP_RULES)
