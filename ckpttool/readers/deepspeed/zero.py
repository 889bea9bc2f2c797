"""ZeRO's flat fp32 partitions reassembled into parameters: the fp32 master weights of ZeRO-1/2, BF16_Optimizer
and ZeRO-3 checkpoints, cut into pieces at byte offsets inside the optimizer files.

Where the fp32 master weights are, per optimizer:

- ZeRO-1/2 (``zero_stage`` 1 or 2): ``single_partition_of_fp32_groups[g]`` is rank R's slice of group g's
  flat buffer. The flat buffer is the group's parameters in ``param_shapes`` order, each followed by
  ``param_alignment_paddings[g][i]`` elements, then padding up to an equal split; each rank saves its slice
  less the padding it holds (``group_paddings[g]``), so the slices laid end to end are exactly the
  parameters and their alignment paddings. A parameter may straddle two ranks.
- BF16_Optimizer (bf16 with ZeRO-1 and fp32 gradient accumulation; no ``zero_stage``): the same keys, but
  slices are saved whole, parameters are back to back, and ``group_paddings`` counts the padding at the end
  (non-zero on the last rank only).
- ZeRO-3 (``zero_stage`` 3): ``fp32_flat_groups`` of rank R, laid end to end, hold for every parameter in
  ``param_shapes`` order its elements ``R*p .. (R+1)*p`` with ``p = ceil(numel / world)`` (the last rank's
  share padded with zeros).

``partition_count`` records the data-parallel world size; it must equal the number of rank files. The flat
buffers must be consumed exactly; a missing rank file leaves its region uncovered, and the coverage check
names the file (the set of optimizer files is checked in :mod:`.files`). A flat range of a parameter
becomes RAW boxes at byte offsets inside the optimizer files (:func:`ckpttool.layout.layout.range_boxes`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.io.dtypes import itemsize
from ckpttool.layout.layout import RAW, Piece, range_boxes
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.io.torch_save import StoredTensor
from ckpttool.readers.validate import dims, expect, field, integer
from ckpttool.readers.deepspeed.files import (
    Loaded,
    Scan,
    listed_names,
    load_states,
    param_shapes,
    read_optim_ranks,
    step_rel,
)
from ckpttool.readers.deepspeed.pieces import add_module, add_shared, strip_layer_index, whole_piece

# ------------------------------------------------------------------------------------------------ flat buffers

def _flat_tensor(loaded: Loaded, value: Any, what: str) -> StoredTensor:
    if not isinstance(value, StoredTensor) or len(value.shape) != 1 or value.dtype != "F32":
        raise SourceError(f"'{loaded.rel}': {what} is not a flat fp32 tensor ({value!r:.80})")
    value.required_offset(loaded.rel, what)
    return value


class _Flat:
    """A rank's (or all ranks') flat fp32 slices laid end to end, to be cut into parameter pieces."""

    def __init__(self) -> None:
        #: (start in the flat buffer, numel, file, byte offset of element 0 in it, dp rank)
        self.slices: list[tuple[int, int, str, int, int]] = []

    def add(self, start: int, numel: int, rel: str, byte_offset: int, rank: int) -> None:
        self.slices.append((start, numel, rel, byte_offset, rank))

    def cut(self, builder: LayoutBuilder, name: str, shape: tuple[int, ...], at: int, first: int, stop: int,
            missing: set[str]) -> None:
        """Pieces for the parameter's elements ``first..stop``, which sit from ``at`` on in this buffer."""
        end = at + stop - first
        for start, numel, rel, base, rank in self.slices:
            a, b = max(at, start), min(end, start + numel)
            if a >= b:
                continue
            lo = first + a - at
            for box, k in range_boxes(shape, lo, lo + b - a):
                piece = Piece(rel, name, box, "F32", RAW, base + (a - start + k) * 4, box.numel * 4,
                              (("dp_rank", rank),))
                builder.add(name, piece, present=rel not in missing)


# ------------------------------------------------------------------------------------------------ ZeRO-1/2

