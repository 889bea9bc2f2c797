"""DTensor placement arithmetic as plain data: which regions of a global tensor one rank of a device mesh holds.

A DTensor is described by its global shape, the shape of its device mesh, the rank's coordinate in that mesh
and one :class:`Placement` per mesh dim (``Shard(d)``, ``Replicate()`` or ``_StridedShard(d, split_factor)``).
:func:`local_ranges` turns these into the global ``[start, stop)`` ranges the rank holds along every tensor
dim, and :func:`range_pieces` cuts the rank's local tensor into ``(local box, global box)`` pairs, each
contiguous in the local tensor's bytes (C order), ready to be pieces of a layout.

The arithmetic follows what torch and FSDP2 store: ``torch.chunk`` splits (ceil-sized chunks, the last smaller,
trailing ones empty); mesh dims applied left to right, or in a DTensorSpec's ``shard_order``; and
``_StridedShard`` (FSDP2 over TP) as sharding "right to left": the TP split first, then each TP piece chunked
over the data-parallel dim, so a rank can hold several non-adjacent ranges of one dim.

With ``Shard`` and ``Replicate`` placements the result is torch's
``torch.distributed.tensor._utils.compute_local_shape_and_global_offset``, for every shape, even or not
(``tests/test_placements.py`` compares the two). With ``_StridedShard`` it is FSDP2's layout (each rank's
``torch.chunk`` of its TP shard), which torch's formula also gives for even splits and data-parallel sizes up
to 2, but not for every uneven split over 3 or more data-parallel ranks (the test pins such a case).

Nothing here imports torch, a reader or the live gather.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

from ckpttool.layout.layout import Box

#: a ``[start, stop)`` range of global indices along one tensor dim
Range = tuple[int, int]


@dataclass(frozen=True, slots=True)
class Placement:
    """One mesh dim's placement: ``kind`` is ``shard``, ``strided`` (``_StridedShard``) or ``replicate``."""

    kind: str
    dim: int = -1
    split_factor: int = 1

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"Shard({self.dim})"
        if self.kind == "strided":
            return f"_StridedShard({self.dim}, sf={self.split_factor})"
        return "Replicate()"


