"""The LLaVA family as transformers 5 groups it: LLaVA, PaliGemma, Gemma 3 with vision, Mistral 3, Aya Vision, ...
(its conversion mapping aliases their model types to ``llava``, so :attr:`ModelInfo.family` is ``"llava"``).

In memory every one of them holds ``model.language_model.*`` (the text model without its head),
``model.vision_tower.*``, ``model.multi_modal_projector.*`` and ``lm_head.*``; ``save_pretrained`` reverts the
conversion and writes the layout of their releases: ``language_model.model.*``, ``vision_tower.*``,
``multi_modal_projector.*`` and ``language_model.lm_head.*`` (never written when the head is tied to the embedding,
as Gemma 3's and PaliGemma's are: a tied head is dropped before these renames apply). The four renames are the
mapping transformers shares across the family, which is why one adapter serves them all; the tests check them
against transformers' own reverted names for LLaVA, PaliGemma, Mistral 3 and Gemma 3.

LLaVA-Next (its own family in transformers' mapping, whose model class is mapped to LLaVA's) takes the same four
renames and a fifth: the row separator of its tiled images, ``model.image_newline``, is written ``image_newline``.

Tensor parallel (``split --to dcp --tp N``): as for Qwen2.5-VL, transformers' plans shard only the language model;
the vision tower and projector stay whole on every rank.
"""

from __future__ import annotations

from ckpttool.families.adapter import HF_TP_RULES, REPLICATE, FamilyAdapter, PlacementRules
from ckpttool.families.rules import Rename, Rules

NAME = "llava"
#: model types whose family is not ``llava`` but whose names are cut as LLaVA's (one more rename)
MODEL_TYPES = ("llava_next",)
RULES: Rules = (
    Rename(r"^model\.image_newline$", "image_newline"),
    Rename(r"^model\.language_model\.(.*)$", r"language_model.model.\1"),
    Rename(r"^model\.vision_tower\.(.*)$", r"vision_tower.\1"),
    Rename(r"^model\.multi_modal_projector\.(.*)$", r"multi_modal_projector.\1"),
    Rename(r"^lm_head\.(.*)$", r"language_model.lm_head.\1"),
)

#: the vision side replicated (transformers' plans leave it out), the language model as a Llama's
TP_RULES: PlacementRules = ((r"^model\.(vision_tower|multi_modal_projector|image_newline)", REPLICATE),
                            *HF_TP_RULES)

ADAPTER = FamilyAdapter(NAME, model_types=MODEL_TYPES, rules=RULES, tp_rules=TP_RULES)
