"""The torchtitan source convention: the names torchtitan's own model classes give a Llama 3 (and a Qwen3 dense)
in the DCP its ``CheckpointManager`` writes (``step-N/``), and Meta's interleaved RoPE order of their Q and K rows.

torchtitan saves the model's state dict at the top of the DCP, beside ``optimizer.*``, ``lr_scheduler.*``,
``dataloader.*`` and ``train_state.*`` (the DCP reader keeps only model tensors and says how many it skipped), with
no ``model.`` prefix:

===========================================================  ==================================================
torchtitan (0.3: ``attention.qkv_linear.wq``; before: ``wq``)  HuggingFace on disk
===========================================================  ==================================================
``tok_embeddings.weight``                                     ``model.embed_tokens.weight``
``layers.N.attention[.qkv_linear].wq.weight``                 ``model.layers.N.self_attn.q_proj.weight`` (RoPE)
``layers.N.attention[.qkv_linear].wk.weight``                 ``model.layers.N.self_attn.k_proj.weight`` (RoPE)
``layers.N.attention[.qkv_linear].wv.weight``                 ``model.layers.N.self_attn.v_proj.weight``
``layers.N.attention.wo.weight``                              ``model.layers.N.self_attn.o_proj.weight``
``layers.N.attention.q_norm.weight`` / ``k_norm`` (Qwen3)      ``model.layers.N.self_attn.q_norm.weight`` / ``k_norm``
``layers.N.feed_forward.w1`` / ``w3`` / ``w2`` ``.weight``    ``model.layers.N.mlp.gate_proj`` / ``up_proj`` / ``down_proj``
``layers.N.attention_norm.weight``                            ``model.layers.N.input_layernorm.weight``
``layers.N.ffn_norm.weight``                                  ``model.layers.N.post_attention_layernorm.weight``
``norm.weight``                                               ``model.norm.weight``
``lm_head.weight`` (0.3) / ``output.weight`` (before)          ``lm_head.weight`` (dropped when the config ties it)
===========================================================  ==================================================

RoPE: torchtitan's Llama rotates adjacent pairs (Meta's order); transformers' Llama rotates the two halves of each
head. So Q and K rows are permuted per head of ``head_dim`` rows (:func:`~ckpttool.plan.transforms.rope_halves`),
what torchtitan's own ``Llama3StateDictAdapter.to_hf`` does with ``_permute`` (K with ``n_kv_heads`` heads of the
same ``head_dim``). Qwen3's torchtitan model rotates halves already (its adapter permutes nothing), so a ``qwen3``
(or ``qwen3_moe``) config gets no permutation.

MoE (Qwen3-MoE): the stacked experts ``layers.N.moe.routed_experts.inner_experts.w1_EFD`` / ``w3_EFD`` ``[E, ffn,
dim]`` and ``w2_EDF`` ``[E, dim, ffn]`` (0.2: ``moe.experts.w1``/``w3``/``w2``) are cut into HF's per-expert
``model.layers.N.mlp.experts.E.gate_proj`` / ``up_proj`` / ``down_proj`` ``.weight`` (slab ``E``, no transpose), the
router ``moe.router.gate.weight`` is ``mlp.gate.weight``, and the load-balancing ``moe.expert_bias_E`` is dropped
with a note, as torchtitan's ``Qwen3StateDictAdapter.to_hf`` does. Only for a config whose HF form has per-expert
tensors; Llama 4 is refused by name. DeepSeek-V3 (MLA, shared experts, its bias kept as
``e_score_correction_bias``, no permutation): :mod:`.torchtitan_mla`'s table over this one.

The way back (``split --to dcp --names torchtitan``) is :mod:`.torchtitan_back`: the same tables read the other way.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import replace

from ckpttool.families.adapter import Convention, CutResult, FamilyAdapter
from ckpttool.families.conventions import torchtitan_mla as mla
from ckpttool.families.rules import Unstack
from ckpttool.families.rules import cut as cut_by_rules
from ckpttool.layout.layout import Layout, TensorLayout
from ckpttool.model.description import ModelInfo
from ckpttool.plan.plan import TargetSpec, tensor_specs
from ckpttool.plan.transforms import rope_halves

NAME = "torchtitan"
#: torchtitan's names, ``{}`` the layer -> HuggingFace's; ``q``/``k`` mark the rows RoPE-permuted
LAYER = {
    "moe.router.gate.weight": ("mlp.gate.weight", ""),
    "attention.wq.weight": ("self_attn.q_proj.weight", "q"),
    "attention.wk.weight": ("self_attn.k_proj.weight", "k"),
    "attention.wv.weight": ("self_attn.v_proj.weight", ""),
    "attention.wo.weight": ("self_attn.o_proj.weight", ""),
    "attention.q_norm.weight": ("self_attn.q_norm.weight", ""),
    "attention.k_norm.weight": ("self_attn.k_norm.weight", ""),
    "feed_forward.w1.weight": ("mlp.gate_proj.weight", ""),
    "feed_forward.w3.weight": ("mlp.up_proj.weight", ""),
    "feed_forward.w2.weight": ("mlp.down_proj.weight", ""),
    "attention_norm.weight": ("input_layernorm.weight", ""),
    "ffn_norm.weight": ("post_attention_layernorm.weight", ""),
}
_TOP = {
    "tok_embeddings.weight": "model.embed_tokens.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAME = re.compile(r"^layers\.(\d+)\.(.+)$")
#: 0.3's ``QKVLinear`` module between ``attention`` and ``wq``/``wk``/``wv``
_QKV_LINEAR = re.compile(r"^attention\.qkv_linear\.(w[qkv]\.weight)$")
#: the names only torchtitan gives (any one recognises a layout)
_OWN = re.compile(r"^(tok_embeddings\.weight|layers\.\d+\.attention(\.qkv_linear)?\.w[qkvo]\.weight"
                  r"|layers\.\d+\.feed_forward\.w[123]\.weight)$")
#: torchtitan's stacked experts: 0.3's ``moe.routed_experts.inner_experts.w1_EFD`` (0.2: ``moe.experts.w1``)
_EXPERT = re.compile(r"^layers\.(\d+)\.moe\.(?:routed_experts\.inner_experts|experts)\.(w[123])(?:_EFD|_EDF)?$")
_EXPERT_HF = {"w1": "gate_proj.weight", "w3": "up_proj.weight", "w2": "down_proj.weight"}
#: the auxiliary-loss-free load-balancing bias torchtitan's MoE keeps (0.3 ``expert_bias_E``; 0.2 ``expert_bias``)
EXPERT_BIAS = re.compile(r"^layers\.\d+\.moe\.expert_bias(_E)?$")
#: families whose torchtitan model rotates halves, as transformers does: no permutation
HALVES = ("qwen3", "qwen3_moe")


class TorchtitanConvention(Convention):
    """torchtitan's model names and RoPE order (see the module docstring)."""

    name = NAME
    looks_for = ("tok_embeddings.weight, layers.N.attention[.qkv_linear].wq.weight, layers.N.feed_forward.w1.weight "
                 "(torchtitan)")

    def holds_names(self, names: Collection[str], info: ModelInfo | None) -> bool:
        """Some name is one only torchtitan gives (``tok_embeddings.weight``, ``layers.N.attention.wq.weight``...)
        and none is under transformers' ``model.`` (torchtitan saves no prefix: such a mix is transformers')."""
        return any(_OWN.match(name) for name in names) and not any(name.startswith("model.") for name in names)

    def cut(self, layout: Layout, info: ModelInfo, family: FamilyAdapter) -> CutResult:
        """torchtitan names -> HuggingFace on-disk names, Q/K rows from RoPE pairs to halves (see the module)."""
        head_dim, problem = head_dim_of(info)
        deepseek, table = mla.applies(info), mla.layer_table(LAYER, info)
        permute = info.model_type not in HALVES and info.family not in HALVES and not deepseek
        rope_problem = mla.rope_problem(info) if deepseek else ""
        # stacked experts are cut only for a model whose HF form has per-expert tensors (Qwen3-MoE)
        moe = any(".mlp.experts." in name for name in info.disk_shapes)
        specs: list[TargetSpec] = []
        problems: list[tuple[str, str]] = []
        permuted = 0
        dropped: list[str] = []
        mtp_layers: set[int] = set()
        for tensor in layout.tensors.values():
            if EXPERT_BIAS.match(tensor.fqn) and not deepseek:
                dropped.append(tensor.fqn)
                continue
            # DeepSeek-V3's MTP layer K is named as HF's layer num_hidden_layers + K (undeclared: one problem below)
            fqn, mtp_layer = mla.mtp_as_layer(tensor.fqn, info)
            if deepseek and mtp_layer is None and fqn.startswith("mtp_layers."):
                continue
            mtp_layers |= {mtp_layer} if mtp_layer is not None else set()
            experts = _experts(tensor, fqn) if moe else None
            if experts is not None:
                specs.extend(experts)
                continue
            hf, rope = _hf_name(fqn, table if mtp_layer is None else {**table, **mla.MTP_PARTS})
            if hf is None:
                why = mla.unmapped(tensor.fqn) if deepseek else "MoE and MLA layers are not supported yet"
                problems.append((tensor.fqn, f"'{tensor.fqn}': not a torchtitan name ckpttool maps to HuggingFace "
                                             f"for {info.model_type} ({why})"))
                continue
            if rope_problem and tensor.fqn.split(".", 2)[-1] in mla.ROPE_ROWS:
                problems.append((tensor.fqn, f"'{tensor.fqn}': {rope_problem}"))
                continue
            if hf == "lm_head.weight" and hf not in info.disk_shapes and hf in info.tied:
                dropped.append(tensor.fqn)
                continue
            cut = tensor_specs(tensor, hf)
            if rope and permute:
                if problem:
                    problems.append((tensor.fqn, f"'{tensor.fqn}': {problem}"))
                    continue
                cut = [replace(spec, transform=rope_halves(head_dim)) for spec in cut]
                permuted += 1
            specs.extend(cut)
        if deepseek:
            problems += mla.undeclared_mtp(list(layout.tensors), info)
            copies, mtp_notes = mla.mtp_copies(layout, sorted(mtp_layers))
            specs += copies
        notes = [f"torchtitan names mapped to HuggingFace's ({len(specs)} tensors)", *(mtp_notes if deepseek else [])]
        if permuted:
            notes.append(f"Q/K rows of {permuted} tensors permuted from Meta's interleaved RoPE pairs to HF's halves "
                         f"(head_dim {head_dim}), as torchtitan's state-dict adapter does")
        tied = [name for name in dropped if not EXPERT_BIAS.match(name)]
        if tied:
            notes.append(f"dropped {', '.join(tied)}: the config ties lm_head to the embeddings")
        biases = [name for name in dropped if EXPERT_BIAS.match(name)]
        if biases:
            notes.append(f"dropped {len(biases)} MoE load-balancing expert_bias tensors ({biases[0]}...): HF's "
                         f"{info.model_type} routes without one (torchtitan's own to_hf drops them too)")
        return specs, notes, problems

    def describe(self, info: ModelInfo, family: FamilyAdapter, known: bool) -> str:
        return f"{info.model_type} (torchtitan convention)"


