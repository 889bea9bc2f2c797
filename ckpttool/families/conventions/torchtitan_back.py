"""The torchtitan convention the other way: a HuggingFace model written back in torchtitan's own names, for
``split --to dcp --names torchtitan`` (:func:`to_torchtitan`), so a torchtitan job resumes from it.

The model's in-memory tensors are renamed to the names of the torchtitan release named (:data:`RELEASES`: 0.3's
``attention.qkv_linear.wq`` and ``lm_head``, or 0.2's ``attention.wq`` and ``output``) by :mod:`.torchtitan`'s tables
read backwards, Q/K rows back to Meta's pairs (``rope_halves(head_dim).inverse()``, what torchtitan's ``from_hf``
does with ``_reverse_permute``), and placed as torchtitan's parallelize functions place them (:func:`tp_placement`;
0.3's Q/K/V saved whole, one chunk each, as its fused ``wqkv`` is split on save). transformers' fused experts are
stacked as torchtitan's MoE holds them, with the load-balancing bias it asks for written as zeros
(:func:`check_mesh` refuses a mesh on which torchtitan would place them otherwise).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.families.conventions import torchtitan_mla as mla
from ckpttool.families.conventions.torchtitan import EXPERT_BIAS, HALVES, LAYER, NAME, head_dim_of
from ckpttool.layout.placements import Placement
from ckpttool.model.description import ModelInfo
from ckpttool.plan.transforms import rope_halves

if TYPE_CHECKING:  # the families package imports this module: its MemoryTensor only annotates here
    from ckpttool.families import MemoryTensor

#: the torchtitan releases whose names a split writes (``--names torchtitan`` is the first, the newest)
RELEASES = ("0.3", "0.2")
#: the model types torchtitan builds that a split writes in its names (Llama 3 and Qwen3 dense)
FAMILIES = ("llama", "qwen3", "qwen3_moe", mla.FAMILY)
#: torchtitan's stacked experts by release, and its load-balancing bias
_STACKED = {"0.3": {w: f"routed_experts.inner_experts.{w}_{'EDF' if w == 'w2' else 'EFD'}" for w in ("w1", "w2", "w3")},
            "0.2": {w: f"experts.{w}" for w in ("w1", "w2", "w3")}}
_BIAS = {"0.3": "expert_bias_E", "0.2": "expert_bias"}
_SHARD0, _SHARD1, _REPLICATE = Placement("shard", 0), Placement("shard", 1), Placement("replicate")
_SHARD2 = Placement("shard", 2)
#: torchtitan's tensor-parallel plan (``parallelize_llama`` / ``parallelize_qwen3``, DeepSeek-V3's
#: ``set_deepseek_v3_sharding_config``), by the name's last two parts; MLA's low-rank ``wq_a``/``wkv_a``, norms and
#: the router replicated; the stacked experts without EP as its ``expert_param_layout`` (0.2's ``TensorParallel``)
_TP = {
    "tok_embeddings.weight": _SHARD0, "lm_head.weight": _SHARD0, "output.weight": _SHARD0,
    "wq.weight": _SHARD0, "wk.weight": _SHARD0, "wv.weight": _SHARD0, "wo.weight": _SHARD1,
    "wq_b.weight": _SHARD0, "wkv_b.weight": _SHARD0,
    "w1.weight": _SHARD0, "w3.weight": _SHARD0, "w2.weight": _SHARD1,
    "inner_experts.w1_EFD": _SHARD1, "inner_experts.w3_EFD": _SHARD1, "inner_experts.w2_EDF": _SHARD2,
    "experts.w1": _SHARD1, "experts.w3": _SHARD1, "experts.w2": _SHARD2,
}


@dataclass(frozen=True, slots=True)
class TorchtitanNames:
    """A model's in-memory tensors as torchtitan ``release`` saves them (:func:`to_torchtitan`).

    Attributes:
        tensors: every tensor under its torchtitan name, Q/K through the inverse RoPE permutation.
        whole: names saved whole, one chunk on one rank, whatever the mesh (0.3's Q, K and V, the MoE's
            ``expert_bias_E``).
        zeros: names written as zeros, made of no HF tensor (the MoE's load-balancing ``expert_bias_E``, float32:
            HF's model has none; torchtitan's loader asks for it).
        notes: what was done, for the user.
    """

    tensors: list[MemoryTensor]
    whole: frozenset[str]
    notes: list[str]
    zeros: frozenset[str] = frozenset()


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


def to_torchtitan(memory: Sequence[MemoryTensor], info: ModelInfo, release: str = RELEASES[0],
                  on_disk: Collection[str] = ()) -> TorchtitanNames:
    """The in-memory tensors of a transformers model (``memory``: HF names, slices of the on-disk tensors) as
    torchtitan ``release``'s model saves them: torchtitan's names, Q/K rows from HF's RoPE halves back to Meta's
    pairs (none for Qwen3), a tied head kept as torchtitan's state dict holds it. DeepSeek-V3's MTP layers that
    the on-disk tensors (``on_disk``: their names) hold are written as torchtitan's ``mtp_layers.K``
    (:func:`.torchtitan_mla.mtp_memory`).

    Raises:
        ConfigError: a model type torchtitan has no model of here (:data:`FAMILIES`), or tensors with no torchtitan
            name (all listed), or a head_dim the rows cannot be permuted by.
    """
    if info.model_type not in FAMILIES:
        raise ConfigError(
            f"names='torchtitan': torchtitan {release} has no {info.model_type} model ckpttool writes its names for "
            f"(it writes {', '.join(FAMILIES)}: Llama 3, Qwen3, Qwen3-MoE and DeepSeek-V3); split without --names, or "
            "merge to another "
            "family first")
    head_dim, problem = head_dim_of(info)
    deepseek = mla.applies(info)
    permute = info.model_type not in HALVES and not deepseek
    if deepseek and (problem := mla.rope_problem(info)):
        raise ConfigError(f"names='torchtitan': the {info.model_type} model's {problem}; nothing was written")
    table = {**mla.layer_table(LAYER, info), **(mla.MTP_PARTS if deepseek else {})}
    back = {hf: (titan, rope) for titan, (hf, rope) in table.items()}
    mtp_layers, mtp_tensors = mla.mtp_memory(memory, info, on_disk)
    if mtp_layers and release != RELEASES[0]:  # 0.3 added mtp_layers; 0.2's DeepSeek-V3 builds none
        raise ConfigError(f"'model.layers.{mtp_layers[0]}': an MTP layer (num_nextn_predict_layers), which torchtitan "
                          f"{release}'s DeepSeek-V3 does not have (torchtitan {RELEASES[0]} added mtp_layers); write "
                          f"its names (names='torchtitan'); nothing was written")
    tensors, unnamed, whole, permuted = [], [], set(), 0
    zeros: list[str] = []
    for tensor in [*memory, *mtp_tensors]:
        experts = _stacked_back(tensor, release)
        if experts:
            tensors.extend(replace(e, name=mla.mtp_titan_name(e.name, info)) for e in experts)
            if tensor.name.endswith(".down_proj") and not deepseek:  # a load-balancing bias per MoE layer, zeros
                bias = re.sub(r"^model\.layers\.(\d+)\..*$", rf"layers.\1.moe.{_BIAS[release]}", tensor.name)
                tensors.append(replace(tensor, name=bias, shape=tensor.shape[:1], slices=(), stacked=False))
                zeros.append(bias)
                whole.add(bias)
            continue
        name, rope = _titan_name(tensor.name, back, release, qkv_linear=not deepseek)
        if name is None:
            unnamed.append(tensor.name)
            continue
        transform = None
        if rope and permute:
            if problem:
                raise ConfigError(f"'{tensor.name}': {problem}")
            transform, permuted = rope_halves(head_dim).inverse(), permuted + 1
        whole_tensor = (release == "0.3" and ".qkv_linear." in name) or EXPERT_BIAS.match(name)
        name = mla.mtp_titan_name(name, info)
        if whole_tensor:
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
    notes += [f"MTP layer model.layers.{n} written as torchtitan's {mla.mtp_titan_name(f'layers.{n}.weight', info).removesuffix('.weight')} "
              "(not its copies of the embedding and head, embed_tokens and shared_head.head: torchtitan's MTP layers "
              "share the main model's)" for n in mtp_layers]
    if zeros:
        notes.append(f"wrote {len(zeros)} MoE load-balancing {_BIAS[release]} tensors as zeros (float32; HF's "
                     f"{info.model_type} has none): torchtitan's loader asks for them, and training updates them")
    return TorchtitanNames(tensors, frozenset(whole), notes, frozenset(zeros))


def _stacked_back(tensor: MemoryTensor, release: str) -> list[MemoryTensor]:
    """transformers' fused in-memory experts as torchtitan ``release`` stacks them: ``gate_up_proj`` ``[E, 2 ffn,
    dim]`` is ``w1_EFD`` (its gate rows) and ``w3_EFD`` (its up rows), ``down_proj`` ``[E, dim, ffn]`` is
    ``w2_EDF``; 0.2 names them ``moe.experts.w1``/``w3``/``w2``. Empty for any other tensor.

    Raises:
        ConfigError: a slice of ``gate_up_proj`` straddles the gate and up halves.
    """
    match = re.match(r"^model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", tensor.name)
    if match is None or len(tensor.shape) != 3:
        return []
    layer, fused = match.groups()
    names = _STACKED[release]
    if fused == "down_proj":
        return [replace(tensor, name=f"layers.{layer}.moe.{names['w2']}")]
    half = tensor.shape[1] // 2
    parts: dict[str, list] = {"w1": [], "w3": []}
    for sl in tensor.slices:
        start, size = sl.dst.offsets[1], sl.dst.sizes[1]
        if start < half < start + size or tensor.shape[1] % 2:
            raise ConfigError(f"'{tensor.name}': a slice of rows {start}..{start + size} straddles its gate and up "
                              f"halves ({half} rows each); torchtitan stacks them apart")
        part, shift = ("w1", 0) if start < half else ("w3", half)
        dst = type(sl.dst)((sl.dst.offsets[0], start - shift, *sl.dst.offsets[2:]), sl.dst.sizes)
        parts[part].append(replace(sl, dst=dst))
    shape = (tensor.shape[0], half, *tensor.shape[2:])
    return [replace(tensor, name=f"layers.{layer}.moe.{names[w]}", shape=shape, slices=tuple(parts[w]))
            for w in ("w1", "w3")]


def tp_placement(name: str) -> Placement:
    """The tensor-parallel placement torchtitan's plan gives torchtitan tensor ``name``: embeddings and head
    ``Shard(0)`` (``RowwiseParallel`` embedding, ``ColwiseParallel`` head), ``wq``/``wk``/``wv``/``w1``/``w3``
    ``Shard(0)``, ``wo``/``w2`` ``Shard(1)``, norms replicated."""
    return _TP.get(".".join(name.split(".")[-2:]), _REPLICATE)


def check_mesh(written: TorchtitanNames, release: str, *, fsdp: int, tp: int, ep: int,
               dp: int = 1) -> Placement | None:
    """How torchtitan ``release`` places the stacked experts of ``written`` on its expert FSDP dim, where it differs
    from ckpttool's default (experts ``Shard(0)`` over FSDP, over ``(efsdp, ep)`` with EP): ``Shard(1)`` when its
    expert FSDP size exceeds the number of experts, as 0.3's ``apply_fsdp_to_decoder`` does (each expert cut along
    dim 1 instead of padding dim 0); None otherwise. That size is ``efsdp x ep`` (= ``fsdp x tp``) with EP, else
    the whole FSDP mesh's, ``dp x fsdp`` (HSDP's replicas count: torchtitan takes ``mesh.size()`` of its
    ``(dp_replicate, fsdp)`` mesh), without TP. The caller makes it ``_StridedShard(1, tp)`` where tensor parallel
    cuts the same dim (torchtitan's ``w1``/``w3`` beside TP without EP), as FSDP2 does. 0.2's ``apply_fsdp`` cuts
    along dim 1 under EP only (``efsdp x ep`` above the experts), as 0.3 does there; without EP it leaves the experts
    to the block's FSDP, whose default ``Shard(0)`` holds even over more ranks than experts (empty shards): None.

    Raises:
        ConfigError: a mesh ckpttool does not write so (0.2's experts over TP within EP), naming the tensor, the
            mesh and what to choose instead.
    """
    stacked = next((t for t in written.tensors if t.stacked), None)
    if stacked is None:
        return None
    experts, size = stacked.shape[0], fsdp * tp if ep > 1 else dp * fsdp
    if release == "0.2" and ep > 1 and tp > 1:
        raise ConfigError(f"'{stacked.name}': torchtitan 0.2 shards experts over TP within EP (its ETP), a layout "
                          "ckpttool does not write; write 0.3's names, or choose tp=1 or ep=1; nothing was written")
    # 0.2.2's apply_fsdp passes a dim-1 shard_placement_fn only to the experts' own EP-mesh fully_shard; without EP
    # they stay Shard(0) (proven on its own save: fixtures/torchtitan_02_qwen3moe2_fsdp4, fsdp 4 over 2 experts)
    if size <= experts or (release == "0.2" and ep == 1):
        return None
    # proven on torchtitan 0.3's own saves: FSDP alone (fsdp 4, 2 experts), with EP (fsdp 4, ep 2), over HSDP
    # (dp 2 x fsdp 2, 2 experts) and beside TP without EP (fsdp 2 x tp 2, 1 expert); on 0.2.2's with EP (fsdp 4,
    # ep 2, 2 experts: fixtures/torchtitan_02_qwen3moe2_fsdp4ep2)
    return _SHARD1


def _titan_name(hf: str, back: dict[str, tuple[str, str]], release: str,
                qkv_linear: bool = True) -> tuple[str | None, str]:
    """torchtitan ``release``'s name of in-memory HF tensor ``hf`` and its RoPE mark, or (None, "");
    ``qkv_linear``: the model's Q/K/V sit in 0.3's ``QKVLinear`` (not DeepSeek-V3's MLA)."""
    top = {"model.embed_tokens.weight": "tok_embeddings.weight", "model.norm.weight": "norm.weight",
           "lm_head.weight": "lm_head.weight" if release == "0.3" else "output.weight"}.get(hf)
    if top is not None:
        return top, ""
    match = re.match(r"^model\.layers\.(\d+)\.(.+)$", hf)
    found = back.get(match.group(2)) if match else None
    if match is None or found is None:
        return None, ""
    titan, rope = found
    if qkv_linear and release == "0.3" and titan in ("attention.wq.weight", "attention.wk.weight",
                                                     "attention.wv.weight"):
        titan = titan.replace("attention.", "attention.qkv_linear.")
    titan = titan.replace("moe.expert_bias_E", f"moe.{_BIAS[release]}")
    return f"layers.{match.group(1)}.{titan}", rope
