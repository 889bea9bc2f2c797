"""Qwen2-VL and Qwen2.5-VL: two towers under one model in memory (``model.language_model.*``, ``model.visual.*``,
``lm_head``), written by ``save_pretrained`` under their release names (``model.*`` for the language model,
``visual.*`` for the vision tower and its merger), as transformers 5's conversion mapping for these families reverts
them. The vision blocks' fused ``attn.qkv`` is the same tensor in both, so nothing is cut.

Qwen3-VL (dense and MoE) and GLM-4V keep their in-memory names on disk: they need no adapter, only the
image-text-to-text class :mod:`ckpttool.model.architecture` builds them from.
"""

from __future__ import annotations

from ckpttool.families.adapter import FamilyAdapter
from ckpttool.families.rules import Rename, Rules

NAME = "qwen2_5_vl"
#: the model types these rules serve (transformers' conversion mapping names them together)
MODEL_TYPES = ("qwen2_vl",)
RULES: Rules = (
    Rename(r"^model\.language_model\.(.*)$", r"model.\1"),
    Rename(r"^model\.visual\.(.*)$", r"visual.\1"),
)

ADAPTER = FamilyAdapter(NAME, model_types=MODEL_TYPES, rules=RULES)
