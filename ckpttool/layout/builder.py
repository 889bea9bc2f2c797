"""The one way a reader builds a :class:`~ckpttool.layout.layout.Layout`: declare each global tensor, add its pieces,
record problems, notes, missing files and the parallel sizes through methods, then :meth:`LayoutBuilder.build`,
which checks that everything agrees and raises every inconsistency at once."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from itertools import chain, repeat
from operator import attrgetter

from ckpttool.errors import SourceError
from ckpttool.layout.layout import Fusion, Layout, Padding, Piece, Shape, TensorLayout


class LayoutBuilder:
    """Collects pieces per fqn from a reader and checks that they agree, then builds a :class:`Layout`.

    Every disagreement (global shape, dtype, a piece outside its tensor) is collected; :meth:`build` raises
    one :class:`SourceError` listing them all.
    """

    def __init__(self, root: str, fmt: str) -> None:
        self.root = root
        self.format = fmt
        self._shape: dict[str, Shape] = {}
        self._dtype: dict[str, str] = {}
        self._first: dict[str, str] = {}
        self._pieces: dict[str, list[Piece]] = {}
        self._padding: dict[str, tuple[Padding, ...]] = {}
        self._fusion: dict[str, Fusion | None] = {}
        self._problems: list[str] = []
        self._notes: list[str] = []
        self._absent: dict[str, list[Piece]] = {}
        self._missing: set[str] = set()
        self._parallel: dict[str, int] = {}

    def problem(self, message: str) -> None:
        """Record an inconsistency of the source; :meth:`build` raises them all at once."""
        self._problems.append(message)

    @property
    def has_problems(self) -> bool:
        return bool(self._problems)

    def note(self, message: str) -> None:
        """Tell the user what the reader skipped or assumed (each note once)."""
        if message not in self._notes:
            self._notes.append(message)

    def set_parallel(self, **sizes: int) -> None:
        """Record the parallel layout the source recorded (``tp=2, pp=2``); later calls add or replace sizes."""
        self._parallel.update(sizes)

    @property
    def parallel(self) -> dict[str, int]:
        """The parallel sizes recorded so far (a copy)."""
        return dict(self._parallel)

    def mark_missing(self, *files: str) -> None:
        """Files the source should hold but does not: coverage errors name them."""
        self._missing.update(files)

    def declare(
        self,
        fqn: str,
        global_shape: Iterable[int],
        dtype: str,
        *,
        where: str,
        padding: tuple[Padding, ...] = (),
        fusion: Fusion | None = None,
    ) -> bool:
        """Record a global tensor; return False (and note a problem) if it contradicts an earlier record."""
        if (type(global_shape) is tuple and not padding and fusion is None and type(fqn) is str
                and fqn not in self._shape and set(map(type, global_shape)) <= _INT and min(global_shape, default=0) >= 0):
            # the common case, checked at C speed: a new tensor, a shape of plain non-negative ints, no records
            self._shape[fqn], self._dtype[fqn], self._first[fqn] = global_shape, dtype, where
            self._pieces[fqn] = []
            self._padding[fqn], self._fusion[fqn] = padding, fusion
            return True
        if (type(global_shape) is tuple and type(fqn) is str and global_shape == self._shape.get(fqn)
                and dtype == self._dtype[fqn] and padding == self._padding[fqn]):
            # the other common case: a further piece of a tensor declared before (a TP shard), agreeing with it
            return True
        if not isinstance(fqn, str):
            self.problem(f"{fqn!r:.60}: a tensor name that is not a string in {where}")
            return False
        if not isinstance(global_shape, (tuple, list)) or not all(isinstance(n, int) for n in global_shape):
            self.problem(f"'{fqn}': global shape {global_shape!r:.60} in {where} is not a list of integers")
            return False
        shape = tuple(int(n) for n in global_shape)
        if any(n < 0 for n in shape):
            self.problem(f"'{fqn}': negative global shape {list(shape)} in {where}")
            return False
        if fqn not in self._shape:
            self._shape[fqn], self._dtype[fqn], self._first[fqn] = shape, dtype, where
            self._pieces[fqn] = []
            self._padding[fqn], self._fusion[fqn] = padding, fusion
            for pad in padding:
                if not (0 <= pad.dim < len(shape)) or not (0 < pad.true_size <= shape[pad.dim]):
                    self.problem(
                        f"'{fqn}': padding record (dim {pad.dim}, true size {pad.true_size}) does not fit the "
                        f"global shape {list(shape)} in {where}"
                    )
            if fusion is not None and (
                not 0 <= fusion.dim < len(shape)
                or any(size <= 0 for _, size in fusion.parts)
                or sum(size for _, size in fusion.parts) != shape[fusion.dim]
            ):
                self.problem(
                    f"'{fqn}': fusion parts {[list(p) for p in fusion.parts]} along dim {fusion.dim} do not add up to "
                    f"the global shape {list(shape)} in {where}"
                )
            return True
        ok = True
        if shape != self._shape[fqn]:
            self.problem(
                f"'{fqn}': pieces disagree on the global shape: {list(self._shape[fqn])} in {self._first[fqn]} "
                f"but {list(shape)} in {where}"
            )
            ok = False
        if dtype != self._dtype[fqn]:
            self.problem(
                f"'{fqn}': pieces disagree on the dtype: {self._dtype[fqn]} in {self._first[fqn]} "
                f"but {dtype} in {where}"
            )
            ok = False
        if padding != self._padding[fqn]:
            self.problem(f"'{fqn}': pieces disagree on padding: {self._first[fqn]} vs {where}")
            ok = False
        return ok

    def add_whole(self, fqn: str, piece: Piece, *, where: str) -> None:
        """Declare a tensor that ``piece`` holds whole (its shape is the piece's sizes, no padding, no fusion) and
        add the piece: :meth:`declare` then :meth:`add`, in one step for the common case (an HF checkpoint is
        90k such tensors)."""
        box = piece.box
        shape = box.sizes
        if (type(fqn) is str and fqn not in self._shape and type(shape) is tuple and not any(box.offsets)
                and set(map(type, shape)) <= _INT and min(shape, default=1) > 0):
            self._shape[fqn], self._dtype[fqn], self._first[fqn] = shape, piece.dtype, where
            self._pieces[fqn] = [piece]
            self._padding[fqn], self._fusion[fqn] = (), None
        elif self.declare(fqn, shape, piece.dtype, where=where):
            self.add(fqn, piece)

    def add_wholes(self, fqns: Sequence[str], pieces: Sequence[Piece], wheres: Sequence[str]) -> None:
        """:meth:`add_whole` for each fqn, its piece and where it is, in that order: checked and recorded at C speed
        when every one is the common case (new names, shapes of positive ints, pieces at offset 0), else one at a
        time (an HF checkpoint: 90k tensors in one call)."""
        boxes = list(map(_BOX, pieces))
        shapes = list(map(_SIZES, boxes))
        if (len(fqns) == len(pieces) == len(wheres) and set(map(type, fqns)) <= _STR and set(map(type, shapes)) <= _TUPLE
                and len(set(fqns)) == len(fqns) and self._shape.keys().isdisjoint(fqns)
                and not any(map(any, map(_OFFSETS, boxes))) and set(map(type, chain.from_iterable(shapes))) <= _INT
                and min(chain.from_iterable(shapes), default=1) > 0):
            self._shape.update(zip(fqns, shapes))
            self._dtype.update(zip(fqns, map(_DTYPE, pieces)))
            self._first.update(zip(fqns, wheres))
            self._pieces.update(zip(fqns, map(list, zip(pieces))))
            self._padding.update(zip(fqns, repeat(())))
            self._fusion.update(zip(fqns, repeat(None)))
            return
        for fqn, piece, where in zip(fqns, pieces, wheres, strict=True):
            self.add_whole(fqn, piece, where=where)

    def add_pieces(self, fqns: Sequence[str], shapes: Sequence[Shape], pieces: Sequence[Piece], where: str) -> None:
        """For each fqn, its global shape and piece, in that order: :meth:`declare` (no padding, no fusion, the
        piece's dtype) and, if that agrees, :meth:`add`. The pieces of one file of a sharded checkpoint (a
        sidecar's rank file: 11k pieces of a 90k-piece checkpoint) checked a column at a time when every one is
        the common case (names and shapes well formed, each piece non-empty and inside its tensor), recorded one
        at a time; else :meth:`declare` and :meth:`add` on each, which say what is wrong."""
        boxes = list(map(_BOX, pieces))
        offsets, sizes = list(map(_OFFSETS, boxes)), list(map(_SIZES, boxes))
        flat_shapes = list(chain.from_iterable(shapes))
        flat_offsets, flat_sizes = list(chain.from_iterable(offsets)), list(chain.from_iterable(sizes))
        ndims = list(map(len, shapes))
        if not (len(fqns) == len(shapes) == len(pieces) and set(map(type, fqns)) <= _STR
                and set(map(type, shapes)) <= _TUPLE and set(map(type, flat_shapes)) <= _INT
                and min(flat_shapes, default=0) >= 0 and ndims == list(map(len, offsets)) == list(map(len, sizes))
                and set(map(type, flat_offsets)) <= _INT and min(flat_offsets, default=0) >= 0
                and set(map(type, flat_sizes)) <= _INT and min(flat_sizes, default=1) > 0
                and all(map(operator.le, map(operator.add, flat_offsets, flat_sizes), flat_shapes))):
            for fqn, shape, piece in zip(fqns, shapes, pieces, strict=True):
                if self.declare(fqn, shape, piece.dtype, where=where):
                    self.add(fqn, piece)
            return
        known, dtypes, first, recorded = self._shape, self._dtype, self._first, self._pieces
        for fqn, shape, piece in zip(fqns, shapes, pieces):
            dtype = piece.dtype
            if fqn not in known:  # a new tensor: what declare records
                known[fqn], dtypes[fqn], first[fqn], recorded[fqn] = shape, dtype, where, [piece]
                self._padding[fqn], self._fusion[fqn] = (), None
            elif shape == known[fqn] and dtype == dtypes[fqn] and not self._padding[fqn]:
                recorded[fqn].append(piece)  # a further piece of a tensor declared before, agreeing with it
            elif self.declare(fqn, shape, dtype, where=where):  # it disagrees: declare says how
                self.add(fqn, piece)

    @property
    def declared(self) -> tuple[str, ...]:
        return tuple(self._shape)

    def dtype_of(self, fqn: str) -> str:
        return self._dtype[fqn]

    def add(self, fqn: str, piece: Piece, *, present: bool = True) -> None:
        """Add a piece of a declared tensor; pieces outside the global shape are problems, not pieces.

        ``present=False`` records a piece whose file is missing, so coverage errors can name it.
        """
        shape = self._shape[fqn]
        if piece.dtype != self._dtype[fqn]:
            self.problem(
                f"'{fqn}': piece in {piece.where()} has dtype {piece.dtype}, the tensor is {self._dtype[fqn]}"
            )
            return
        if not piece.box.inside(shape):
            self.problem(
                f"'{fqn}': piece in {piece.where()} at offsets {list(piece.box.offsets)} with sizes "
                f"{list(piece.box.sizes)} lies outside the global shape {list(shape)}"
            )
            return
        if piece.box.numel == 0:
            return
        if present:
            self._pieces[fqn].append(piece)
        else:
            self._absent.setdefault(fqn, []).append(piece)
            self._missing.add(piece.file)

    def build(self, notes: Iterable[str] = ()) -> Layout:
        if self._problems:
            raise SourceError(
                "the checkpoint's metadata is inconsistent:\n" + "\n".join(f"  - {p}" for p in self._problems)
            )
        # the per-tensor dicts are filled together (declare, add_whole), so they hold their fqns in one order
        if max(map(len, self._pieces.values()), default=0) < 2:  # no pieces to sort: built at C speed
            tensors = dict(zip(self._shape, map(
                TensorLayout, self._shape, self._shape.values(), self._dtype.values(), map(tuple, self._pieces.values()),
                self._padding.values(), self._fusion.values())))
        else:
            records = zip(self._shape.items(), self._dtype.values(), self._pieces.values(), self._padding.values(),
                          self._fusion.values())
            tensors = {
                fqn: TensorLayout(fqn, shape, dtype, tuple(pieces) if len(pieces) < 2 else _in_order(pieces), padding,
                                  fusion)
                for (fqn, shape), dtype, pieces, padding, fusion in records
            }
        return Layout(
            root=self.root,
            format=self.format,
            tensors=tensors,
            absent={fqn: tuple(pieces) for fqn, pieces in self._absent.items()},
            missing=tuple(sorted(self._missing)),
            notes=tuple(self._notes) + tuple(notes),
            parallel=dict(self._parallel),
        )


_INT = frozenset({int})
_STR, _TUPLE = frozenset({str}), frozenset({tuple})
_BOX, _SIZES, _OFFSETS, _DTYPE = attrgetter("box"), attrgetter("sizes"), attrgetter("offsets"), attrgetter("dtype")
_OFFSETS_OF = attrgetter("box.offsets")


def _in_order(pieces: list[Piece]) -> tuple[Piece, ...]:
    """Pieces by their offsets (most tensors have one piece: nothing to sort; a TP pair is mostly in order)."""
    if len(pieces) == 2 and pieces[0].box.offsets <= pieces[1].box.offsets:
        return tuple(pieces)
    return tuple(sorted(pieces, key=_OFFSETS_OF)) if len(pieces) > 1 else tuple(pieces)
