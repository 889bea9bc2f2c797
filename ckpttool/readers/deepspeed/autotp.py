"""DeepSpeed AutoTP checkpoints (``tensor_parallel.autotp_size`` > 1, tensor parallelism without Megatron): each
tensor-parallel rank's shards placed in the global tensors by the split DeepSpeed recorded for every parameter.

How AutoTP cuts a model (DeepSpeed 0.19.8: ``runtime/engine.py`` ``_apply_autotp_partitioning``,
``module_inject/auto_tp.py`` ``AutoTP._replace`` and ``_replace_with_config``, ``module_inject/layers.py``):

- which layers: ``tensor_parallel.partition_config`` / ``preset_model`` when given, else the model's HF ``tp_plan``
  (``runtime/tensor_parallel/config.py`` ``_get_hf_tp_plan``, ``module_inject/tp_plan_converter.py``: ``colwise*``
  column, ``rowwise`` row, ``embedding_rowwise`` and ``replicated_with_grad_allreduce`` left whole), else the name
  heuristic of ``AutoTP.tp_parser`` / ``_replace`` (``o_proj``, ``down_proj``, ``out_proj``, ``dense_4h_to_h``...
  row; other ``nn.Linear`` column; ``lm_head`` column when training);
- column-parallel (``LinearLayer``, ``VocabParallelLinear``, ``VocabParallelEmbedding``): weight and bias cut on
  dim 0; row-parallel (``LinearAllreduce``, ``HiddenParallelEmbedding``): weight cut on dim 1, bias whole; fused
  layers (``SubParamLinearLayer``, ``fused_LinearLayer``, ``GateUpPack_LinearLayer``): every sub-parameter cut, a
  rank's slices concatenated; what AutoTP does not replace (norms, an untied embedding, buffers) is whole on every
  rank. A Llama with its HF plan: q/k/v/gate/up/``lm_head`` dim 0, o/down dim 1, embedding and norms whole;
- an uneven dim (``module_inject/tp_shard.py`` ``get_shard_size_list``): by key/value heads when the size is a
  multiple of them and the name is not an MLP/MoE projection or ``lm_head`` (rank r gets ``kv_heads // tp + (r <
  kv_heads % tp)`` heads' worth), else by ``tp_grain_size`` grains (the first ``grains % tp`` ranks one more, the
  last rank the remainder); rank r holds the r-th contiguous block (``torch.split``).

That outcome is on disk: every ``mp_rank_XX_model_states.pt`` holds ``universal_checkpoint_info``
(``layers.collect_autotp_universal_checkpoint_info``) keyed by the pattern ``^<escaped name>$`` of each parameter:
an ``affine_map`` (``checkpoint/affine.py``: each rank's shard shape and the blocks of the global tensor it holds)
and the category lists ``ds_to_universal`` falls back to (``parameter_with_row_parallelism_patterns``: dim 1;
``tp_replicated_parameter_patterns``: whole; ``parameter_with_sub_params``; ``autotp_unsupported_parameter_patterns``;
any other parameter dim 0), while each rank's ``param_shapes`` give its shard shapes. This module reads that record
as ``checkpoint/ds_to_universal.py`` ``_merge_tp_slice_files`` does and never re-derives a split from names: a map's
blocks become boxes; without a map, the category with the sizes the ranks record; patterns are looked up as the
exact strings AutoTP writes (no regex from a checkpoint is compiled). A parameter whose split is not recorded (listed
unsupported, fused without a map, a map that is not plain boxes, shapes that contradict the record) is refused,
naming it and the file. Buffers (never cut) are whole on every rank; a shared parameter takes its owner's split; a
replicated block is read from the first rank holding it. Each rank's shards are read as any ZeRO-1/2 step
(:mod:`.zero`) or module state dict, into a layout in the shard's coordinates whose pieces are then moved,
so a missing rank file leaves its region of the global tensor uncovered and named.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.io.dtypes import itemsize
from ckpttool.layout.layout import RAW, Box, Layout, Piece, Shape, c_strides
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.readers.validate import dims, expect, field, integer
from ckpttool.readers.deepspeed.files import Scan, Loaded, listed_names, step_rel, load_states
from ckpttool.readers.deepspeed.pieces import add_module, SharingBuilder
from ckpttool.readers.deepspeed.universal import way_out
from ckpttool.readers.deepspeed.zero import read_zero12

_UC = "universal_checkpoint_info"
_MAPS = "affine_map"
_UNSUPPORTED = "autotp_unsupported_parameter_patterns"
_ROW = "parameter_with_row_parallelism_patterns"
_REPLICATED = "tp_replicated_parameter_patterns"
_SUB_PARAMS = "parameter_with_sub_params"
#: the affine map encoding this module reads (``affine.AFFINE_MAP_FORMAT_VERSION``)
_MAP_VERSION = 1


def recorded_tp(state: Loaded) -> int:
    """The tensor-parallel size a model states file records (``checkpoint_parallel_dimensions.tp_degree``), 1 if
    none."""
    recorded = field(state.obj, "checkpoint_parallel_dimensions", dict, state.rel, default=None) or {}
    return field(recorded, "tp_degree", lambda v, w, f: integer(v, w, f, minimum=1), state.rel,
                 what="checkpoint_parallel_dimensions.tp_degree", default=1)


def is_autotp(state: Loaded) -> bool:
    """Whether a model states file was saved by AutoTP: its ``ds_config`` sets ``tensor_parallel.autotp_size`` > 1,
    or its ``universal_checkpoint_info`` has what only AutoTP writes (Megatron-DeepSpeed's has neither)."""
    config = state.obj.get("ds_config")
    section = config.get("tensor_parallel") if isinstance(config, dict) else None
    size = section.get("autotp_size") if isinstance(section, dict) else None
    uc = state.obj.get(_UC)
    return (type(size) is int and size > 1) or (isinstance(uc, dict) and (_UNSUPPORTED in uc or _MAPS in uc))


@dataclass(frozen=True, slots=True)
class _Block:
    """A box of a rank's shard (shard coordinates) and where its first element lies in the global tensor."""

    shard: Box
    at: Shape


@dataclass(frozen=True, slots=True)
class _Split:
    """A parameter's global shape and, per tensor-parallel rank, the blocks of its shard to place."""

    shape: Shape
    blocks: Mapping[int, tuple[_Block, ...]]
    how: str


def read_autotp(root: Path, step: Path, tag: str, models: list[tuple[int, str]], optims: list[tuple[int, int, str, str]],
                first: Loaded, builder: LayoutBuilder, *, weights: str, scan: Scan) -> None:
    """Every tensor-parallel rank of an AutoTP step, read per rank and placed in the global tensors.

    Raises:
        SourceNotFoundError: a rank's model states (or all its optimizer files) are missing.
        SourceError: a parameter whose split the checkpoint does not record, or shards that contradict it.
    """
    recorded, names = recorded_tp(first), dict(models)
    tp = max(recorded, max(names) + 1)
    if recorded > 1 and tp > recorded:
        raise SourceError(f"'{step_rel(tag, names[max(names)])}': tensor-parallel rank {max(names)}, but '{first.rel}' "
                          f"records {recorded} ranks (checkpoint_parallel_dimensions.tp_degree). Is it a mix of two "
                          "checkpoints?")
    for rank in range(tp):
        if rank not in names:
            raise SourceNotFoundError(
                f"'{step_rel(tag, f'mp_rank_{rank:02d}_model_states.pt')}': missing: tensor-parallel rank {rank} of the "
                f"{tp} AutoTP ranks '{first.rel}' records (checkpoint_parallel_dimensions.tp_degree); its shards "
                "cannot be placed without it. Is the checkpoint complete?")
    if weights == "master" and not optims:
        raise SourceError(f"'{step_rel(tag, '')}': no *_optim_states.pt files, so no fp32 master weights; pass "
                          "weights='module' to take the module's weights")
    shards: dict[int, tuple[Loaded, Layout]] = {}
    for rank in range(tp):
        state = first if step_rel(tag, names[rank]) == first.rel else load_states(root, step_rel(tag, names[rank]), scan=scan)
        local = SharingBuilder(builder.root, builder.format)
        if weights == "module":
            add_module(state, local, names=None, why="module weights")
            local.note(f"module weights (each rank's shard of them) from the {tp} mp_rank_XX_model_states.pt files")
        else:
            group = [o for o in optims if o[0] == rank]
            if not group:
                raise SourceNotFoundError(
                    f"'{step_rel(tag, f'*zero_pp_rank_*_mp_rank_{rank:02d}_optim_states.pt')}': missing (the fp32 "
                    f"master weights of tensor-parallel rank {rank}, held by no file)")
            read_zero12(root, step, tag, state, group, local, strip_layer=False, scan=scan)
        shards[rank] = (state, local.build())
    _place_all(shards, first, builder, step)
    for note in shards[0][1].notes:
        builder.note(note)
    builder.set_parallel(tp=tp, pp=1, dp=shards[0][1].parallel.get("dp", 1))


def _place_all(shards: Mapping[int, tuple[Loaded, Layout]], first: Loaded, builder: LayoutBuilder,
               step: Path) -> None:
    record = _Record(first, step)
    shared = {alias: owner for alias, owner in (field(first.obj, "shared_params", dict, first.rel, default=None)
                                                or {}).items() if isinstance(owner, str)}
    order = dict.fromkeys(name for _, layout in shards.values() for name in layout.tensors)
    counts: dict[str, int] = {}
    for name in order:
        held = {rank: layout.tensors[name] for rank, (_, layout) in shards.items() if name in layout.tensors}
        lacking = sorted(set(shards) - set(held))
        if lacking:
            raise SourceError(f"'{name}': in '{shards[min(held)][0].rel}' but not in "
                              f"'{shards[lacking[0]][0].rel}': the tensor-parallel ranks hold different parameters")
        split = record.split(shared.get(name, name), {r: (t.global_shape, shards[r][0].rel) for r, t in held.items()})
        counts[split.how] = counts.get(split.how, 0) + 1
        dtype = held[0].dtype
        if not builder.declare(name, split.shape, dtype, where=f"'{first.rel}' {_UC}"):
            continue
        for rank, (_, layout) in shards.items():
            for piece in layout.tensors[name].pieces:
                for placed in _placed(piece, split.blocks[rank], rank):
                    builder.add(name, placed)
            for piece in layout.absent.get(name, ()):
                for placed in _placed(piece, split.blocks[rank], rank):
                    builder.add(name, placed, present=False)
    listed = ", ".join(f"{n} {how}" for how, n in counts.items())
    builder.note(f"AutoTP over {len(shards)} tensor-parallel ranks, each tensor placed by the split DeepSpeed "
                 f"recorded ({_UC} in '{first.rel}'): {listed}")


class _Record:
    """What rank 0's model states record about the splits: affine maps, category lists, buffer names."""

    def __init__(self, state: Loaded, step: Path) -> None:
        self.rel = state.rel
        uc = field(state.obj, _UC, dict, state.rel, default=None) or {}
        if _UNSUPPORTED not in uc and _MAPS not in uc:  # "any other parameter: dim 0" holds only for AutoTP's record
            raise SourceError(f"'{state.rel}': saved with AutoTP (tensor_parallel.autotp_size), but without the {_UC} "
                              "AutoTP writes (an older DeepSpeed): these files do not record how each tensor is split; "
                              f"{way_out(step)}")
        maps = field(uc, _MAPS, dict, state.rel, what=f"{_UC}.{_MAPS}", default=None) or {}
        version = field(maps, "version", lambda v, w, f: integer(v, w, f, minimum=1), state.rel,
                        what=f"{_UC}.{_MAPS}.version", default=_MAP_VERSION)
        if version > _MAP_VERSION:
            raise SourceError(f"'{state.rel}': {_UC} records affine maps of format version {version}; ckpttool "
                              f"reads version {_MAP_VERSION}. Is ckpttool older than the DeepSpeed that saved it?")
        self.maps = field(maps, "params", dict, state.rel, what=f"{_UC}.{_MAPS}.params", default=None) or {}
        self.unsupported = field(uc, _UNSUPPORTED, dict, state.rel, what=f"{_UC}.{_UNSUPPORTED}", default=None) or {}
        self.row = set(self._strings(uc, _ROW))
        self.replicated = set(self._strings(uc, _REPLICATED))
        sub = field(uc, _SUB_PARAMS, list, state.rel, what=f"{_UC}.{_SUB_PARAMS}", default=None) or []
        self.fused = {p for entry in sub if isinstance(entry, dict) and isinstance(entry.get("patterns"), list)
                      for p in entry["patterns"] if isinstance(p, str)}
        self.buffers = listed_names(state, "buffer_names")

    def _strings(self, uc: dict, key: str) -> list[str]:
        values = field(uc, key, list, self.rel, what=f"{_UC}.{key}", default=None) or []
        return [expect(v, str, f"{_UC}.{key}: an entry", self.rel) for v in values]

    def split(self, name: str, shapes: Mapping[int, tuple[Shape, str]]) -> _Split:
        """How ``name`` is cut, from its affine map, else its category; ``shapes``: each rank's shard shape and
        file."""
        pattern = f"^{re.escape(name)}$"  # as collect_autotp_universal_checkpoint_info writes it
        where = f"'{name}' ({_UC} in '{self.rel}')"
        if pattern in self.unsupported:  # ds_to_universal refuses the whole step then; here the tensor is named
            raise SourceError(f"{where}: DeepSpeed recorded that AutoTP's split of this tensor cannot be converted: "
                              f"{str(self.unsupported[pattern])[:200]}")
        if pattern in self.maps:
            return _from_map(name, expect(self.maps[pattern], dict, f"{_UC}.{_MAPS} of '{name}'", self.rel),
                             shapes, self.rel)
        if name in self.buffers or pattern in self.replicated:
            return _whole(name, shapes)
        if pattern in self.fused:
            raise SourceError(f"{where}: fused sub-parameters with no affine map: the cut of each sub-parameter is "
                              "not recorded")
        return _concatenated(name, shapes, 1 if pattern in self.row else 0, where)


def _whole(name: str, shapes: Mapping[int, tuple[Shape, str]]) -> _Split:
    """Replicated: every rank holds the whole tensor; read from the first."""
    distinct = {shape for shape, _ in shapes.values()}
    if len(distinct) > 1:
        listed = ", ".join(f"{list(s)} in '{rel}'" for s, rel in shapes.values())
        raise SourceError(f"'{name}': recorded as whole on every tensor-parallel rank, but the ranks hold {listed}")
    shape = distinct.pop()
    first = min(shapes)
    return _Split(shape, {r: ((_Block(Box.whole(shape), (0,) * len(shape)),) if r == first else ())
                          for r in shapes}, "whole on every rank")


def _concatenated(name: str, shapes: Mapping[int, tuple[Shape, str]], dim: int, where: str) -> _Split:
    """The ranks' shards end to end along ``dim``, in rank order (torch.split's blocks)."""
    ranks = sorted(shapes)
    base = shapes[ranks[0]][0]
    for rank in ranks:
        shape, rel = shapes[rank]
        if len(shape) <= dim or len(shape) != len(base) or any(
                a != b for d, (a, b) in enumerate(zip(shape, base)) if d != dim):
            raise SourceError(f"{where}: recorded as cut on dim {dim}, but tensor-parallel rank {rank} holds "
                              f"{list(shape)} in '{rel}' and rank {ranks[0]} {list(base)} in '{shapes[ranks[0]][1]}'")
    blocks, start = {}, 0
    for rank in ranks:
        shape = shapes[rank][0]
        blocks[rank] = (_Block(Box.whole(shape), tuple(start if d == dim else 0 for d in range(len(shape)))),)
        start += shape[dim]
    total = tuple(start if d == dim else n for d, n in enumerate(base))
    return _Split(total, blocks, f"cut on dim {dim} (recorded category)")


def _from_map(name: str, entry: dict, shapes: Mapping[int, tuple[Shape, str]], rel: str) -> _Split:
    """The blocks of an affine map (``checkpoint/affine.py`` ``ParamAffineMap.to_dict``): each piece is a box of
    the global tensor and a box of the shard, both in C order."""
    what = f"{_UC}.{_MAPS} of '{name}'"
    shape = field(entry, "logical_shape", dims, rel, what=f"{what}: logical_shape")
    ranks = field(entry, "ranks", dict, rel, what=f"{what}: ranks")
    if set(ranks) != set(shapes):
        raise SourceError(f"'{rel}': {what} describes tensor-parallel ranks {sorted(ranks, key=repr)}, the checkpoint "
                          f"has {sorted(shapes)}")
    blocks: dict[int, tuple[_Block, ...]] = {}
    for rank, value in ranks.items():
        own = field(value, "shard_shape", dims, rel, what=f"{what}: rank {rank} shard_shape")
        held, held_rel = shapes[rank]
        if own != held:
            raise SourceError(f"'{name}': tensor-parallel rank {rank} holds {list(held)} in '{held_rel}', but the "
                              f"affine map in '{rel}' gives it {list(own)}")
        pieces = field(value, "pieces", list, rel, what=f"{what}: rank {rank} pieces")
        found = [_map_block(name, p, shape, own, rank, rel) for p in pieces]
        blocks[rank] = tuple(b for b in found if b is not None)
    return _Split(shape, blocks, "placed by their affine map")


def _map_block(name: str, piece: Any, shape: Shape, shard: Shape, rank: int, rel: str) -> _Block | None:
    """One piece of an affine map as a block, when this rank is the first to hold it; else None."""
    what = f"{_UC}.{_MAPS} of '{name}': a piece of rank {rank}"
    piece = expect(piece, dict, what, rel)
    size = field(piece, "shape", dims, rel, what=f"{what}: shape")
    source = field(piece, "source", list, rel, what=f"{what}: source")
    dest = field(piece, "dest", list, rel, what=f"{what}: dest")
    holders = [integer(r, f"{what}: locations", rel) for r in field(piece, "locations", list, rel,
                                                                     what=f"{what}: locations")]
    scale = piece.get("scale", 1.0)
    if rank not in holders:
        raise SourceError(f"'{rel}': {what} is not held by rank {rank} (locations {holders})")
    if scale != 1.0 or len(source) != 2 or len(dest) != 2:
        raise SourceError(f"'{name}': the affine map in '{rel}' stores rank {rank}'s block scaled by {scale!r} or "
                          "in an unknown form; ckpttool copies boxes and does not rescale")
    start = _corner(source, shape, size)
    local = _corner(dest, shard, size)
    if start is None or local is None:
        raise SourceError(f"'{name}': the affine map in '{rel}' places a block of rank {rank} with strides, not as a "
                          f"box of the global tensor {list(shape)} and the shard {list(shard)}; ckpttool cannot "
                          "express that split")
    if math.prod(size) == 0 or min(holders) != rank:
        return None
    return _Block(Box(local, size), start)


def _corner(where: list, shape: Shape, size: Shape) -> Shape | None:
    """The offsets of a box ``size`` at storage ``(offset, strides)`` of a C-order tensor ``shape``; None when it
    is not such a box."""
    offset, strides = where
    if type(offset) is not int or not isinstance(strides, list) or tuple(strides) != c_strides(shape) or len(
            size) != len(shape):
        return None
    corner = []
    for stride, n in zip(c_strides(shape), shape):
        index, offset = (offset // stride, offset % stride) if stride else (0, offset)
        corner.append(index)
    box = Box(tuple(corner), size)
    return box.offsets if offset == 0 and box.inside(shape) else None


def _placed(piece: Piece, blocks: tuple[_Block, ...], rank: int) -> Iterator[Piece]:
    """A piece of a shard (its box in shard coordinates) as pieces of the global tensor."""
    size = itemsize(piece.dtype)
    tags = (*piece.tags, ("tp_rank", rank))
    for block in blocks:
        common = piece.box.intersect(block.shard)
        if common is None:
            continue
        for run, skip in _runs(piece.box, common):
            at = tuple(o - s + a for o, s, a in zip(run.offsets, block.shard.offsets, block.at))
            if piece.encoding != RAW and (skip or run != piece.box):
                raise SourceError(f"'{piece.key}' in {piece.where()}: a stored item cut across AutoTP blocks")
            yield Piece(piece.file, piece.key, Box(at, run.sizes), piece.dtype, piece.encoding,
                        piece.byte_offset + skip * size, run.numel * size, tags)


def _runs(outer: Box, inner: Box) -> Iterator[tuple[Box, int]]:
    """``inner`` (a box inside ``outer``) as boxes whose elements lie back to back in ``outer``'s C order, each
    with the number of elements of ``outer`` before it."""
    partial = [d for d, (a, b) in enumerate(zip(inner.sizes, outer.sizes)) if a != b]
    last = partial[-1] if partial else 0
    strides = c_strides(outer.sizes)
    heads = [range(inner.offsets[d], inner.offsets[d] + inner.sizes[d]) for d in range(last)]

    def walk(prefix: tuple[int, ...]) -> Iterator[tuple[Box, int]]:
        if len(prefix) == last:
            offsets = (*prefix, *inner.offsets[last:])
            sizes = (*(1 for _ in prefix), *inner.sizes[last:])
            skip = sum((o - b) * s for o, b, s in zip(offsets, outer.offsets, strides))
            yield Box(offsets, sizes), skip
            return
        for index in heads[len(prefix)]:
            yield from walk((*prefix, index))

    yield from [(outer, 0)] if inner == outer else walk(())