def read_zero12(root: Path, step: Path, tag: str, state: Loaded, group: list[tuple[int, int, str, str]],
                 builder: LayoutBuilder, strip_layer: bool, *, scan: Scan) -> None:
    """Cut the flat fp32 partitions of ZeRO-1/2 (or BF16_Optimizer) optimizer files into pieces of the parameters
    in ``state``'s ``param_shapes``."""
    shapes = param_shapes(state)
    ranks, count, prefix, template = read_optim_ranks(root, tag, group, scan=scan)
    builder.set_parallel(dp=count)
    some = ranks[min(ranks)][1]
    bf16_optimizer = "zero_stage" not in some
    kind = "BF16_Optimizer" if bf16_optimizer else f"ZeRO-{some.get('zero_stage')}"
    note = f"fp32 master weights of a {kind} checkpoint over {count} data-parallel rank{'s' if count > 1 else ''}"
    builder.note(note)  # once, however many parameter groups tell it
    if not bf16_optimizer and some.get("zero_stage") not in (1, 2):
        raise SourceError(f"'{ranks[min(ranks)][0].rel}': zero_stage {some.get('zero_stage')!r} with "
                          "single_partition_of_fp32_groups; expected 1 or 2")
    # per rank and group: (saved slice, padding stripped from it before saving)
    slices: dict[int, list[tuple[StoredTensor, int]]] = {}
    for rank, (loaded, osd) in ranks.items():
        groups = osd.get("single_partition_of_fp32_groups")
        paddings = osd.get("group_paddings")
        if not isinstance(groups, list) or not isinstance(paddings, list) or len(groups) != len(paddings):
            raise SourceError(f"'{loaded.rel}': no single_partition_of_fp32_groups/group_paddings of equal length")
        if len(groups) != len(shapes):
            raise SourceError(
                f"'{loaded.rel}': {len(groups)} fp32 param groups, but '{state.rel}' records param_shapes for "
                f"{len(shapes)}"
            )
        slices[rank] = [
            (_flat_tensor(loaded, g, f"single_partition_of_fp32_groups[{i}]"),
             integer(p, f"group_paddings[{i}]", loaded.rel))
            for i, (g, p) in enumerate(zip(groups, paddings))
        ]
    for g, group_shapes in enumerate(shapes):
        pads = alignment_pads(some, g, group_shapes, ranks[min(ranks)][0].rel)
        parts = [FlatPart(rank, ranks[rank][0].rel, *slices[rank][g]) if rank in slices
                 else FlatPart(rank, step_rel(tag, template.format(rank=rank)), None, 0) for rank in range(count)]
        named = {(strip_layer_index(n) if strip_layer else n): s for n, s in group_shapes.items()}
        cut_group(builder, f"param group {g}", named, pads, parts, bf16_optimizer=bf16_optimizer, state=state,
                  files=f"'{prefix}zero_pp_rank_*' files")
    add_extras(state, builder, strip_layer)


def alignment_pads(osd: dict, g: int, group_shapes: dict[str, tuple[int, ...]], rel: str) -> list[int]:
    """``param_alignment_paddings[g]`` of an optimizer state (zeros when not recorded), one per parameter."""
    aligns = osd.get("param_alignment_paddings")
    pads = aligns[g] if isinstance(aligns, list) and g < len(aligns) else [0] * len(group_shapes)
    pads = dims(pads, f"param_alignment_paddings[{g}]", rel)
    if len(pads) != len(group_shapes):
        raise SourceError(f"'{rel}': param_alignment_paddings[{g}] has {len(pads)} entries "
                          f"for {len(group_shapes)} parameters")
    return pads


@dataclass(frozen=True, slots=True)
class FlatPart:
    """One partition of a param group's flat buffer: the rank that saved it, its file, the saved slice (None:
    the file is missing) and the padding stripped from it before saving (``group_paddings``)."""

    rank: int
    rel: str
    tensor: StoredTensor | None
    padding: int


