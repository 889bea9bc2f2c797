"""DeepSeek-V3 in the torchtitan convention: the names torchtitan's ``deepseek_v3`` model gives multi-latent attention
(MLA), the shared experts and the router's load-balancing bias, under HuggingFace ``DeepseekV3`` names.
:mod:`.torchtitan` applies this table over its Llama one for a ``deepseek_v3`` config; this module holds what the
names are and why, as torchtitan 0.3's own ``DeepSeekV3StateDictAdapter`` (and 0.2's) maps them:

=============================================================  ================================================
torchtitan ``layers.N.``                                       HuggingFace ``model.layers.N.``
=============================================================  ================================================
``attention.wq.weight`` (no ``q_lora_rank``)                   ``self_attn.q_proj.weight``
``attention.wq_a`` / ``q_norm`` / ``wq_b`` ``.weight``         ``self_attn.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``
``attention.wkv_a`` / ``kv_norm`` / ``wkv_b`` ``.weight``      ``self_attn.kv_a_proj_with_mqa`` / ``kv_a_layernorm`` / ``kv_b_proj``
``moe.shared_experts.w1`` / ``w3`` / ``w2`` ``.weight``        ``mlp.shared_experts.gate_proj`` / ``up_proj`` / ``down_proj``
``moe.expert_bias_E`` (0.2: ``moe.expert_bias``)               ``mlp.gate.e_score_correction_bias`` (float32)
=============================================================  ================================================

Multi-token prediction (torchtitan 0.3's ``MTPTransformerBlock``, ``mtp_layers.K``): MTP layer ``K`` is HF's
``model.layers.{num_hidden_layers + K}`` (where DeepSeek's release keeps it: :mod:`ckpttool.families.mtp`), its
decoder block under a main layer's names, beside its own parts, as torchtitan's adapter maps them:

=============================================================  ================================================
torchtitan ``mtp_layers.K.``                                   HuggingFace ``model.layers.{num_hidden_layers + K}.``
=============================================================  ================================================
``enorm`` / ``hnorm`` / ``eh_proj`` ``.weight``                ``enorm`` / ``hnorm`` / ``eh_proj`` ``.weight``
``mtp_norm.weight``                                            ``shared_head.norm.weight``
``attention.*``, ``moe.*``, ``attention_norm``, ``ffn_norm``   as a main layer's
(torchtitan shares them: ``tok_embeddings``, ``lm_head``)      ``embed_tokens.weight``, ``shared_head.head.weight``
=============================================================  ================================================

``eh_proj``'s input is ``cat(enorm(embedding), hnorm(hidden))`` in both (torchtitan's ``MTPTransformerBlock``,
transformers' MTP layer), so it is renamed, never re-cut. torchtitan's MTP layers use the main model's embedding and
head; DeepSeek's release keeps a copy of each in every MTP layer (what vLLM's loader reads), so the merge writes
them from ``tok_embeddings`` and ``lm_head`` (torchtitan's own ``to_hf`` leaves them out). An MTP layer the config
does not declare (``num_nextn_predict_layers``) is refused naming it, never dropped.

The dense first layers (``feed_forward.w1/w2/w3``), the router (``moe.router.gate``), the stacked routed experts and
the rest are the Llama / Qwen3-MoE names of :mod:`.torchtitan`. Each tensor is renamed, never re-cut: both models
view ``wq``/``wq_b`` rows as heads of ``[nope; rope]`` and ``wkv_a`` rows as ``[kv_lora_rank; rope]``.

RoPE: torchtitan's MLA rotates the ``qk_rope_head_dim`` rows as interleaved pairs (``ComplexRoPE``), which
transformers' DeepSeek-V3 does with ``rope_interleave: true`` (its default, and the layout of DeepSeek's release),
so torchtitan's adapter permutes nothing and neither does ckpttool. A config with ``rope_interleave: false`` would
need the rope rows alone permuted: it is refused naming the key. The load-balancing bias is DeepSeek-V3's own
``e_score_correction_bias`` (added to the sigmoid scores for the top-k choice only, in both models): kept, where
Qwen3-MoE (no such tensor in HF) drops it.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ckpttool.families import mtp
from ckpttool.families.conventions import megatron_mla
from ckpttool.layout.layout import Box, Layout
from ckpttool.model.description import ModelInfo
from ckpttool.model.architecture import config_value
from ckpttool.plan.tiling import Slice
from ckpttool.plan.plan import TargetSpec, tensor_specs

if TYPE_CHECKING:  # the families package imports this module: its MemoryTensor only annotates here
    from ckpttool.families import MemoryTensor

#: the model type whose torchtitan names this module holds
FAMILY = "deepseek_v3"
#: torchtitan's DeepSeek-V3 layer names -> HuggingFace's (and the RoPE mark of :mod:`.torchtitan`: none here)
LAYER = {
    "attention.wq.weight": ("self_attn.q_proj.weight", ""),
    "attention.wq_a.weight": ("self_attn.q_a_proj.weight", ""),
    "attention.q_norm.weight": ("self_attn.q_a_layernorm.weight", ""),
    "attention.wq_b.weight": ("self_attn.q_b_proj.weight", ""),
    "attention.wkv_a.weight": ("self_attn.kv_a_proj_with_mqa.weight", ""),
    "attention.kv_norm.weight": ("self_attn.kv_a_layernorm.weight", ""),
    "attention.wkv_b.weight": ("self_attn.kv_b_proj.weight", ""),
    "moe.shared_experts.w1.weight": ("mlp.shared_experts.gate_proj.weight", ""),
    "moe.shared_experts.w3.weight": ("mlp.shared_experts.up_proj.weight", ""),
    "moe.shared_experts.w2.weight": ("mlp.shared_experts.down_proj.weight", ""),
    "moe.expert_bias_E": ("mlp.gate.e_score_correction_bias", ""),
}
#: an MTP layer's own parts, torchtitan -> HF (under ``model.layers.{num_hidden_layers + K}``)
MTP_PARTS = {
    "enorm.weight": ("enorm.weight", ""),
    "hnorm.weight": ("hnorm.weight", ""),
    "eh_proj.weight": ("eh_proj.weight", ""),
    "mtp_norm.weight": ("shared_head.norm.weight", ""),
}
#: the main model's tensors torchtitan's MTP layers share -> the copy each HF MTP layer keeps
MTP_SHARED = {"tok_embeddings.weight": "embed_tokens.weight", "lm_head.weight": "shared_head.head.weight"}
_MTP = re.compile(r"^mtp_layers\.(\d+)\.(.+)$")
#: the Llama table's names MLA has not (its keys and values come from ``wkv_a``/``wkv_b``)
NOT_MLA = ("attention.wk.weight", "attention.wv.weight", "attention.k_norm.weight")
#: 0.2's name of the load-balancing bias, read as 0.3's
OLD_BIAS = {"moe.expert_bias": "moe.expert_bias_E"}
#: the tensors whose rows hold the rotary dims (the rope part of each head, or of the shared key)
ROPE_ROWS = ("attention.wq.weight", "attention.wq_b.weight", "attention.wkv_a.weight")


def applies(info: ModelInfo) -> bool:
    """Whether ``info`` is a DeepSeek-V3 model, whose torchtitan names are this module's."""
    return info.model_type == FAMILY or info.family == FAMILY


