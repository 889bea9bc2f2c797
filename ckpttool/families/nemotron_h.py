"""Nemotron-H (transformers ``NemotronHForCausalLM``): Mamba-2 mixers beside attention, MLP and MoE layers, one kind a
layer as the config's ``layers_block_type`` (or a release's ``hybrid_override_pattern``) says.

Names: transformers 5 keeps the model under ``model.*`` in memory and ``save_pretrained`` writes ``backbone.*`` (its
conversion mapping renames ``backbone.`` to ``model.`` on load); ``lm_head`` keeps its name. Every layer's mixer is
``mixer``: a Mamba-2 layer holds ``mixer.in_proj [2*I + 2*G*N + Nh, H]``, ``conv1d.{weight,bias}``, ``A_log``, ``D``,
``dt_bias``, ``norm.weight`` and ``out_proj``; an attention layer ``mixer.{q,k,v,o}_proj``; an MLP layer
``mixer.{up,down}_proj``. A MoE layer's routed experts are stacked in memory (``mixer.experts.up_proj [E, I, H]``,
``down_proj [E, H, I]``) and saved per expert (``mixer.experts.E.up_proj.weight``), as transformers' conversion
merges them.

Tensor parallel (``split --to dcp --tp N``), as transformers' plan for Nemotron-H cuts it
(``NemotronHConfig.base_model_tp_plan``): only the embeddings (``embedding_rowwise``: vocab rows) and the MoE experts
are sharded; the mixers (Mamba-2, attention, MLP) and ``lm_head`` are whole on every rank. Experts stay replicated
here (``ep`` shards them), as for every MoE family.
"""

from __future__ import annotations

from ckpttool.families.adapter import REPLICATE, SHARD0, FamilyAdapter, PlacementRules
from ckpttool.families.rules import Rename, Rules, Unstack

NAME = "nemotron_h"
RULES: Rules = (
    Unstack(r"^model\.(.*)\.mixer\.experts\.up_proj$", ("backbone.{prefix}.mixer.experts.{expert}.up_proj.weight",)),
    Unstack(r"^model\.(.*)\.mixer\.experts\.down_proj$",
            ("backbone.{prefix}.mixer.experts.{expert}.down_proj.weight",)),
    Rename(r"^model\.(.*)$", r"backbone.\1"),
)
#: transformers' plan: the vocab rows of the embeddings, nothing else of the dense model
TP_RULES: PlacementRules = (
    (r"(^|\.)embeddings\.weight$", SHARD0),
    (r".", REPLICATE),
)

ADAPTER = FamilyAdapter(NAME, rules=RULES, tp_rules=TP_RULES)
