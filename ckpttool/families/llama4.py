"""Llama 4 with vision (transformers ``Llama4ForConditionalGeneration``).

transformers 5 keeps Llama 4's tensors in memory under the names and shapes ``save_pretrained`` writes
(``language_model.model.*``, ``language_model.lm_head``, ``vision_model.*``, ``multi_modal_projector.*``: the text
model is a whole ``Llama4ForCausalLM`` inside, not a bare decoder as in most VLMs; routed experts
stacked as ``feed_forward.experts.gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]``, beside a shared expert and
a router): a DCP or transformers-distributed source needs no rule.

Tensor parallel (``split --to dcp --tp N``): the language model as Llama's plan places it (attention, the dense and
shared-expert MLPs); the router replicated, the stacked experts cut as transformers' plan cuts them
(:mod:`ckpttool.families.expert_tp`: ``gate_up_proj`` ``Shard(2)``, ``down_proj`` ``Shard(1)``; ``ep`` shards them
instead); the vision model and the
projector whole on every rank (transformers' plan cuts some of them, but a whole tensor is what any cut gathers to).
"""

from __future__ import annotations

from ckpttool.families.adapter import HF_TP_RULES, REPLICATE, FamilyAdapter, PlacementRules

NAME = "llama4"

TP_RULES: PlacementRules = (
    (r"^(vision_model|multi_modal_projector)\.", REPLICATE),
    (r"\.feed_forward\.router\.weight$", REPLICATE),
    (r"\.feed_forward\.experts\.", REPLICATE),
    *HF_TP_RULES,
)

ADAPTER = FamilyAdapter(NAME, tp_rules=TP_RULES)