def layer_table(base: dict[str, tuple[str, str]], info: ModelInfo) -> dict[str, tuple[str, str]]:
    """torchtitan's layer names -> HF's for ``info``: ``base`` (the Llama / Qwen3 table), with this module's
    DeepSeek-V3 names over it for a DeepSeek-V3 model (``q_norm`` is MLA's ``q_a_layernorm`` there; no
    ``wk``/``wv``/``k_norm``)."""
    if not applies(info):
        return base
    return {**{name: hf for name, hf in base.items() if name not in NOT_MLA}, **LAYER}


def mtp_as_layer(fqn: str, info: ModelInfo) -> tuple[str, int | None]:
    """An MTP layer's tensor ``mtp_layers.K.rest`` named as the main layer HF keeps it in, ``layers.{n}.rest`` with
    ``n = num_hidden_layers + K``, and that ``n``; ``(fqn, None)`` for any other tensor, or for an MTP layer the
    config does not declare (:func:`undeclared_mtp` says why)."""
    match = _MTP.match(fqn)
    if match is None or not applies(info):
        return fqn, None
    layer = megatron_mla.mtp_layer(int(match[1]), info.config)
    return (fqn, None) if layer is None else (f"layers.{layer}.{match[2]}", layer)


def undeclared_mtp(names: list[str], info: ModelInfo) -> list[tuple[str, str]]:
    """One problem per MTP layer of which ``names`` hold tensors the config does not declare (they are never
    dropped), naming its first tensor and the config key."""
    layers: dict[int, list[str]] = {}
    for name in names:
        match = _MTP.match(name)
        if match is not None and megatron_mla.mtp_layer(int(match[1]), info.config) is None:
            layers.setdefault(int(match[1]), []).append(name)
    return [(found[0], megatron_mla.undeclared(k, found, info.config, info.model_type))
            for k, found in sorted(layers.items())]


