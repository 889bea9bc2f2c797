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
config gets no permutation. The MoE layouts (Qwen3-MoE, DeepSeek-V3, Llama 4: ``moe.experts.w1`` stacked) are not
cut here yet: their tensors are refused by name.

The way back (``split --to dcp --names torchtitan``, :func:`to_torchtitan`): the model's in-memory tensors renamed
to the names of the torchtitan release named (:data:`RELEASES`: 0.3's ``attention.qkv_linear.wq`` and ``lm_head``,
or 0.2's ``attention.wq`` and ``output``), Q/K rows back to Meta's pairs (``rope_halves(head_dim).inverse()``, what
torchtitan's ``from_hf`` does with ``_reverse_permute``), placed as torchtitan's parallelize functions place them
(:func:`tp_placement`; 0.3's Q/K/V saved whole, one chunk each, as its fused ``wqkv`` is split on save).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.families.adapter import Convention, CutResult, FamilyAdapter
from ckpttool.layout.placements import Placement
from ckpttool.layout.layout import Layout
from ckpttool.model.architecture import ModelInfo
from ckpttool.plan.plan import TargetSpec, tensor_specs
from ckpttool.plan.transforms import rope_halves

if TYPE_CHECKING:  # the families package imports this module: its MemoryTensor only annotates here
    from ckpttool.families import MemoryTensor

NAME = "torchtitan"
#: torchtitan's names, ``{}`` the layer -> HuggingFace's; ``q``/``k`` mark the rows RoPE-permuted
_LAYER = {
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
#: families whose torchtitan model rotates halves, as transformers does: no permutation
_HALVES = ("qwen3",)


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
        head_dim, problem = _head_dim(info)
        permute = info.model_type not in _HALVES and info.family not in _HALVES
        specs: list[TargetSpec] = []
        problems: list[tuple[str, str]] = []
        permuted = 0
        dropped: list[str] = []
        for tensor in layout.tensors.values():
            hf, rope = _hf_name(tensor.fqn)
            if hf is None:
                problems.append((tensor.fqn, f"'{tensor.fqn}': not a torchtitan name ckpttool maps to HuggingFace "
                                             f"for {info.model_type} (MoE and MLA layers are not supported yet)"))
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
        notes = [f"torchtitan names mapped to HuggingFace's ({len(specs)} tensors)"]
        if permuted:
            notes.append(f"Q/K rows of {permuted} tensors permuted from Meta's interleaved RoPE pairs to HF's halves "
                         f"(head_dim {head_dim}), as torchtitan's state-dict adapter does")
        if dropped:
            notes.append(f"dropped {', '.join(dropped)}: the config ties lm_head to the embeddings")
        return specs, notes, problems

    def describe(self, info: ModelInfo, family: FamilyAdapter, known: bool) -> str:
        return f"{info.model_type} (torchtitan convention)"


def _hf_name(fqn: str) -> tuple[str | None, str]:
    """The HuggingFace on-disk name of torchtitan tensor ``fqn`` and ``"q"``/``"k"`` for RoPE rows ("" else);
    (None, "") for a name this convention does not map."""
    top = _TOP.get(fqn)
    if top is not None:
        return top, ""
    match = _LAYER_NAME.match(fqn)
    if match is None:
        return None, ""
    layer, rest = match.groups()
    fused = _QKV_LINEAR.match(rest)
    hf = _LAYER.get(f"attention.{fused.group(1)}" if fused else rest)
    if hf is None:
        return None, ""
    return f"model.layers.{layer}.{hf[0]}", hf[1]


def _head_dim(info: ModelInfo) -> tuple[int, str]:
    """The config's ``head_dim`` (else ``hidden_size // num_attention_heads``) and "" , or 0 and why not."""
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


#: the torchtitan releases whose names a split writes (``--names torchtitan`` is the first, the newest)
RELEASES = ("0.3", "0.2")
#: the model types torchtitan builds that a split writes in its names (Llama 3 and Qwen3 dense)
FAMILIES = ("llama", "qwen3")
_SHARD0, _SHARD1, _REPLICATE = Placement("shard", 0), Placement("shard", 1), Placement("replicate")
#: torchtitan's tensor-parallel plan (``parallelize_llama`` / ``parallelize_qwen3``), by the name's last two parts
_TP = {
    "tok_embeddings.weight": _SHARD0, "lm_head.weight": _SHARD0, "output.weight": _SHARD0,
    "wq.weight": _SHARD0, "wk.weight": _SHARD0, "wv.weight": _SHARD0, "wo.weight": _SHARD1,
    "w1.weight": _SHARD0, "w3.weight": _SHARD0, "w2.weight": _SHARD1,
}


@dataclass(frozen=True, slots=True)
class TorchtitanNames:
    """A model's in-memory tensors as torchtitan ``release`` saves them (:func:`to_torchtitan`).

    Attributes:
        tensors: every tensor under its torchtitan name, Q/K through the inverse RoPE permutation.
        whole: names saved whole, one chunk on one rank, whatever the mesh (0.3's Q, K and V).
        notes: what was done, for the user.
    """

    tensors: list[MemoryTensor]
    whole: frozenset[str]
    notes: list[str]


def release_of(names: str) -> str:
    """The torchtitan release of a split's ``names`` option: ``"torchtitan"`` is the newest (:data:`RELEASES`),
    ``"torchtitan-0.2"`` names one.

    Raises:
        ArgumentError: ``names`` is neither.
    """
    release = RELEASES[0] if names == NAME else names.removeprefix(f"{NAME}-")
    if not names.startswith(NAME) or release not in RELEASES:
        raise ArgumentError(f"names={names!r}: a split writes torchtitan's names of release "
                            f"{', '.join(RELEASES)} (names='torchtitan' is {RELEASES[0]}, or 'torchtitan-RELEASE')")
    return release


def to_torchtitan(memory: Sequence[MemoryTensor], info: ModelInfo, release: str = RELEASES[0]) -> TorchtitanNames:
    """The in-memory tensors of a transformers model (``memory``: HF names, slices of the on-disk tensors) as
    torchtitan ``release``'s model saves them: torchtitan's names, Q/K rows from HF's RoPE halves back to Meta's
    pairs (none for Qwen3), a tied head kept as torchtitan's state dict holds it.

    Raises:
        ConfigError: a model type torchtitan has no model of here (:data:`FAMILIES`), or tensors with no torchtitan
            name (all listed), or a head_dim the rows cannot be permuted by.
    """
    if info.model_type not in FAMILIES:
        raise ConfigError(
            f"names='torchtitan': torchtitan {release} has no {info.model_type} model ckpttool writes its names for "
            f"(it writes {', '.join(FAMILIES)}: Llama 3 and Qwen3 dense); split without --names, or merge to another "
            "family first")
    head_dim, problem = _head_dim(info)
    permute = info.model_type not in _HALVES
    back = {hf: (titan, rope) for titan, (hf, rope) in _LAYER.items()}
    tensors, unnamed, whole, permuted = [], [], set(), 0
    for tensor in memory:
        name, rope = _titan_name(tensor.name, back, release)
        if name is None:
            unnamed.append(tensor.name)
            continue
        transform = None
        if rope and permute:
            if problem:
                raise ConfigError(f"'{tensor.name}': {problem}")
            transform, permuted = rope_halves(head_dim).inverse(), permuted + 1
        if release == "0.3" and ".qkv_linear." in name:
            whole.add(name)
        tensors.append(replace(tensor, name=name, transform=transform))
    if unnamed:
        raise ConfigError(
            f"names='torchtitan': {len(unnamed)} tensor{'s' if len(unnamed) != 1 else ''} of the {info.model_type} "
            f"model {'have' if len(unnamed) != 1 else 'has'} no name in torchtitan {release}'s model: "
            f"{', '.join(unnamed[:5])}{' ...' if len(unnamed) > 5 else ''}; nothing was written")
    notes = [f"written in torchtitan {release}'s names ({len(tensors)} tensors)"]
    if permuted:
        notes.append(f"Q/K rows of {permuted} tensors permuted from HF's RoPE halves back to Meta's interleaved pairs "
                     f"(head_dim {head_dim}), as torchtitan's state-dict adapter's from_hf does")
    return TorchtitanNames(tensors, frozenset(whole), notes)


def tp_placement(name: str) -> Placement:
    """The tensor-parallel placement torchtitan's plan gives torchtitan tensor ``name``: embeddings and head
    ``Shard(0)`` (``RowwiseParallel`` embedding, ``ColwiseParallel`` head), ``wq``/``wk``/``wv``/``w1``/``w3``
    ``Shard(0)``, ``wo``/``w2`` ``Shard(1)``, norms replicated."""
    return _TP.get(".".join(name.split(".")[-2:]), _REPLICATE)


def _titan_name(hf: str, back: dict[str, tuple[str, str]], release: str) -> tuple[str | None, str]:
    """torchtitan ``release``'s name of in-memory HF tensor ``hf`` and its RoPE mark, or (None, "")."""
    top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "lm_head.weight" if release == "0.3" else "output.weight"}.get(hf)
    if top is not None:
        return top, ""
    match = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    found = back.get(match.group(2)) if match else None
    if match is None or found is None:
        return None, ""
    titan, rope = found
    if release == "0.3" and titan in ("attention.wq.weight", "attention.wk.weight", "attention.wv.weight"):
        titan = titan.replace("attention.", "attention.qkv_linear.")
    return f"layers.{match.group(1)}.{titan}", rope
