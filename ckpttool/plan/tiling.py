"""What a target is made of (:class:`Slice` s of source tensors, :class:`Copy` s of pieces) and the proof that its
copies tile it exactly once, with the messages when they do not: out-of-bounds copies, overlaps (with the two
pieces' files) and uncovered regions (with the files expected to hold them). :mod:`.plan` builds on these."""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ckpttool.errors import SourceError
from ckpttool.fast.frozen import quick_init
from ckpttool.layout import regions
from ckpttool.layout.layout import Box, Layout, Piece, RowIndex, Shape, TensorLayout
from ckpttool.layout.regions import map_region, squeeze, uncovered


@quick_init  # built 90k times in a plan: see ckpttool.fast.frozen
@dataclass(frozen=True, slots=True)
class Slice:
    """``src`` (a box of source tensor ``source``, global coordinates) fills ``dst`` (a box of the target).

    The two boxes hold the same elements in the same order: their sizes agree once dims of size 1 are
    dropped, so a stacked ``(E, I, H)`` tensor can give an ``(I, H)`` target.
    """

    source: str
    src: Box
    dst: Box

    def __post_init__(self) -> None:
        if self.src.sizes != self.dst.sizes and squeeze(self.src.sizes) != squeeze(self.dst.sizes):
            raise SourceError(
                f"slice of '{self.source}' maps sizes {list(self.src.sizes)} onto {list(self.dst.sizes)}"
            )

    def dim_map(self) -> tuple[int | None, ...]:
        """For each target dim, the source dim it comes from (None for an added dim of size 1)."""
        return regions.dim_map(self.src, self.dst)


@quick_init  # built 90k times in a plan: see ckpttool.fast.frozen
@dataclass(frozen=True, slots=True)
class Copy:
    """Copy ``src`` (a box in the piece's local coordinates) of ``piece`` to ``dst`` (a box of the target)."""

    piece: Piece
    src: Box
    dst: Box


def check_tiling(
    name: str,
    shape: Shape,
    copies: Sequence[Copy],
    layout: Layout | None = None,
    slices: Sequence[Slice] = (),
) -> list[str]:
    """Every problem that keeps ``copies`` from tiling a tensor of ``shape`` exactly once.

    Out-of-bounds copies, overlaps (with the two pieces' files) and uncovered regions (with the files that
    were expected to hold them, when the layout knows) are each one message.
    """
    if len(copies) == 1 and copies[0].dst.offsets == (0,) * len(shape) and copies[0].dst.sizes == shape:
        return []  # one copy of the whole tensor: most tensors of a checkpoint, and a plan can hold 90k of them
    problems = []
    inside = []
    for c in copies:
        if c.dst.inside(shape):
            inside.append(c)
        else:
            problems.append(
                f"'{name}': piece in {c.piece.where()} writes offsets {list(c.dst.offsets)} sizes "
                f"{list(c.dst.sizes)}, outside the tensor's shape {list(shape)}"
            )
    problems.extend(_overlaps(name, shape, inside))
    for gap in uncovered(shape, [c.dst for c in inside])[:8]:
        problems.append(_gap_message(name, shape, gap, inside, layout, slices))
    return problems


def slab_copies(shape: Shape, pieces: Sequence[Piece]) -> tuple[Copy, ...] | None:
    """Each of ``pieces`` (one tensor's, in order) copied whole to its box, when they tile a tensor of ``shape``
    exactly once as slabs along one dim: every piece the whole extent of the other dims (a TP or FSDP cut, the
    commonest layout of a sharded checkpoint, 90k pieces in a large one). Proven by one sort of the slabs'
    offsets, where :func:`check_tiling` sweeps regions; None for any other layout (a replica, a cut along two
    dims, a gap, an overlap, an empty piece), which :func:`check_tiling` then proves or explains."""
    if len(pieces) < 2 or not shape or min(shape) <= 0:
        return None
    first = pieces[0].box.sizes
    if len(first) != len(shape):
        return None
    dim = -1
    for d, n in enumerate(shape):
        if first[d] != n:
            if dim >= 0:
                return None
            dim = d
    if dim < 0:
        return None
    rest, zeros = shape[:dim] + shape[dim + 1:], _ZEROS[len(shape) - 1]
    spans = []
    for piece in pieces:
        offsets, sizes = piece.box.offsets, piece.box.sizes
        if (len(sizes) != len(shape) or sizes[:dim] + sizes[dim + 1:] != rest
                or offsets[:dim] + offsets[dim + 1:] != zeros or sizes[dim] <= 0):
            return None
        spans.append((offsets[dim], sizes[dim]))
    end = 0
    for start, size in sorted(spans):
        if start != end:  # a gap or an overlap: the general proof says which, and where
            return None
        end += size
    if end != shape[dim]:
        return None
    return tuple(Copy(piece, _whole(piece.box.sizes), piece.box) for piece in pieces)  # equal slabs share one box


