"""``split --to dcp``: every rank's chunks of every in-memory tensor on a device mesh, planned as targets.

The model's in-memory tensors are slices of the merge plan's on-disk ones (:func:`in_memory`: the family's rules
run backwards); :func:`ckpttool.commands.meshes.shard_tensors` places them on the mesh (tensor-parallel placements
from the family adapter), and every rank's box becomes
one target whose copies reach straight into the source's pieces (:func:`ckpttool.plan.compose.compose`), laid out
in the rank files torch's ``FileSystemWriter`` writes (:func:`ckpttool.writers.dcp.lay_out`). Reads no tensor data.

``names`` other than ``"hf"`` writes another framework's names (:data:`NAMES`): ``torchtitan`` (its newest release)
or ``torchtitan-0.2``, through :func:`ckpttool.families.conventions.torchtitan_back.to_torchtitan` (names, RoPE order,
torchtitan's tensor-parallel plan, Q/K/V saved whole in 0.3).
"""

from __future__ import annotations

import math
import re

from ckpttool.commands.meshes import REPLICATE, Mesh, Sharding, shard_tensors
from ckpttool.errors import ConfigError, CoverageError
from ckpttool.families import MemoryTensor, adapter_for, expert_tp, map_from_hf
from ckpttool.families.conventions import torchtitan_back
from ckpttool.families.mtp import expected as mtp_expected
from ckpttool.io.dtypes import itemsize
from ckpttool.layout.layout import Box
from ckpttool.layout.placements import Placement
from ckpttool.model.description import ModelInfo
from ckpttool.plan.compose import compose
from ckpttool.plan.plan import Target
from ckpttool.families.source import Planned
from ckpttool.writers import dcp

#: in-memory tensors transformers registers as persistent buffers, not parameters (the MoE routers' expert bias of
#: DeepSeek-V3 and Nemotron-H): FSDP2's ``fully_shard`` shards parameters only, so every rank holds such a tensor
#: whole and DCP saves it as one chunk
BUFFERS = re.compile(r"\.e_score_correction_bias$")

#: the names ``split --to dcp`` writes: transformers' in-memory ones, or torchtitan's (newest release, or 0.2's)
NAMES = ("hf", "torchtitan", "torchtitan-0.2")


def in_memory(prepared: Planned) -> list[MemoryTensor]:
    """The model's in-memory tensors as slices of the plan's on-disk ones (what every target format starts from).

    Raises:
        ConfigError: no config transformers builds a causal LM from.
    """
    return map_from_hf(model_of(prepared))


def model_of(prepared: Planned) -> ModelInfo:
    """The model the source's config describes; split needs one.

    Raises:
        ConfigError: no config transformers builds a causal LM from.
    """
    if prepared.model is None:
        why = ("none was found in or next to the source" if prepared.config is None else
               f"transformers has no causal LM for model_type {prepared.config.get('model_type')!r} of '{prepared.config_path}'")
        raise ConfigError(
            f"'{prepared.layout.root}': split needs the model's config.json, as transformers builds it: it names the "
            f"tensors as the parallelized model holds them in memory ({why}); give config='PATH'"
        )
    return prepared.model


def _left_out(prepared: Planned, memory: list[MemoryTensor]) -> list[str]:
    """A note naming the source's tensors that no in-memory tensor of ``memory`` reads, which ``split --to dcp`` in
    transformers' names therefore leaves out (a DCP of transformers' model holds none of them): above all the MTP
    layers of a DeepSeek-V3 release, which transformers' causal LM does not build. Empty when every tensor is read."""
    read = {sl.source for m in memory for sl in m.slices}
    unread = [t.name for t in prepared.plan.targets if t.name not in read]
    if not unread:
        return []
    info = model_of(prepared)
    shown = ", ".join(f"'{n}'" for n in unread[:3]) + (f" and {len(unread) - 3} more" if len(unread) > 3 else "")
    mtp = [n for layer in mtp_expected(info).values() for n in layer if n in unread]
    return [f"{len(unread)} source tensor{'s' if len(unread) != 1 else ''} left out: transformers' {info.model_type} "
            f"model holds no such tensor in memory, so its DCP has none ({shown})"
            + ("; its MTP layers are kept by --to megatron (and, for DeepSeek-V3, --names torchtitan)" if mtp else "")]


