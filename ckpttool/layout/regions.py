"""Where a region of one box lands in another: the arithmetic every copy of a plan rests on.

A slice or copy maps a source box onto a destination box of the same elements, possibly with dims of size 1
dropped or added (a stacked expert ``(1, n, h)`` onto a per-expert ``(n, h)``). These functions map a region
of the destination back to the source, dim by dim; :func:`uncovered` finds what a set of boxes leaves out.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence

from ckpttool.layout.layout import Box, Shape


def dim_map(src: Box, dst: Box) -> tuple[int | None, ...]:
    """For each dim of ``dst``, the dim of ``src`` it comes from, when ``src`` and ``dst`` hold the same
    elements in the same order (their sizes agree once dims of size 1 are dropped); None for a dim of size 1
    that ``src`` does not have."""
    return _dim_map(src.sizes, dst.sizes)


@functools.lru_cache(maxsize=4096)  # a function of two shapes, asked for every copy of a plan (90k and more)
def _dim_map(src_sizes: Shape, dst_sizes: Shape) -> tuple[int | None, ...]:
    src_dims = [d for d, n in enumerate(src_sizes) if n != 1]
    dst_dims = [d for d, n in enumerate(dst_sizes) if n != 1]
    mapping: list[int | None] = [None] * len(dst_sizes)
    for s, d in zip(src_dims, dst_dims):
        mapping[d] = s
    return tuple(mapping)


def map_region(src: Box, dst: Box, region: Box) -> Box | None:
    """Where ``src`` (a box of a source) fills ``dst`` (a box of a target): the part of ``src`` that fills
    ``region`` of the target, or None when ``dst`` and ``region`` share no element."""
    common = dst.intersect(region)
    if common is None:
        return None
    offsets, sizes = list(src.offsets), list(src.sizes)
    for d, s in enumerate(dim_map(src, dst)):
        if s is not None:
            offsets[s] += common.offsets[d] - dst.offsets[d]
            sizes[s] = common.sizes[d]
    return Box(tuple(offsets), tuple(sizes))


def squeeze(sizes: Shape) -> Shape:
    return tuple(n for n in sizes if n != 1)


def uncovered(shape: Shape, boxes: Sequence[Box]) -> list[Box]:
    """The regions of a tensor of ``shape`` that no box covers, as few boxes as a sweep finds."""
    if math.prod(shape) == 0:
        return []
    return [Box(o, s) for o, s in _uncovered(shape, list(boxes), 0)]


def _uncovered(shape: Shape, boxes: list[Box], dim: int) -> list[tuple[Shape, Shape]]:
    if dim == len(shape):
        return [] if boxes else [((), ())]
    n = shape[dim]
    cuts = sorted({0, n} | {min(max(b.offsets[dim], 0), n) for b in boxes} | {min(max(b.ends[dim], 0), n) for b in boxes})
    out: list[tuple[Shape, Shape]] = []
    pending: tuple[int, int, list[tuple[Shape, Shape]]] | None = None
    for lo, hi in zip(cuts, cuts[1:]):
        covering = [b for b in boxes if b.offsets[dim] <= lo and b.ends[dim] >= hi]
        rest = _uncovered(shape, covering, dim + 1)
        if pending is not None and pending[2] == rest:
            pending = (pending[0], hi, rest)
            continue
        if pending is not None:
            out.extend(((pending[0], *o), (pending[1] - pending[0], *s)) for o, s in pending[2])
        pending = (lo, hi, rest)
    if pending is not None:
        out.extend(((pending[0], *o), (pending[1] - pending[0], *s)) for o, s in pending[2])
    return out