def _chunk(length: int, parts: int, index: int) -> Range:
    """Elements ``index`` of ``torch.chunk`` of ``length`` into ``parts``: ceil-sized, the last smaller,
    trailing chunks empty."""
    size = -(-length // parts) if length else 0
    start = min(index * size, length)
    return start, min(start + size, length)


def _take(segments: Sequence[Range], start: int, stop: int) -> list[Range]:
    """Elements ``start..stop`` of the concatenation of ``segments``, as global ranges."""
    out: list[Range] = []
    pos = 0
    for a, b in segments:
        n = b - a
        lo, hi = max(start - pos, 0), min(stop - pos, n)
        if lo < hi:
            out.append((a + lo, a + hi))
        pos += n
    return out


def local_ranges(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                 placements: Sequence[Placement], order: Sequence[tuple[int, tuple[int, ...]]] | None = None,
                 ) -> list[list[Range]]:
    """For every tensor dim, the global ``[start, stop)`` ranges a rank holds, in the order of its local tensor.

    ``Shard(d)`` on a mesh dim of size ``n`` keeps ``torch.chunk`` piece ``coordinate`` of what the rank
    holds along ``d`` (mesh dims applied left to right, as DTensor does). ``_StridedShard(d, sf)`` is a
    ``Shard`` applied as if after the ``sf`` pieces that later mesh dims make: what the rank holds along
    ``d`` is cut into ``sf`` pieces (``torch.chunk``), each piece chunked ``n`` ways, and the rank keeps its
    chunk of every piece. A later ``Shard(d)`` whose mesh size divides the number of pieces then selects
    whole pieces, which is FSDP2-over-TP's layout, uneven splits included.

    Args:
        global_shape: the DTensor's global shape.
        mesh_shape: the device mesh's shape.
        coordinate: the rank's coordinate in the mesh, one index per mesh dim.
        placements: one placement per mesh dim.
        order: a DTensorSpec's ``shard_order``: ``(tensor dim, mesh dims in the order they shard it)``
            entries; absent, mesh dims shard left to right.

    Returns:
        Per tensor dim, the ranges held (``[(0, 0)]`` where the rank holds nothing of that dim).

    Example:
        >>> # 6 rows, TP=2 then FSDP=2 over dp: rank (dp=1, tp=0) holds row 2
        >>> local_ranges([6, 4], [2, 2], [1, 0], [Placement("strided", 0, 2), Placement("shard", 0)])[0]
        [(2, 3)]
    """
    segments: list[list[Range]] = [[(0, n)] for n in global_shape]
    steps = list(range(len(placements)))
    if order is not None:
        steps = [m for _, mesh_dims in order for m in mesh_dims]
    for mesh_dim in steps:
        placement = placements[mesh_dim]
        if placement.kind == "replicate":
            continue
        d, n, c = placement.dim, mesh_shape[mesh_dim], coordinate[mesh_dim]
        current = segments[d]
        total = sum(b - a for a, b in current)
        if placement.kind == "strided":
            sf = placement.split_factor
            pieces = [_take(current, *_chunk(total, sf, p)) for p in range(sf)]
            new: list[Range] = []
            for piece in pieces:
                length = sum(b - a for a, b in piece)
                lo, hi = _chunk(length, n, c)
                got = _take(piece, lo, hi)
                new.extend(got if got else [(0, 0)])  # keep a placeholder: later shards select pieces
            segments[d] = new
        elif len(current) > 1 and len(current) % n == 0:
            per = len(current) // n
            segments[d] = current[c * per:(c + 1) * per]
        else:
            segments[d] = _take(current, *_chunk(total, n, c))
    return [[(a, b) for a, b in dim if b > a] or [(0, 0)] for dim in segments]


def local_shape(ranges: Sequence[Sequence[Range]]) -> tuple[int, ...]:
    """The shape of the local tensor that holds ``ranges`` (what :func:`local_ranges` gives)."""
    return tuple(sum(b - a for a, b in dim) for dim in ranges)


def range_pieces(ranges: Sequence[Sequence[Range]]) -> list[tuple[Box, Box]]:
    """The local tensor (C order) cut into boxes contiguous in its bytes: ``(local box, global box)`` pairs.

    Example:
        >>> [(lo.offsets, glob.offsets, glob.sizes) for lo, glob in range_pieces([[(0, 2), (4, 6)], [(0, 3)]])]
        [((0, 0), (0, 0), (2, 3)), ((2, 0), (4, 0), (2, 3))]
    """
    shape = local_shape(ranges)
    if math.prod(shape) == 0:
        return []
    # per dim: (local start, global start, length) of each range
    runs = []
    for dim in ranges:
        pos, items = 0, []
        for a, b in dim:
            if b > a:
                items.append((pos, a, b - a))
                pos += b - a
        runs.append(items)
    out: list[tuple[Box, Box]] = []
    for combo in itertools.product(*runs):
        local = Box(tuple(r[0] for r in combo), tuple(r[2] for r in combo))
        glob = Box(tuple(r[1] for r in combo), tuple(r[2] for r in combo))
        out.extend(_contiguous(local, glob, shape))
    return out


def _contiguous(local: Box, glob: Box, shape: Sequence[int]) -> list[tuple[Box, Box]]:
    """Split a sub-box of a C-order tensor into sub-boxes each contiguous in memory."""
    partial = [d for d in range(len(shape)) if local.sizes[d] != shape[d]]
    if not partial:
        return [(local, glob)]
    last = partial[-1]
    if all(local.sizes[d] == 1 for d in range(last)):
        return [(local, glob)]
    out = []
    for idx in itertools.product(*(range(local.sizes[d]) for d in range(last))):
        lo = tuple(local.offsets[d] + i for d, i in enumerate(idx)) + local.offsets[last:]
        go = tuple(glob.offsets[d] + i for d, i in enumerate(idx)) + glob.offsets[last:]
        sizes = (1,) * last + local.sizes[last:]
        out.append((Box(lo, sizes), Box(go, sizes)))
    return out