def rope_problem(info: ModelInfo) -> str:
    """Why the rope rows of a DeepSeek-V3 torchtitan model cannot be written for ``info`` ("" if they can):
    torchtitan's interleaved pairs are transformers' layout only with ``rope_interleave: true``."""
    if info.config.get("rope_interleave", True) is True:
        return ""
    return ("its rotary rows are in torchtitan's interleaved pairs and the config sets rope_interleave: false "
            "(ckpttool does not permute MLA's rope rows alone); use rope_interleave: true, as DeepSeek-V3's release "
            "and torchtitan's own adapter do")


def mtp_copies(layout: Layout, layers: list[int]) -> tuple[list[TargetSpec], list[str]]:
    """The copies of the embedding and the head that each HF MTP layer ``layers`` keeps (torchtitan shares its
    main model's: :data:`MTP_SHARED`), and a note per layer."""
    specs = [spec for n in layers for src, part in MTP_SHARED.items() if src in layout.tensors
             for spec in tensor_specs(layout.tensors[src], f"model.layers.{n}.{part}")]
    notes = [f"MTP layer model.layers.{n} written with copies of the embedding and head torchtitan shares with it "
             "(embed_tokens, shared_head.head), as DeepSeek's release keeps them" for n in layers]
    return specs, notes


def mtp_memory(memory: Sequence[MemoryTensor], info: ModelInfo,
               on_disk: Collection[str]) -> tuple[list[int], list[MemoryTensor]]:
    """The MTP layers ``on_disk`` holds (HF's indices) and, for the way back, their tensors as a model's in-memory
    ones (transformers' causal LM builds none): the decoder block as the last main layer's tensors moved to the MTP
    layer's index (torchtitan builds it from that layer's config), beside its own parts (:data:`MTP_PARTS`), each
    whole. The embedding and head copies are left out: torchtitan's MTP layers share the main model's."""
    expected = mtp.expected(info) if applies(info) else {}
    layers = mtp.held(on_disk, expected)
    last = config_value(info.config, "num_hidden_layers")
    if not layers or not isinstance(last, int) or not memory:
        return [], []
    main = f"model.layers.{last - 1}."
    own = {hf for hf, _ in MTP_PARTS.values()}
    extra: list[MemoryTensor] = []
    for n in layers:
        here = f"model.layers.{n}."
        extra += [replace(t, name=here + t.name[len(main):],
                          slices=tuple(replace(sl, source=here + sl.source[len(main):])
                                       if sl.source.startswith(main) else sl for sl in t.slices))
                  for t in memory if t.name.startswith(main)]
        for name, shape in expected[n].items():
            if name[len(here):] in own:
                box = Box.whole(shape)
                # a MemoryTensor made from one at hand: the families package imports this module, so its class
                # only annotates here
                extra.append(replace(memory[0], name=name, shape=shape, slices=(Slice(name, box, box),),
                                     stacked=False, transform=None))
    return layers, extra


def mtp_titan_name(name: str, info: ModelInfo) -> str:
    """torchtitan's name of ``layers.{n}.rest`` written from HF's MTP layer ``n`` (``n >= num_hidden_layers``):
    ``mtp_layers.{n - num_hidden_layers}.rest``; any other name as it is."""
    match = re.match(r"^layers\.(\d+)\.(.+)$", name)
    first = config_value(info.config, "num_hidden_layers")
    if match is None or not isinstance(first, int) or int(match[1]) < first or not applies(info):
        return name
    return f"mtp_layers.{int(match[1]) - first}.{match[2]}"


def unmapped(fqn: str) -> str:
    """Why torchtitan's DeepSeek-V3 tensor ``fqn`` has no HF name here: not one of its model's (an MTP layer's
    part included)."""
    return f"not in torchtitan's DeepSeek-V3 model{' (nor of its MTP layers)' if _MTP.match(fqn) else ''}"
