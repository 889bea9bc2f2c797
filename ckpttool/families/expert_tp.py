"""Tensor parallel of stacked experts as transformers' own plans cut them, for every family in one place.

transformers 5's fused MoE experts (``experts.gate_up_proj`` ``[E, 2I, H]``, ``experts.down_proj`` ``[E, H, I]``;
Llama 4's transposed, ``[E, H, 2I]`` and ``[E, I, H]``) are cut by a model's ``base_model_tp_plan`` when it is loaded
with ``DistributedConfig(tp_size=N)``: ``packed_colwise`` on ``gate_up_proj`` (each rank its rows of gate and of up,
a ``_StridedShard`` in memory), ``rowwise`` on ``down_proj`` (Llama 4: ``packed_rowwise`` and ``colwise``, the same
cuts of its transposed tensors). Its ``save_pretrained(distributed_checkpoint=True)`` redistributes a
``_StridedShard`` to the ``Shard`` of the same dim before DCP writes it (``transformers.distributed.checkpoint.
_redistribute_state_dict``: DCP records one rectangle per rank), and its load does the same the other way. So the
chunks on disk are plain ``Shard(d)``: a colwise style cuts dim ``-2`` of the tensor, a rowwise style dim ``-1``
(:func:`placement_of_style`), which is what ``split --to dcp --tp N`` writes for them (:func:`with_plan_experts`).

:data:`PLANS` is the experts' part of each model type's plan in transformers 5.23, every model type whose plan cuts
them (``tests/test_expert_layouts.py`` compares it with the installed transformers, both ways): a model type not
listed (gpt-oss and DBRX, whose plans leave their experts out; :data:`NOT_LOADED`) keeps the family's placement,
its experts whole on every TP rank. ``ep`` is not this module's: with ``ep`` above 1 the experts are
placed over expert-parallel ranks whatever the plan (:func:`ckpttool.commands.meshes.shard_tensors`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

from ckpttool.layout.placements import Placement


def _plan(prefix: str, gate_up: str = "packed_colwise", down: str = "rowwise", up: str = "gate_up_proj") -> dict[str, str]:
    """A plan's two entries for the stacked experts under ``prefix`` (``layers.*.mlp``)."""
    return {f"{prefix}.experts.{up}": gate_up, f"{prefix}.experts.down_proj": down}