def _experts(tensor: TensorLayout, fqn: str) -> list[TargetSpec] | None:
    """A stacked expert tensor of torchtitan's MoE (``[E, ...]``) cut into HF's per-expert on-disk tensors
    (``model.layers.N.mlp.experts.E.gate_proj.weight``: expert ``E`` is the tensor's slab ``E``, no transpose:
    torchtitan's ``w1_EFD``/``w3_EFD`` are ``[E, ffn, dim]`` and ``w2_EDF`` ``[E, dim, ffn]``, HF's Linear layout);
    None for any other tensor. ``fqn``: the tensor's name as a main layer's (an MTP layer's is renamed)."""
    match = _EXPERT.match(fqn)
    if match is None:
        return None
    layer, weight = match.group(1), match.group(2)
    prefix = f"model.layers.{layer}.mlp.experts"
    return cut_by_rules(tensor, f"{prefix}.{weight}", (Unstack(rf"^({re.escape(prefix)})\.{weight}$",
                                                      (f"{{prefix}}.{{expert}}.{_EXPERT_HF[weight]}",)),))


def _hf_name(fqn: str, table: dict[str, tuple[str, str]]) -> tuple[str | None, str]:
    """The HuggingFace on-disk name of torchtitan tensor ``fqn`` by the layer ``table`` and ``"q"``/``"k"`` for
    RoPE rows ("" else); (None, "") for a name this convention does not map."""
    top = _TOP.get(fqn)
    if top is not None:
        return top, ""
    match = _LAYER_NAME.match(fqn)
    if match is None:
        return None, ""
    layer, rest = match.groups()
    fused = _QKV_LINEAR.match(rest)
    rest = f"attention.{fused.group(1)}" if fused else rest
    hf = table.get(mla.OLD_BIAS.get(rest, rest))
    if hf is None:
        return None, ""
    return f"model.layers.{layer}.{hf[0]}", hf[1]


def head_dim_of(info: ModelInfo) -> tuple[int, str]:
    """The config's ``head_dim`` (else ``hidden_size // num_attention_heads``) and "" , or 0 and why not: the rows
    of a head the RoPE permutation works in, both ways (:mod:`.torchtitan_back` permutes them back)."""
    config = info.config
    head_dim = config.get("head_dim")
    if not isinstance(head_dim, int) or head_dim <= 0:
        hidden, heads = config.get("hidden_size"), config.get("num_attention_heads")
        if not isinstance(hidden, int) or not isinstance(heads, int) or heads <= 0:
            return 0, ("its rows are in Meta's RoPE order and the config names no head_dim (nor hidden_size and "
                       "num_attention_heads) to permute them by")
        head_dim = hidden // heads
    if head_dim % 2:
        return 0, f"its rows are in Meta's RoPE order and the config's head_dim {head_dim} is odd"
    return head_dim, ""


CONVENTION = TorchtitanConvention()
