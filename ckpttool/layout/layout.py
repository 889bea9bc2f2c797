"""Layouts: what a source holds, as plain frozen data, built without reading any tensor.

A :class:`Layout` lists every global tensor of a checkpoint (its fqn, global shape and dtype, always as the
source recorded them) and the :class:`Piece` s that hold it: which file, where the bytes are in that file, and
which :class:`Box` of the global tensor they fill. What the source recorded about padding and fusion rides
along, so the plan can strip and split without guessing.
"""

from __future__ import annotations

import bisect
import math
import operator
from collections.abc import Mapping
from dataclasses import dataclass, field

from ckpttool.errors import SourceError
from ckpttool.fast.frozen import quick_init

Shape = tuple[int, ...]

#: How the bytes of a piece are encoded in its file.
RAW = "raw"  #: contiguous C-order elements (safetensors data, raw DCP safetensors)
TORCH_SAVE = "torch_save"  #: one ``torch.save`` archive of the piece (DCP ``.distcp`` items)


def c_strides(shape: Shape) -> tuple[int, ...]:
    """Element strides of a C-order (row-major) tensor of ``shape``."""
    return tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))


def range_boxes(shape: Shape, start: int, stop: int) -> list[tuple[Box, int]]:
    """The elements ``start..stop`` of a C-order tensor of ``shape`` (a flat range, as ZeRO partitions cut a
    parameter) as boxes, each contiguous in that order, with each box's first element counted from ``start``.

    At most ``2 * ndim - 1`` boxes: a ragged head, whole blocks, a ragged tail, recursively.

    Example:
        >>> [(b.offsets, b.sizes, k) for b, k in range_boxes((3, 4), 2, 11)]
        [((0, 2), (1, 2), 0), ((1, 0), (1, 4), 2), ((2, 0), (1, 3), 6)]
    """
    if not 0 <= start <= stop <= math.prod(shape):
        raise SourceError(f"elements {start}..{stop} do not lie in a tensor of shape {list(shape)}")
    boxes: list[tuple[Box, int]] = []

    def cut(dim: int, prefix: tuple[int, ...], lo: int, hi: int) -> None:
        # elements lo..hi (flat, within the sub-block fixed by prefix) of the dims from ``dim`` on
        if lo >= hi:
            return
        rest = shape[dim:]
        block = math.prod(rest[1:])
        if dim == len(shape) - 1 or (lo % block == 0 and hi % block == 0):
            first, count = lo // block, (hi - lo) // block
            offsets = (*prefix, first, *(0 for _ in rest[1:]))
            sizes = (*(1 for _ in prefix), count, *rest[1:])
            base = sum(o * s for o, s in zip(offsets, c_strides(shape)))
            boxes.append((Box(offsets, sizes), base - start))
            return
        head_end = min(hi, -(-lo // block) * block)
        if lo % block:
            cut(dim + 1, (*prefix, lo // block), lo % block, lo % block + (head_end - lo))
        tail_start = max(head_end, hi // block * block)
        if tail_start > head_end:
            cut(dim, prefix, head_end, tail_start)
        if hi > tail_start and tail_start >= head_end:
            cut(dim + 1, (*prefix, tail_start // block), 0, hi - tail_start)

    cut(0, (), start, stop)
    return boxes


#: the offsets of a whole box, by number of dims (one tuple each, shared)
_ZEROS = tuple((0,) * n for n in range(8))


@quick_init  # built 90k times in a plan: see ckpttool.fast.frozen
@dataclass(frozen=True, slots=True)
class Box:
    """A rectangular region of a tensor: ``offsets`` and ``sizes`` per dimension."""

    offsets: Shape
    sizes: Shape

    def __post_init__(self) -> None:
        if len(self.offsets) != len(self.sizes):
            raise SourceError(f"box has {len(self.offsets)} offsets but {len(self.sizes)} sizes")

    @classmethod
    def whole(cls, shape: Shape) -> Box:
        return cls(_ZEROS[len(shape)] if len(shape) < len(_ZEROS) else (0,) * len(shape), tuple(shape))

    @property
    def ends(self) -> Shape:
        return tuple(map(operator.add, self.offsets, self.sizes))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    def intersect(self, other: Box) -> Box | None:
        """The common region of two boxes of the same tensor, or None when they share no element."""
        if self == other:  # a piece that is the whole slice: the common case, and a plan checks 90k of them
            return self if min(self.sizes, default=1) > 0 else None
        lo = tuple(map(max, self.offsets, other.offsets))
        hi = tuple(map(min, self.ends, other.ends))
        if any(map(operator.le, hi, lo)):
            return None
        return Box(lo, tuple(map(operator.sub, hi, lo)))

    def shift(self, delta: Shape) -> Box:
        """The same box with ``delta`` subtracted from its offsets (global -> local coordinates)."""
        return Box(tuple(o - d for o, d in zip(self.offsets, delta)), self.sizes)

    def inside(self, shape: Shape) -> bool:
        if self.sizes == shape and not any(self.offsets):  # the whole tensor: most pieces and slices
            return min(shape, default=0) >= 0
        if len(shape) != len(self.sizes):
            return False
        for o, s, n in zip(self.offsets, self.sizes, shape):
            if o < 0 or s < 0 or o + s > n:
                return False
        return True

    def describe(self, shape: Shape | None = None) -> str:
        """Human words for the region, e.g. ``rows 501..1001`` when only dim 0 is partial."""
        partial = [
            d for d, (o, s) in enumerate(zip(self.offsets, self.sizes))
            if shape is None or o != 0 or s != shape[d]
        ]
        if shape is not None and not partial:
            return "the whole tensor"
        words = []
        for d in partial:
            name = {0: "rows", 1: "columns"}.get(d, f"dim {d} indices") if len(self.sizes) > 1 else "elements"
            words.append(f"{name} {self.offsets[d]}..{self.offsets[d] + self.sizes[d]}")
        return " x ".join(words)


class RowIndex:
    """Boxes found by the rows (dim 0) they span, with a bisect. A stacked tensor is thousands of boxes (a piece or a
    slice per expert, layer and rank) and a target or chunk meets a few of them: looking those up, instead of
    trying every box, keeps a plan of such tensors linear in their pieces."""

    def __init__(self, boxes: list[Box]) -> None:
        self.count = len(boxes)
        self.ranged = self.count > 0 and all(b.sizes for b in boxes)
        if self.ranged:
            self.order = sorted(range(self.count), key=lambda i: boxes[i].offsets[0])
            self.starts = [boxes[i].offsets[0] for i in self.order]
            self.ends = [b.offsets[0] + b.sizes[0] for b in boxes]
            self.longest = max(b.sizes[0] for b in boxes)

    def meeting(self, box: Box) -> list[int]:
        """The indices, in the order the boxes were given, of those whose rows meet ``box``'s rows (every box
        where rows say nothing: boxes of no dimension). A superset of the boxes ``box`` intersects."""
        if not self.ranged or not box.sizes:
            return list(range(self.count))
        low, high = box.offsets[0], box.offsets[0] + box.sizes[0]
        first = bisect.bisect_right(self.starts, low - self.longest)  # a box starting there ends at ``low`` at most
        last = bisect.bisect_left(self.starts, high)
        return sorted(i for i in self.order[first:last] if self.ends[i] > low)


@quick_init  # built 90k times in a plan: see ckpttool.fast.frozen
@dataclass(frozen=True, slots=True)
class Piece:
    """One stored piece of a global tensor.

    Attributes:
        file: path of the file holding the bytes, relative to the layout's root.
        key: the piece's name inside that file (safetensors key, state-dict key); for messages and lookups.
        box: the region of the global tensor this piece fills; ``box.sizes`` is the piece's local shape.
        dtype: safetensors dtype name of the stored elements.
        encoding: ``"raw"`` (C-order elements) or ``"torch_save"`` (a ``torch.save`` archive).
        byte_offset: where the encoded bytes start in ``file``.
        byte_length: how many encoded bytes there are.
        tags: parallel coordinates the source recorded, e.g. ``(("tp_rank", 1), ("expert", 3))``.
    """

    file: str
    key: str
    box: Box
    dtype: str
    encoding: str = RAW
    byte_offset: int = 0
    byte_length: int = 0
    tags: tuple[tuple[str, int], ...] = ()

    def where(self) -> str:
        tags = ", ".join(f"{k}={v}" for k, v in self.tags)
        return f"'{self.file}'" + (f" ({tags})" if tags else "")


@dataclass(frozen=True, slots=True)
class Padding:
    """The source padded ``dim`` beyond its true length ``true_size`` (e.g. a vocab padded for TP)."""

    dim: int
    true_size: int


@dataclass(frozen=True, slots=True)
class Fusion:
    """Several logical tensors stored concatenated along ``dim``: ``parts`` are ``(name, size)`` in order."""

    dim: int
    parts: tuple[tuple[str, int], ...]


@quick_init  # built 90k times in a plan: see ckpttool.fast.frozen
@dataclass(frozen=True, slots=True)
class TensorLayout:
    """A global tensor of the source and the pieces that hold it."""

    fqn: str
    global_shape: Shape
    dtype: str
    pieces: tuple[Piece, ...]
    padding: tuple[Padding, ...] = ()
    fusion: Fusion | None = None

    @property
    def true_shape(self) -> Shape:
        """The global shape with recorded padding removed."""
        if not self.padding and type(self.global_shape) is tuple:
            return self.global_shape
        shape = list(self.global_shape)
        for pad in self.padding:
            shape[pad.dim] = pad.true_size
        return tuple(shape)


@dataclass(frozen=True, slots=True)
class Layout:
    """Everything a source holds, as plain data.

    Attributes:
        root: the source directory; piece files are relative to it.
        format: the reader that built it (``dcp``, ``hf``, ``hf-distributed``, ``sidecar``).
        tensors: global tensors by fqn.
        absent: pieces the source's metadata names but whose files are not on disk, by fqn; they are left
            out of ``tensors`` and named in coverage errors ("rows 501..1001 are in '__1_0.distcp', missing").
        missing: files the reader knows should exist but are not on disk (with or without known pieces).
        notes: what the reader skipped or assumed, for the user.
        parallel: the parallel layout the source recorded, e.g. ``{"tp": 2, "pp": 2, "ep": 1, "dp": 4}``.
    """

    root: str
    format: str
    tensors: Mapping[str, TensorLayout]
    absent: Mapping[str, tuple[Piece, ...]] = field(default_factory=dict)
    missing: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    parallel: Mapping[str, int] = field(default_factory=dict)
