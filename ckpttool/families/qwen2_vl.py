"""Qwen2-VL and Qwen2.5-VL: two towers under one model in memory (``model.language_model.*``, ``model.visual.*``,
``lm_head``), written by ``save_pretrained`` under their release names (``model.*`` for the language model,
``visual.*`` for the vision tower and its merger), as transformers 5's conversion mapping for these families reverts
them. The vision blocks' fused ``attn.qkv`` is the same tensor in both, so nothing is cut.

Tensor parallel (``split --to dcp --tp N``): transformers' plan for these models shards only the language model (its
``base_model_tp_plan`` is the text config's); the vision tower and merger stay whole on every rank, so they are
replicated here, and the language model follows the Llama plan (:data:`~.adapter.HF_TP_RULES`).

Qwen3-VL (dense and MoE) keeps its in-memory names on disk: it needs no adapter, only the image-text-to-text class
:mod:`ckpttool.model.architecture` builds it from. GLM-4V keeps them too; its adapter (:mod:`.glm4v`) places its
tensors for ``--tp``.
"""

from __future__ import annotations

from ckpttool.families.adapter import HF_TP_RULES, REPLICATE, FamilyAdapter, PlacementRules
from ckpttool.families.rules import Rename, Rules

NAME = "qwen2_5_vl"
#: the model types these rules serve (transformers' conversion mapping names them together)
MODEL_TYPES = ("qwen2_vl",)
RULES: Rules = (
    Rename(r"^model\.language_model\.(.*)$", r"model.\1"),
    Rename(r"^model\.visual\.(.*)$", r"visual.\1"),
)

#: the vision side replicated (transformers' plan leaves it out), the language model as a Llama's
TP_RULES: PlacementRules = ((r"^model\.visual\.", REPLICATE), *HF_TP_RULES)

ADAPTER = FamilyAdapter(NAME, model_types=MODEL_TYPES, rules=RULES, tp_rules=TP_RULES)
