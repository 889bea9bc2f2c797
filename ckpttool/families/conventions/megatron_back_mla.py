"""DeepSeek-V3 the way back (split ``--to megatron``): the global tensors megatron-core 0.16's GPT model with
multi-latent attention (MLA), first-k dense layers, shared experts, the router's expert bias and multi-token
prediction (MTP) layers saves, listed from the HuggingFace model's tensors.

Its layers are not all alike (``moe_layer_freq``: the first ``first_k_dense_replace`` layers dense), so megatron-core
does not stack them: every layer is saved under its own global number, ``decoder.layers.{i}.*`` (the layer spec of
``get_gpt_decoder_block_spec``, the local one: ``input_layernorm``, ``pre_mlp_layernorm``, ``q_layernorm`` and
``kv_layernorm`` apart from the linear layers), experts stacked over a leading expert axis
(``decoder.layers.{i}.mlp.experts.experts.linear_fc1.weight`` is ``(E, 2F, H)``), and MTP layer ``k`` as
``mtp.layers.{k}.*`` (its decoder layer under ``transformer_layer.``) on the last pipeline stage.

The names are :mod:`.megatron_mla`'s tables read the other way (:data:`~.megatron_mla.RENAMES`,
:data:`~.megatron_mla.MTP_PARTS`): every MLA projection is renamed, never re-cut, so its shape is the HuggingFace
tensor's; which element goes where is then the merge's own cut (:func:`.megatron_core.to_hf`) turned around by
:func:`.megatron_back.megatron_tensors`. Tensor-parallel placements (:data:`TP_RULES`) are those megatron-core 0.16
saves with (read from ``fixtures/megatron_deepseek_tp2_ep2``): every MLA projection ``Shard(0)`` (rows), the norms,
router and expert bias replicated, ``linear_proj`` and ``linear_fc2`` ``Shard(1)``, a SwiGLU ``linear_fc1`` each rank's
``[gate_r; up_r]``, MTP's ``eh_proj`` ``Shard(0)``. (Its Transformer Engine spec saves the down projections
``linear_q_down_proj`` and ``linear_kv_down_proj`` whole instead, ``parallel_mode="duplicated"``; torch_dist re-shards
on load, so the local spec's cut should load there too: untested, no Transformer Engine on CPU. An FP8 release's
shard that starts inside a scale block, rows 288..576 of ``kv_down``'s 576 at TP2, is decoded from the blocks it
meets: :class:`ckpttool.quant.decode.Fp8Blocks`.)
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ckpttool.errors import ConfigError
from ckpttool.families.adapter import REPLICATE, SHARD0, PlacementRules
from ckpttool.families.conventions import megatron_mla as mla
from ckpttool.layout.layout import Shape
from ckpttool.layout.placements import Placement

#: model types whose Megatron-Core form is this one
MODEL_TYPES = ("deepseek_v3",)
#: a tensor saved per layer, under its global number (``decoder.layers.{i}.``) or an MTP layer's
PER_LAYER = re.compile(r"^(?:decoder\.layers\.(\d+)\.|mtp\.layers\.(\d+)\.)")
#: Megatron-Core tensor name (regex, searched) -> its tensor-parallel placement, per-layer names (no layer axis)
TP_RULES: PlacementRules = (
    (r"^(embedding\.word_embeddings|output_layer)\.weight$", SHARD0),
    (r"\.mlp\.experts\.experts\.linear_fc1\.weight$", Placement("strided", 1, 2)),
    (r"\.mlp\.experts\.experts\.linear_fc2\.weight$", Placement("shard", 2)),
    (r"\.self_attention\.linear_(q|q_down|q_up|kv_down|kv_up)_proj\.weight$", SHARD0),
    (r"\.eh_proj\.weight$", SHARD0),
    (r"\.linear_fc1\.weight$", Placement("strided", 0, 2)),
    (r"\.(linear_proj|linear_fc2)\.weight$", Placement("shard", 1)),
    (r"(layernorm\.weight|norm\.weight|router\.weight|router\.expert_bias)$", REPLICATE),
)
#: the linear layers (within a layer) whose ``_extra_state`` megatron-core saves: ``shard_0_1``, experts' per expert
EXTRA_STATE = ("self_attention.linear_proj", "self_attention.linear_q_proj", "self_attention.linear_q_down_proj",
               "self_attention.linear_q_up_proj", "self_attention.linear_kv_down_proj",
               "self_attention.linear_kv_up_proj", "mlp.linear_fc1", "mlp.linear_fc2", "mlp.experts.experts.linear_fc1",
               "mlp.experts.experts.linear_fc2", "mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2",
               "eh_proj")

#: MLA's tensors in the local layer spec: :data:`.megatron_mla.RENAMES` without Transformer Engine's fused norms
_MLA = {meg: hf for meg, hf in mla.RENAMES.items() if meg.startswith("self_attention.")
        and not meg.endswith(".layer_norm_weight")}


def megatron_shapes(disk: Mapping[str, Shape], config: Mapping[str, object], vocab_rows: int, tied: bool,
                    mtp_layers: int = 0) -> dict[str, Shape]:
    """The global tensors of a DeepSeek-V3 model megatron-core saves, in its order, from the on-disk HuggingFace
    shapes ``disk`` (the main model's, and the MTP layers' for the first ``mtp_layers`` of them, at
    ``model.layers.{num_hidden_layers + k}``).

    Raises:
        ConfigError: a layer with neither a dense MLP nor experts, or without MLA's projections.
    """
    layers = int(config.get("num_hidden_layers") or 0)
    shapes: dict[str, Shape] = {"embedding.word_embeddings.weight": (vocab_rows, disk["model.embed_tokens.weight"][1])}
    for i in range(layers):
        shapes.update(_layer(disk, f"model.layers.{i}.", f"decoder.layers.{i}."))
    shapes["decoder.final_layernorm.weight"] = disk["model.norm.weight"]
    for k in range(mtp_layers):
        h, m = f"model.layers.{layers + k}.", f"mtp.layers.{k}."
        parts = {meg: hf for meg, hf in mla.MTP_PARTS.items() if meg != "final_layernorm.weight"}
        shapes.update({m + meg: disk[h + hf] for meg, hf in parts.items()})
        shapes.update(_layer(disk, h, m + mla.INNER))
        shapes[m + "final_layernorm.weight"] = disk[h + mla.MTP_PARTS["final_layernorm.weight"]]
    if not tied:  # tied: megatron-core shares the embedding and saves no output layer
        shapes["output_layer.weight"] = (vocab_rows, disk["lm_head.weight"][1])
    return shapes


def _layer(disk: Mapping[str, Shape], h: str, m: str) -> dict[str, Shape]:
    """One decoder layer's tensors (HF prefix ``h``) under Megatron prefix ``m``."""
    if h + "self_attn.kv_a_proj_with_mqa.weight" not in disk:
        raise ConfigError(f"deepseek_v3: '{h}self_attn.kv_a_proj_with_mqa.weight' is not among the model's tensors; "
                          "ckpttool's Megatron-Core form of DeepSeek-V3 is multi-latent attention")
    out: dict[str, Shape] = {m + "input_layernorm.weight": disk[h + "input_layernorm.weight"],
                             m + "self_attention.linear_proj.weight": disk[h + "self_attn.o_proj.weight"]}
    out.update({m + meg: disk[h + hf] for meg, hf in _MLA.items() if h + hf in disk})
    out[m + "pre_mlp_layernorm.weight"] = disk[h + "post_attention_layernorm.weight"]
    if h + "mlp.gate_proj.weight" in disk:
        gate = disk[h + "mlp.gate_proj.weight"]
        out[m + "mlp.linear_fc1.weight"] = (2 * gate[0], gate[1])
        out[m + "mlp.linear_fc2.weight"] = disk[h + "mlp.down_proj.weight"]
        return out
    if h + "mlp.gate.weight" not in disk:
        raise ConfigError(f"deepseek_v3: layer '{h}' has neither a dense MLP (mlp.gate_proj) nor a router (mlp.gate)")
    router = disk[h + "mlp.gate.weight"]
    out[m + "mlp.router.weight"] = router
    bias = h + mla.RENAMES["mlp.router.expert_bias"]
    if bias in disk:
        out[m + "mlp.router.expert_bias"] = disk[bias]
    gate, down = disk[h + "mlp.experts.0.gate_proj.weight"], disk[h + "mlp.experts.0.down_proj.weight"]
    out[m + "mlp.experts.experts.linear_fc1.weight"] = (router[0], 2 * gate[0], gate[1])
    out[m + "mlp.experts.experts.linear_fc2.weight"] = (router[0], *down)
    if h + "mlp.shared_experts.gate_proj.weight" in disk:
        shared = disk[h + "mlp.shared_experts.gate_proj.weight"]
        out[m + "mlp.shared_experts.linear_fc1.weight"] = (2 * shared[0], shared[1])
        out[m + "mlp.shared_experts.linear_fc2.weight"] = disk[h + "mlp.shared_experts.down_proj.weight"]
    return out


