"""Qwen3-Next (transformers ``Qwen3NextForCausalLM``): gated DeltaNet linear attention beside gated full attention,
as the config's ``layer_types`` says layer by layer, MoE experts with a shared expert (``mlp_only_layers`` dense).

Names: transformers 5 converts Qwen3-Next's experts as Qwen2-MoE's (stacked in memory, per expert on disk:
:data:`ckpttool.families.qwen2_moe.RULES`); every other tensor keeps its name. A linear-attention layer holds
``linear_attn.in_proj_qkvz [2*Kd + 2*Vd, H]`` and ``in_proj_ba [2*Nv, H]`` (rows grouped per key head: for each of the
``linear_num_key_heads`` heads its q, k, v and z rows, then its b and a rows), ``conv1d.weight [2*Kd + Vd, 1, k]``,
``A_log [Nv]``, ``dt_bias [Nv]``, ``norm.weight [Vd/Nv]`` (plain ``w``) and ``out_proj [H, Vd]``. The class has no
MTP module: transformers ignores a release's ``mtp.*`` tensors on load (``_keys_to_ignore_on_load_unexpected``), so
none is expected, and those a source holds are carried to the output unchecked (:attr:`FamilyAdapter.carried`).

Tensor parallel (``split --to dcp --tp N``), as transformers' own plan for Qwen3-Next cuts it
(``Qwen3NextConfig.base_model_tp_plan``): ``in_proj_qkvz``, ``in_proj_ba`` and ``out_proj`` are
``colwise_gather_output``, a plain ``Shard(0)`` of the weight whose output is gathered before the grouped q/k/v/z
split. Because the rows are grouped per key head, a ``Shard(0)`` over ``tp`` ranks dividing ``linear_num_key_heads``
gives each rank whole key-head groups (rank 0 of 2 holds key head 0's q, k, v, z); with a ``tp`` that does not divide
them the gathered output is still right, and the cut is the producer's. ``conv1d``, ``A_log``, ``dt_bias`` and the
gated norm are not in the plan: replicated. Attention and the shared expert follow the Llama plan; routed experts are
replicated (``ep`` shards them), as for every MoE family here.
"""

from __future__ import annotations

from ckpttool.families import qwen2_moe
from ckpttool.families.adapter import HF_TP_RULES, REPLICATE, SHARD0, FamilyAdapter, PlacementRules
from ckpttool.families.layers import LayerRule

NAME = "qwen3_next"
#: transformers' plan for the gated DeltaNet (``colwise_gather_output``: weight rows), then the Llama plan
TP_RULES: PlacementRules = (
    (r"\.linear_attn\.(in_proj_qkvz|in_proj_ba|out_proj)\.weight$", SHARD0),
    (r"\.linear_attn\.(conv1d\.weight|A_log|dt_bias|norm\.weight)$", REPLICATE),
    *HF_TP_RULES,
)

#: the release's MTP module, which ``Qwen3NextForCausalLM`` ignores on load (its ``_keys_to_ignore_on_load_unexpected``)
CARRIED = (r"^mtp\.",)

ADAPTER = FamilyAdapter(NAME, model_types=(NAME,), rules=qwen2_moe.RULES, tp_rules=TP_RULES, carried=CARRIED)

#: a layer's kind: MoE or dense as Qwen2-MoE's, and its ``layer_types`` entry (linear or full attention)
LAYERS = LayerRule((NAME,), kinds=qwen2_moe.sparse_layers, shrink=qwen2_moe.keep_sparse_layers)