@functools.lru_cache(maxsize=4096)
def _whole(sizes: Shape) -> Box:
    """The whole box of a slab of ``sizes``: one object per shape, shared by the slabs of every tensor of a plan."""
    return Box.whole(sizes)


#: the offsets of a whole box, by number of dims
_ZEROS = tuple((0,) * n for n in range(8))


def _overlaps(name: str, shape: Shape, copies: Sequence[Copy]) -> list[str]:
    if not shape:
        return [f"'{name}': the scalar is covered {len(copies)} times"] if len(copies) > 1 else []
    found = []
    ordered = sorted(copies, key=lambda c: c.dst.offsets)
    active: list[Copy] = []
    for c in ordered:
        active = [a for a in active if a.dst.ends[0] > c.dst.offsets[0]]
        for a in active:
            common = a.dst.intersect(c.dst)
            if common is not None:
                found.append(
                    f"'{name}': {common.describe(shape)} covered twice, by {a.piece.where()} and "
                    f"{c.piece.where()}. Are two checkpoints mixed in one directory?"
                )
                if len(found) >= 8:
                    return found
        active.append(c)
    return found


def _gap_message(
    name: str, shape: Shape, gap: Box, copies: Sequence[Copy], layout: Layout | None, slices: Sequence[Slice]
) -> str:
    files = sorted({c.piece.file for c in copies})
    found = (
        f"found {len(copies)} piece{'s' if len(copies) != 1 else ''} in "
        + ", ".join(f"'{f}'" for f in files[:6])
        + (f" and {len(files) - 6} more files" if len(files) > 6 else "")
        if copies
        else "found no piece at all"
    )
    absent = []
    if layout is not None:
        for sl in slices:
            region = _source_region(sl, gap)
            for piece in layout.absent.get(sl.source, ()) if region is not None else ():
                if region.intersect(piece.box) is not None:
                    absent.append(piece.file)
    if absent:
        missing = ", ".join(f"'{f}'" for f in sorted(set(absent)))
        cause = f"The metadata places them in {missing}, which is missing. Restore that file."
    elif layout is not None and layout.missing:
        missing = ", ".join(f"'{f}'" for f in layout.missing[:6])
        cause = f"These files of the checkpoint are missing: {missing}. Restore them."
    else:
        cause = "Is a rank's file missing, or the checkpoint incomplete?"
    return f"'{name}': {gap.describe(shape)} covered by no piece (shape {list(shape)}; {found}). {cause}"


def _source_region(sl: Slice, box: Box) -> Box | None:
    """The part of source tensor ``sl.source`` that fills ``box`` of the target, or None if ``sl`` misses it."""
    return map_region(sl.src, sl.dst, box)


#: per source tensor (by name, checked by identity): its distinct pieces and their RowIndex, shared by every
#: target planned from that tensor in one plan
PieceRows = dict[str, tuple[TensorLayout, list[Piece], RowIndex]]


def pieces_meeting(tensor: TensorLayout, box: Box, rows: PieceRows) -> list[Piece]:
    """``tensor``'s distinct pieces whose rows meet ``box``'s, in their order: a layer's stacked experts saved as
    thousands of pieces give each expert's target the few it needs, not all of them (planning stays linear)."""
    found = rows.get(tensor.fqn)
    if found is None or found[0] is not tensor:
        unique = unique_pieces(tensor)
        found = rows[tensor.fqn] = (tensor, unique, RowIndex([p.box for p in unique]))
    return [found[1][i] for i in found[2].meeting(box)]


def unique_pieces(tensor: TensorLayout) -> list[Piece]:
    """Pieces with identical boxes are replicas (e.g. a tensor every TP rank saved): keep the first."""
    seen: dict[Box, Piece] = {}
    for piece in tensor.pieces:
        seen.setdefault(piece.box, piece)
    return list(seen.values())


def slice_copies(sl: Slice, pieces: Iterable[Piece]) -> list[Copy]:
    """The copies that fill slice ``sl`` of a target: for each piece its region inside ``sl.src`` (pieces it misses
    give none), placed where ``sl`` puts it in the target (a target dim the source lacks, such as a stacked
    expert's, is the one index ``sl.dst`` names)."""
    dim_map = sl.dim_map()
    copies = []
    for piece in pieces:
        common = sl.src.intersect(piece.box)
        if common is None:
            continue
        offsets = []
        sizes = []
        for d, s in enumerate(dim_map):
            if s is None:
                offsets.append(sl.dst.offsets[d])
                sizes.append(1)
            else:
                offsets.append(sl.dst.offsets[d] + common.offsets[s] - sl.src.offsets[s])
                sizes.append(common.sizes[s])
        copies.append(Copy(piece, common.shift(piece.box.offsets), Box(tuple(offsets), tuple(sizes))))
    return copies