def layer_of(name: str, layers: int) -> int | None:
    """The global layer a per-layer tensor belongs to (an MTP layer ``k``: ``layers + k``), None for a tensor of
    no layer (embedding, final norm, output layer) or a stacked one."""
    match = PER_LAYER.match(name)
    if match is None:
        return None
    return int(match[1]) if match[1] is not None else layers + int(match[2])


def stacked_view(shapes: Mapping[str, Shape], config: Mapping[str, object]) -> dict[str, Shape]:
    """The per-layer tensors' sizes under the stacked names of :func:`.megatron_back_args.training_args` (a layer axis
    in front, the first layer that has each; ``linear_qkv``'s rows such that its ``kv_channels`` is ``v_head_dim``)."""
    layers = int(config.get("num_hidden_layers") or 0)
    heads, value = int(config.get("num_attention_heads") or 0), int(config.get("v_head_dim") or 0)
    hidden = shapes["embedding.word_embeddings.weight"][1]
    view: dict[str, Shape] = {"decoder.layers.self_attention.linear_qkv.weight": (layers, 3 * heads * value, hidden)}
    for i in range(layers):
        for part in ("mlp.linear_fc1.weight", "mlp.shared_experts.linear_fc1.weight",
                     "mlp.experts.experts.linear_fc1.weight"):
            shape = shapes.get(f"decoder.layers.{i}.{part}")
            if shape is not None:
                view.setdefault(f"decoder.layers.{part}", (layers, *shape))
    return view