def plan_dcp(prepared: Planned, mesh: Mesh, names: str = "hf",
             ) -> tuple[list[Sharding], tuple[dcp.DcpFile, ...], tuple[str, ...]]:
    """Every rank's chunks of every in-memory tensor, each a target proven to tile its box, laid out in the rank
    files torch's ``FileSystemWriter`` would write (a replicated chunk once), and the notes for the summary (what
    writing torchtitan's names did, or what of the source transformers' names leave out). Reads no tensor data.

    ``names``: one of :data:`NAMES`; ``"torchtitan"`` writes torchtitan's names, RoPE order and placements.

    Raises:
        ConfigError: no config, or a tensor the mesh cannot place, or a model torchtitan's names do not fit;
            CoverageError: a chunk not covered exactly once.
    """
    memory = in_memory(prepared)
    notes = _left_out(prepared, memory) if names == "hf" else []
    # stacked experts cut where transformers' own plan cuts them (its distributed save's chunks), for every family
    placement = expert_tp.with_plan_experts(adapter_for(model_of(prepared)).tp_placement, model_of(prepared).model_type)
    zeros = frozenset()
    whole = frozenset(m.name for m in memory if BUFFERS.search(m.name))
    experts_on: Placement | None = None  # torchtitan's FSDP placement of stacked experts, where not ckpttool's
    if names != "hf":
        written = torchtitan_back.to_torchtitan(memory, model_of(prepared), torchtitan_back.release_of(names),
                                                on_disk=[t.name for t in prepared.plan.targets])
        experts_on = torchtitan_back.check_mesh(written, torchtitan_back.release_of(names), fsdp=mesh.fsdp,
                                                tp=mesh.tp, ep=mesh.ep, dp=mesh.dp)
        memory, placement = written.tensors, torchtitan_back.tp_placement
        whole, zeros, notes = written.whole, written.zeros, list(written.notes)
    _check_degrees(memory, mesh)
    shardings = shard_tensors(((m.name, m.shape, m.stacked) for m in memory), mesh, placement)
    if experts_on is not None:  # torchtitan's FSDP cuts each expert along dim 1 instead
        stacked = {m.name for m in memory if m.stacked}
        shardings = [_on_expert_fsdp(s, experts_on) if s.name in stacked else s for s in shardings]
    # saved whole on one rank whatever the mesh (torchtitan 0.3 splits its fused wqkv into whole tensors on save)
    shardings = [Sharding(s.name, s.shape, s.dims, tuple(REPLICATE for _ in s.dims)) if s.name in whole else s
                 for s in shardings]
    slices = {m.name: m.slices for m in memory}
    transforms = {m.name: m.transform for m in memory if m.transform is not None}
    targets = {t.name: t for t in prepared.plan.targets}
    # a chunk weighs its whole tensor's bytes when ranks share replicated chunks out (torch's tensor_storage_size)
    weight = {m.name: math.prod(m.shape) * next((itemsize(targets[sl.source].dtype) for sl in m.slices
                                                 if sl.source in targets), 1) for m in memory}
    held = [[(s.name, box, weight[s.name]) for s in shardings for box in _boxes(s, rank, mesh.world)]
            for rank in range(mesh.world)]
    by_name = {s.name: s for s in shardings}
    per_rank, problems = [], []
    for chunks_written in dcp.share_items(held):
        items = []
        for name, box in chunks_written:
            if name in zeros:  # made of no source tensor: a target of no copy, which the executor writes as zeros
                items.append((name, by_name[name].shape, box, Target(name, box.sizes, "F32", "F32", (), ())))
                continue
            target, found = compose(name, box, slices[name], targets, transforms.get(name), by_name[name].shape)
            problems.extend(p for p in found if p not in problems)
            if target is not None:
                items.append((name, by_name[name].shape, box, target))
        per_rank.append(items)
    if problems:
        raise CoverageError(problems)
    return shardings, dcp.lay_out(per_rank), tuple(notes)


def _on_expert_fsdp(sharding: Sharding, placement: Placement) -> Sharding:
    """``sharding`` with ``placement`` on its (expert) FSDP dim, ``fsdp`` or ``efsdp``: a ``_StridedShard`` of it
    when a later mesh dim (tensor parallel) shards the same tensor dim, as FSDP2's ``fully_shard`` places a
    parameter already cut by TP (its split factor: those dims' ranks)."""
    placements = list(sharding.placements)
    for i, ((name, n), p) in enumerate(zip(sharding.dims, sharding.placements)):
        if name in ("fsdp", "efsdp") and n > 1:
            later = math.prod(m for (_, m), q in zip(sharding.dims[i + 1:], sharding.placements[i + 1:])
                              if q.kind in ("shard", "strided") and q.dim == placement.dim)
            placements[i] = Placement("strided", placement.dim, later) if later > 1 else placement
    return Sharding(sharding.name, sharding.shape, sharding.dims, tuple(placements))


def _check_degrees(memory: list[MemoryTensor], mesh: Mesh) -> None:
    """Bound the ranks of a replica by the model before the per-rank work, which grows with them, starts: ``fsdp``
    and ``tp`` cut dims 0 and 1, so ``fsdp x tp`` more than the largest of those dims leaves ranks with only empty
    shards of the tensors they shard.

    Raises:
        ConfigError: naming the options, the largest dim, its tensor and so the bound.
    """
    most, tensor = max(((m.shape[d], m.name) for m in memory for d in range(min(2, len(m.shape)))), default=(1, None))
    if mesh.replica > most:
        where = f"{most}, of '{tensor}'" if tensor is not None else "1: no tensor has a dim to cut"
        raise ConfigError(f"the mesh {mesh.describe()} does not fit the model: fsdp x tp = {mesh.replica} ranks cut "
                          f"each tensor, more than the largest tensor dim they cut ({where}); give fsdp x tp at most {most}")


def _boxes(sharding: Sharding, rank: int, world: int) -> list[Box]:
    """The chunks ``rank`` saves of a tensor: an empty shard as torch saves it (size 0 where DTensor puts it);
    rank 0 saves a tensor every rank holds nothing of whole, so the metadata still names it."""
    boxes = sharding.boxes(rank)
    empty = sharding.empty_box(rank) if not boxes else None
    if empty is not None:
        return [empty]
    if not boxes and rank == 0 and all(not sharding.boxes(r) for r in range(1, world)):
        return [Box.whole(sharding.shape)]
    return boxes
