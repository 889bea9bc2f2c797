"""DeepSeek-style tensors in the Megatron-Core convention: multi-latent attention (MLA), the sigmoid router's expert
bias and multi-token-prediction (MTP) layers, under HuggingFace ``DeepseekV3`` names. :mod:`.megatron_core` applies
these tables; this module holds what they are and why.

**MLA.** Megatron-Core's ``MLASelfAttention`` and transformers' ``DeepseekV3Attention`` lay their projections out
the same way, so each is renamed, never re-cut (read in both forwards; proven by the logits of the fixtures):

- ``linear_q_down_proj`` ``(q_lora_rank, H)`` -> ``q_a_proj``, and ``q_layernorm`` -> ``q_a_layernorm``;
- ``linear_q_up_proj`` ``(heads x (qk_head_dim + qk_pos_emb_head_dim), q_lora_rank)`` -> ``q_b_proj``: both view
  the output as heads, each ``[nope; rope]`` (Megatron's ``qk_head_dim`` is transformers' ``qk_nope_head_dim``,
  ``qk_pos_emb_head_dim`` its ``qk_rope_head_dim``); without ``q_lora_rank``, ``linear_q_proj`` -> ``q_proj``;
- ``linear_kv_down_proj`` ``(kv_lora_rank + qk_pos_emb_head_dim, H)`` -> ``kv_a_proj_with_mqa``: the compressed
  key/value, then the rope key all heads share, split so by both; ``kv_layernorm`` -> ``kv_a_layernorm``;
- ``linear_kv_up_proj`` ``(heads x (qk_head_dim + v_head_dim), kv_lora_rank)`` -> ``kv_b_proj``: heads, each
  ``[k_nope; v]``;
- the rotary dims: Megatron's MLA takes them as interleaved pairs (``_apply_rotary_pos_emb_bshd`` de-interleaves
  them when ``multi_latent_attention``), which transformers does with ``rope_interleave: true`` (the layout of
  DeepSeek's release); the args check refuses a config without it.

Transformer Engine's layer spec fuses the two norms into the up projections
(``linear_q_up_proj.layer_norm_weight``, ``linear_kv_up_proj.layer_norm_weight``): the same tensors, other names.

**Router.** Sigmoid routing with ``moe_router_enable_expert_bias`` adds ``mlp.router.expert_bias`` (FP32) to the
scores before the top-k: transformers' ``mlp.gate.e_score_correction_bias``, never cast (:data:`.rules.KEEP_DTYPE`).
Shared experts have no gate in DeepSeek (``mlp.shared_experts.*``, cut by :mod:`.megatron_core`).

**MTP.** ``mtp.layers.{i}`` goes to ``model.layers.{num_hidden_layers + i}`` (where releases keep it, :mod:`.mtp`):
``enorm``, ``hnorm``, ``eh_proj`` (its input is ``[enorm(embedding); hnorm(hidden)]`` in both: Megatron's
``_concat_embeddings`` concatenates ``(decoder_input, hidden_states)``, transformers' ``MtpLayer`` ``(enorm, hnorm)``),
``final_layernorm`` -> ``shared_head.norm``, the inner ``transformer_layer`` as a decoder layer, and copies of the
embedding and output layer that Megatron shares with the MTP layers (``embed_tokens``, ``shared_head.head``).
An MTP layer the config does not declare is an error naming it, never dropped.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from ckpttool.model.architecture import config_value
from ckpttool.errors import ConfigError

#: MLA and router tensors of a Megatron layer -> their HuggingFace name within the layer
RENAMES = {
    "self_attention.linear_q_proj.weight": "self_attn.q_proj.weight",
    "self_attention.linear_q_down_proj.weight": "self_attn.q_a_proj.weight",
    "self_attention.linear_q_up_proj.weight": "self_attn.q_b_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_q_up_proj.layer_norm_weight": "self_attn.q_a_layernorm.weight",
    "self_attention.linear_kv_down_proj.weight": "self_attn.kv_a_proj_with_mqa.weight",
    "self_attention.linear_kv_up_proj.weight": "self_attn.kv_b_proj.weight",
    "self_attention.kv_layernorm.weight": "self_attn.kv_a_layernorm.weight",
    "self_attention.linear_kv_up_proj.layer_norm_weight": "self_attn.kv_a_layernorm.weight",
    "mlp.router.expert_bias": "mlp.gate.e_score_correction_bias",
}

#: ``mtp.layers.{i}.{part}``
MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.(.+)$")
#: the MTP layer's decoder layer, cut like a main layer
INNER = "transformer_layer."
#: the MTP layer's own tensors -> their HuggingFace name within the layer
MTP_PARTS = {
    "enorm.weight": "enorm.weight",
    "hnorm.weight": "hnorm.weight",
    "eh_proj.weight": "eh_proj.weight",
    "final_layernorm.weight": "shared_head.norm.weight",
}
#: tensors Megatron shares with every MTP layer -> the copy a release keeps in each
MTP_SHARED = {
    "embedding.word_embeddings.weight": "embed_tokens.weight",
    "output_layer.weight": "shared_head.head.weight",
}


def check_rows(fqn: str, suffix: str, shape: tuple[int, ...], config: Mapping[str, object]) -> None:
    """An MLA projection's rows against the config (each projection's rows say what it holds).

    Raises:
        ConfigError: naming the tensor, the rows found, the rows the config gives and what they are made of.
    """
    expected = _rows(suffix, config)
    if expected is not None and (not shape or shape[0] != expected[0]):
        rows = shape[0] if shape else 0
        raise ConfigError(f"'{fqn}': {rows} rows, but the config gives {expected[0]} ({expected[1]})")


def _rows(suffix: str, config: Mapping[str, object]) -> tuple[int, str] | None:
    def value(name: str) -> int | None:
        v = config.get(name)
        return v if isinstance(v, int) and not isinstance(v, bool) else None

    names = ("num_attention_heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    heads, nope, rope, v = (value(n) for n in names)
    q_lora, kv_lora = value("q_lora_rank"), value("kv_lora_rank")
    if suffix == "self_attention.linear_q_down_proj.weight" and q_lora:
        return q_lora, "q_lora_rank"
    query = ("self_attention.linear_q_up_proj.weight", "self_attention.linear_q_proj.weight")
    if suffix in query and heads and nope and rope:
        return heads * (nope + rope), f"{heads} heads x (qk_nope_head_dim {nope} + qk_rope_head_dim {rope})"
    if suffix == "self_attention.linear_kv_down_proj.weight" and kv_lora and rope:
        return kv_lora + rope, (f"kv_lora_rank {kv_lora} + qk_rope_head_dim {rope}: the compressed key/value, then "
                                "the rope key")
    if suffix == "self_attention.linear_kv_up_proj.weight" and heads and nope and v:
        return heads * (nope + v), f"{heads} heads x (qk_nope_head_dim {nope} + v_head_dim {v})"
    return None


def mtp_layer(index: int, config: Mapping[str, object]) -> int | None:
    """The ``model.layers`` index of MTP layer ``index`` (``num_hidden_layers + index``); None when the config does
    not declare it (``num_nextn_predict_layers``)."""
    declared, layers = declared_mtp(config), config_value(config, "num_hidden_layers")
    return layers + index if isinstance(layers, int) and index < declared else None


def declared_mtp(config: Mapping[str, object]) -> int:
    """How many MTP layers the config declares (``num_nextn_predict_layers``, alias ``num_mtp_layers``)."""
    n = config_value(config, "num_nextn_predict_layers", "num_mtp_layers")
    return n if isinstance(n, int) and not isinstance(n, bool) and n > 0 else 0


def undeclared(index: int, names: list[str], config: Mapping[str, object], model_type: str) -> str:
    """The problem for the tensors of an MTP layer the config does not declare: they are never dropped."""
    declared, layers = declared_mtp(config), config_value(config, "num_hidden_layers")
    where = f"model.layers.{layers + index}" if isinstance(layers, int) else "after the main layers"
    more = f" and {len(names) - 1} more tensors" if len(names) > 1 else ""
    return (f"'{names[0]}'{more} of MTP layer {index}: the {model_type} config declares {declared} MTP "
            f"layer{'s' if declared != 1 else ''} (num_nextn_predict_layers), so they have no place. Is this the "
            f"config the model trained with? One with num_nextn_predict_layers {index + 1} carries them to {where}")