def training_args(config: Mapping[str, object], shapes: Mapping[str, Shape], layers: int,
                  mtp_layers: int) -> dict[str, object]:
    """The arguments megatron-core builds this DeepSeek-V3 with, beside the common ones (what
    :func:`ckpttool.families.deepseek.megatron_args` checks on the way in): MLA's sizes, the dense-first MoE layer
    pattern, the sigmoid router with its expert bias and group limit, the MTP layers."""
    first = int(config.get("first_k_dense_replace") or 0)
    rope = config.get("rope_parameters") if isinstance(config.get("rope_parameters"), dict) else {}
    rope_type = str(rope.get("rope_type") or (config.get("rope_scaling") or {}).get("type") or "default")
    heads = int(config.get("num_attention_heads") or 0)
    args: dict[str, object] = {
        "multi_latent_attention": True, "q_lora_rank": config.get("q_lora_rank"),
        "kv_lora_rank": config.get("kv_lora_rank"), "qk_head_dim": config.get("qk_nope_head_dim"),
        "qk_pos_emb_head_dim": config.get("qk_rope_head_dim"), "v_head_dim": config.get("v_head_dim"),
        "kv_channels": config.get("v_head_dim"), "group_query_attention": False, "num_query_groups": heads,
        "qk_layernorm": True, "rope_type": "rope" if rope_type == "default" else rope_type, "rotary_interleaved": False,
        "moe_layer_freq": [0] * first + [1] * (layers - first), "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": any(n.endswith("router.expert_bias") for n in shapes),
        "moe_router_num_groups": config.get("n_group"), "moe_router_group_topk": config.get("topk_group"),
        "moe_router_topk_scaling_factor": config.get("routed_scaling_factor"), "moe_router_pre_softmax": False,
        "mtp_num_layers": mtp_layers or None, "ffn_hidden_size": config.get("intermediate_size"),
    }
    if rope_type == "yarn":
        args.update(rotary_scaling_factor=rope.get("factor"), mscale=rope.get("mscale"),
                    mscale_all_dim=rope.get("mscale_all_dim"))
    return args