#: (the stacked experts' entries of a ``base_model_tp_plan``, the model types whose plan (or whose text config's)
#: holds exactly those), from transformers 5.23; the first group is the usual one (Mixtral, Qwen2/3-MoE,
#: DeepSeek-V2/V3, GLM-4(V)-MoE, OLMoE, ...)
GROUPS: tuple[tuple[dict[str, str], tuple[str, ...]], ...] = (
    (_plan("layers.*.mlp"), (
        "afmoe", "axk1", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_ocr2", "deepseek_ocr2_text",
        "deepseek_v2", "deepseek_v3", "deepseek_v32", "deepseek_v4", "dots1", "dots3_note_text", "ernie4_5_moe",
        "exaone_moe", "flex_olmo", "flint", "glm4_moe", "glm4_moe_lite", "glm4v_moe", "glm4v_moe_text", "glm5_next",
        "glm5_next_text", "glm_moe_dsa", "hunyuan_v1_moe", "hy_v3", "hy_v4", "kimi_linear", "kolibri1", "laguna",
        "longcat_flash", "mellum", "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl", "minimax_m3_vl_text",
        "mistral4", "mistral_large4", "mistral_large4_text", "mixtral", "olmoe", "phimoe", "qwen2_moe", "qwen3_5_moe",
        "qwen3_5_moe_text", "qwen3_moe", "qwen3_next", "qwen3_omni_moe_talker_text", "qwen3_omni_moe_text",
        "qwen3_omni_moe_thinker", "qwen4_exp", "qwen4_exp_text", "solar_open", "step3p5", "step3p7", "unlimited_ocr",
        "unlimited_ocr_text")),
    (_plan("layers.*.mlp", "packed_rowwise", "colwise"), ("aria", "aria_text")),  # transposed [E, H, 2I]
    (_plan("layers.*.feed_forward", "packed_rowwise", "colwise"), ("llama4", "llama4_text")),  # the same
    (_plan("layers.*"), ("diffusion_gemma", "diffusion_gemma_text", "gemma4", "gemma4_text")),
    ({**_plan("blocks.*.mlp"), **_plan("layers.*.mlp")}, ("dots3_note",)),
    (_plan("blocks.*.mlp"), ("dots3_note_vision_encoder",)),
    ({**_plan("layers.*.mlp.text_moe"), **_plan("layers.*.mlp.vision_moe")}, ("ernie4_5_vl_moe", "ernie4_5_vl_moe_text")),
    (_plan("layers.*.block_sparse_moe"), ("granitemoe", "granitemoe_swa", "granitemoehybrid", "granitemoeshared")),
    (_plan("layers.*.mlp", "colwise"), ("inkling2", "inkling2_text", "inkling_mm_model", "inkling_text")),
    (_plan("layers.*.feed_forward"), ("jamba", "lfm2_moe")),
    (_plan("layers.*.mixer", "colwise", up="up_proj"), ("nemotron_h",)),  # not gated: up_proj alone
)
#: model type -> the stacked experts' entries of its plan
PLANS: Mapping[str, Mapping[str, str]] = {t: plan for plan, types in GROUPS for t in types}
#: model types whose plan cuts experts but whose experts a split keeps whole: transformers 5.23 cannot load
#: Qwen3-VL-MoE with a ``DistributedConfig`` (it cuts the on-disk ``[E, H, 2I]`` before transposing), so there is
#: no save of its to match
NOT_LOADED = ("qwen3_vl_moe", "qwen3_vl_moe_text")
#: the styles a plan gives stacked experts -> which end dim they cut (colwise: the output rows, rowwise: the input)
_FROM_END = {"colwise": 2, "packed_colwise": 2, "rowwise": 1, "packed_rowwise": 1}
#: the rank of transformers' stacked experts ``[E, rows, columns]``
_STACKED_DIMS = 3


def placement_of_style(style: str, dims: int = _STACKED_DIMS) -> Placement:
    """The ``Shard`` that transformers' distributed save writes for a tensor of ``dims`` dims that plan ``style``
    cuts: dim ``-2`` for ``colwise`` / ``packed_colwise``, dim ``-1`` for ``rowwise`` / ``packed_rowwise``.

    Raises:
        KeyError: a style that does not cut a weight so (``moe_tp_experts``, ``embedding_rowwise``, ...).

    Example:
        >>> str(placement_of_style("packed_colwise"))
        'Shard(1)'
    """
    return Placement("shard", dims - _FROM_END[style])


def plan_experts(model_type: str) -> tuple[tuple[re.Pattern[str], Placement], ...]:
    """The stacked experts' placements of ``model_type``'s plan, as patterns searched in in-memory names (a plan's
    ``*`` is a layer number; its keys are relative to the text model, so any prefix may stand before)."""
    return tuple((re.compile(r"(^|\.)" + re.escape(key).replace(r"\*", r"\d+") + "$"), placement_of_style(style))
                 for key, style in PLANS.get(model_type, {}).items())


def with_plan_experts(placement: Callable[[str], Placement | None],
                      model_type: str) -> Callable[[str], Placement | None]:
    """``placement`` (a family adapter's tensor-parallel placement by in-memory name) with the stacked experts
    placed as ``model_type``'s transformers plan cuts them; ``placement`` itself when the plan cuts none."""
    rules = plan_experts(model_type)
    if not rules:
        return placement

    def placed(name: str) -> Placement | None:
        return next((p for pattern, p in rules if pattern.search(name)), None) or placement(name)
    return placed