def cut_group(builder: LayoutBuilder, label: str, group_shapes: dict[str, tuple[int, ...]], pads: list[int],
               parts: list[FlatPart], *, bf16_optimizer: bool, state: Loaded, files: str) -> None:
    """A ZeRO-1/2 (or BF16_Optimizer) param group's flat fp32 buffer, its ``parts`` laid end to end in
    partition order, cut into pieces of the parameters ``group_shapes`` (target names, in buffer order)."""
    needed = sum(math.prod(s) for s in group_shapes.values()) + sum(pads)
    # every partition's whole slice has the same length; a missing one's region follows from a present one
    full = {p.rel: p.tensor.numel + (0 if bf16_optimizer else p.padding) for p in parts if p.tensor is not None}
    if len(set(full.values())) > 1:
        listed = ", ".join(f"{n} in '{rel}'" for rel, n in full.items())
        raise SourceError(f"{label}: the ranks' fp32 partitions differ in size: {listed}")
    size = next(iter(full.values())) if full else -(-needed // len(parts))
    flat, missing, found = _Flat(), set(), 0
    for i, part in enumerate(parts):
        if part.tensor is not None:
            saved = part.tensor.numel - (part.padding if bf16_optimizer else 0)
            flat.add(i * size, max(saved, 0), part.rel, part.tensor.byte_offset() or 0, part.rank)
            found += part.tensor.numel
        else:  # its region: what a whole slice would hold of the parameters
            flat.add(i * size, max(0, min(size, needed - i * size)), part.rel, 0, part.rank)
            missing.add(part.rel)
    if not missing:
        trailing = parts[-1].padding if bf16_optimizer else 0
        if found - trailing != needed:
            what = "short" if found - trailing < needed else "longer than the parameters"
            raise SourceError(
                f"{label}: the flat fp32 buffers are {what}: the parameters in param_shapes of "
                f"'{state.rel}' need {needed} elements (with {sum(pads)} alignment padding), the {len(parts)} "
                f"{files} hold {found - trailing}" + (f" after {trailing} padding" if trailing else "")
            )
    offset = 0
    for (target, shape), pad in zip(group_shapes.items(), pads):
        numel = math.prod(shape)
        if builder.declare(target, shape, "F32", where=f"'{state.rel}' param_shapes"):
            flat.cut(builder, target, shape, offset, 0, numel, missing)
        offset += numel + int(pad)


def add_extras(state: Loaded, builder: LayoutBuilder, strip_layer: bool) -> None:
    """Buffers, frozen parameters (saved whole under ZeRO-1/2) and shared (tied) parameters."""
    buffers = listed_names(state, "buffer_names")
    if buffers:
        add_module(state, builder, names=buffers, why="buffers", strip_layer=strip_layer)
    frozen = field(state.obj, "frozen_param_fragments", dict, state.rel, default=None) or {}
    for key, tensor in frozen.items():
        if isinstance(tensor, StoredTensor):
            key = expect(key, str, "frozen_param_fragments: a parameter name", state.rel)
            name = strip_layer_index(key) if strip_layer else key
            if builder.declare(name, tensor.shape, tensor.dtype, where=f"'{state.rel}' frozen_param_fragments"):
                builder.add(name, whole_piece(state.rel, f"frozen_param_fragments.{key}", tensor))
    add_shared(state, builder)


# ------------------------------------------------------------------------------------------------ ZeRO-3

def read_zero3(root: Path, step: Path, tag: str, mp_rank: int, group: list[tuple[int, int, str, str]],
                models: list[tuple[int, int, str]], builder: LayoutBuilder, *, scan: Scan) -> None:
    """Cut ZeRO-3's flat fp32 partitions into pieces, the parameter names and shapes taken from rank 0's model states."""
    if not models or models[0][0] != 0:
        raise SourceNotFoundError(
            f"'{step_rel(tag, f'zero_pp_rank_0_mp_rank_{mp_rank:02d}_model_states.pt')}': missing (rank 0's model "
            "states hold the parameter names and shapes)"
        )
    state = load_states(root, step_rel(tag, models[0][2]), scan=scan)
    shapes = [s for g in param_shapes(state) for s in g.items()]
    ranks, count, _prefix, template = read_optim_ranks(root, tag, group, scan=scan)
    builder.set_parallel(dp=count)
    builder.note(f"fp32 master weights of a ZeRO-3 checkpoint over {count} data-parallel ranks")
    needed = sum(-(-math.prod(shape) // count) for _, shape in shapes)
    # each rank: its flat groups end to end
    flats: dict[int, _Flat] = {}
    missing: set[str] = set()
    for rank in range(count):
        flat = flats[rank] = _Flat()
        if rank not in ranks:
            rel = step_rel(tag, template.format(rank=rank))
            flat.add(0, needed, rel, 0, rank)
            missing.add(rel)
            continue
        loaded, osd = ranks[rank]
        if osd.get("zero_stage") != 3:
            raise SourceError(f"'{loaded.rel}': zero_stage {osd.get('zero_stage')!r}, but the model states are "
                              "ZeRO-3's (zero_pp_rank_*_model_states.pt)")
        groups = osd.get("fp32_flat_groups")
        if not isinstance(groups, list):
            raise SourceError(f"'{loaded.rel}': no fp32_flat_groups")
        start = 0
        for i, g in enumerate(groups):
            tensor = _flat_tensor(loaded, g, f"fp32_flat_groups[{i}]")
            flat.add(start, tensor.numel, loaded.rel, tensor.byte_offset() or 0, rank)
            start += tensor.numel
        if start != needed:
            what = "short" if start < needed else "longer than the parameters"
            raise SourceError(
                f"'{loaded.rel}': the flat fp32 buffer is {what}: the {len(shapes)} parameters in param_shapes "
                f"of '{state.rel}' need {needed} elements per rank (each padded to a multiple of {count}), "
                f"fp32_flat_groups hold {start}"
            )
    offset = 0
    for name, shape in shapes:
        numel = math.prod(shape)
        per_rank = -(-numel // count)
        if builder.declare(name, shape, "F32", where=f"'{state.rel}' param_shapes"):
            for rank in range(count):
                lo, hi = rank * per_rank, min((rank + 1) * per_rank, numel)
                if lo < hi:
                    flats[rank].cut(builder, name, shape, offset, lo, hi, missing)
        offset += per_rank
    _add_extras_zero3(root, tag, state, models, count, builder, scan=scan)


def _add_extras_zero3(root: Path, tag: str, state: Loaded, models: list[tuple[int, int, str]], count: int,
                      builder: LayoutBuilder, *, scan: Scan) -> None:
    """Buffers (whole, in rank 0's module) and frozen parameters (each rank's padded partition)."""
    buffers = listed_names(state, "buffer_names")
    if buffers:
        add_module(state, builder, names=buffers, why="buffers")
    frozen_shapes = field(state.obj, "frozen_param_shapes", dict, state.rel, default=None) or {}
    if frozen_shapes:
        per_rank_states = {rank: (load_states(root, step_rel(tag, name), scan=scan) if rank else state)
                           for rank, _, name in models}
        for name, shape in frozen_shapes.items():
            expect(name, str, "frozen_param_shapes: a parameter name", state.rel)
            shape = dims(shape, f"frozen_param_shapes: '{name}'", state.rel)
            numel = math.prod(shape)
            per_rank = -(-numel // count)
            first = None
            for rank in range(count):
                loaded = per_rank_states.get(rank)
                fragments = loaded and field(loaded.obj, "frozen_param_fragments", dict, loaded.rel, default=None)
                fragment = (fragments or {}).get(name)
                if fragment is None:
                    continue
                expect(fragment, StoredTensor, f"frozen_param_fragments: '{name}'", loaded.rel)
                if first is None:
                    if not builder.declare(name, shape, fragment.dtype, where=f"'{state.rel}' frozen_param_shapes"):
                        break
                    first = fragment
                lo, hi = rank * per_rank, min((rank + 1) * per_rank, numel)
                size = itemsize(fragment.dtype)
                for box, k in range_boxes(tuple(shape), lo, max(lo, hi)):
                    base = fragment.byte_offset()
                    if base is None:
                        raise SourceError(f"'{loaded.rel}': frozen '{name}' is not stored contiguously in place")
                    builder.add(name, Piece(loaded.rel, name, box, fragment.dtype, RAW, base + k * size,
                                            box.numel * size, (("dp_rank", rank),)))
    add_shared(state, builder)
