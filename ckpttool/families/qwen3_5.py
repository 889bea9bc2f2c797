"""Qwen3.5's language model as a causal LM (transformers ``Qwen3_5ForCausalLM``, model type ``qwen3_5_text``): the
gated DeltaNet of Qwen3-Next with its projections unfused, beside gated full attention, as ``layer_types`` says.

Names: in memory as on disk (transformers' conversion for ``qwen3_5_text`` only moves a ``language_model`` prefix,
which the causal LM does not have). A linear-attention layer holds ``linear_attn.in_proj_qkv [2*Kd + Vd, H]`` (all
query rows, then all key rows, then all value rows: not grouped per key head, unlike Qwen3-Next's
``in_proj_qkvz``), ``in_proj_z [Vd, H]``, ``in_proj_b`` and ``in_proj_a [Nv, H]``, ``conv1d``, ``A_log``,
``dt_bias``, the gated ``norm`` (plain ``w``) and ``out_proj``. A release's MTP module (``mtp.*``), which the class
ignores on load, is carried unchecked.

Qwen3.5-MoE's language model (``Qwen3_5MoeForCausalLM``, model type ``qwen3_5_moe_text``), which transformers
converts as ``qwen3_5_text`` (so this adapter serves it), holds the same layers with MoE MLPs: a router
``mlp.gate``, routed experts stacked in memory and per expert on disk as Qwen2-MoE's
(:data:`ckpttool.families.qwen2_moe.RULES`; a dense model has no tensor they match), a shared expert and its
``shared_expert_gate``.

Tensor parallel (``split --to dcp --tp N``), as transformers' plan (``Qwen3_5TextConfig.base_model_tp_plan``) cuts it:
the five projections are ``colwise_gather_output``, a plain ``Shard(0)`` of the weight whose output is gathered
before q, k and v are split, so a rank's rows of ``in_proj_qkv`` may hold queries and keys: that is the producer's
cut, and the gathered output is right. ``conv1d``, ``A_log``, ``dt_bias`` and the gated norm are replicated; the
rest follows the Llama plan. The image-text-to-text Qwen3.5 (``model.language_model.*``, ``model.visual.*``) is not
this adapter's.
"""

from __future__ import annotations

from ckpttool.families import qwen2_moe
from ckpttool.families.adapter import HF_TP_RULES, REPLICATE, SHARD0, FamilyAdapter, PlacementRules
from ckpttool.families.layers import alike

NAME = "qwen3_5_text"
TP_RULES: PlacementRules = (
    (r"\.linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight$", SHARD0),
    (r"\.linear_attn\.(conv1d\.weight|A_log|dt_bias|norm\.weight)$", REPLICATE),
    *HF_TP_RULES,
)

#: the release's MTP module (``mtp.*``) is ignored on load, as Qwen3-Next's: carried unchecked
ADAPTER = FamilyAdapter(NAME, rules=qwen2_moe.RULES, tp_rules=TP_RULES, carried=(r"^mtp\.",))

#: a layer's kind is its ``layer_types`` entry (linear or full attention)
LAYERS = alike(NAME)
