"""Transforms: a target that is a named, invertible index map of the tensor its slices tile.

A :class:`Box` is offsets and sizes, so a target that is a *permutation* of its source (Q/K rows in Meta's interleaved
RoPE order, which HF wants as two halves per head; gpt-oss's gate/up interleaved by column; a projection stored
transposed) would be one slice per row. Instead a :class:`~ckpttool.plan.plan.TargetSpec` carries a transform: its
slices tile the *pre* tensor of shape :meth:`source_shape` (``spec.shape``), and the target is ``transform(pre)``.
Every transform is a bijection of elements, so tiling the pre tensor exactly once is tiling the target exactly once:
the plan's proof (:func:`~ckpttool.plan.tiling.check_tiling`) runs unchanged on the pre shape.

Kinds (frozen data, compared and hashed like any part of a plan):

- :class:`Permute`: within each block of ``period`` along ``dim``, target index ``i`` is pre index ``order[i]``;
  made by :func:`rope_halves` and :func:`interleave`.
- :class:`Transpose`: dims ``dim0`` and ``dim1`` swapped.
- :class:`Chain`: steps applied in order (pre -> step 1 -> step 2 -> target).
- :class:`Take`: one of ``parts`` interleaved parts along ``dim`` (``pre[..., part::parts, ...]``). The one kind
  that is *not* a bijection: the pre tensor holds the other parts too, which its target leaves unread. It is how a
  split writes one part of a de-interleaved tensor from the contiguous block that holds it (gpt-oss's gate rows of an
  expert-TP rank: its gate and up columns lie interleaved in one HuggingFace box, and its DCP chunks hold them
  apart, :func:`within_part`); the merge's plans never use it (every stored element is read).

Each has ``name`` (words for ``--dry-run`` and the audit), :meth:`source_shape`, :meth:`target_shape`,
:meth:`inverse`, :meth:`bound` (the checks against a target's shape, with messages naming it) and :meth:`pre_box`
(the box of the pre tensor a box of the target is the same transform of, for a split's per-rank boxes). The streaming
executor writes a transformed target in chunks of target rows ``[a, b)``: :meth:`pre_rows` says which rows of the
pre tensor (along dim 0) a chunk needs, :meth:`align` how many target rows a chunk should take (whole periods when
a :class:`Permute` works on dim 0, everything when a :class:`Transpose` moves dim 0), :meth:`apply` computes the
chunk from those rows on the thread's buffers and :meth:`scratch_bytes` says how large they get (``--dry-run``'s
peak). Dims may be negative until :meth:`bound` makes them plain; the streaming helpers take bound transforms.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Union

from ckpttool.errors import ConfigError
from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import dtype_name, itemsize
from ckpttool.layout.layout import Box, Shape

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Chain", "Permute", "Take", "Transform", "Transpose", "interleave", "rope_halves", "transform_tensor",
           "within_part"]

#: ``scratch(buffer, shape, dtype)``: a tensor on the calling thread's buffer ``buffer`` (``Reader.scratch``)
Scratch = Callable[[str, tuple[int, ...], str], "Tensor"]
#: the buffer a transformed chunk is computed into (:meth:`Permute.apply`); a chain's steps use ``transform.N``
BUFFER = "transform"

_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}  # a dtype's bytes seen as integers: any dtype is moved as is


def _dim(dim: int, shape: Shape, name: str, what: str) -> int:
    """``dim`` made plain (a negative dim counts from the end), or a ConfigError naming the target."""
    if not -len(shape) <= dim < len(shape):
        raise ConfigError(f"'{name}': {what} works on dim {dim}, out of range for the target's shape {list(shape)}")
    return dim % len(shape)


def _row_bytes(shape: Shape, itemsize: int) -> int:
    return math.prod(shape[1:]) * itemsize


@dataclass(frozen=True, slots=True)
class Permute:
    """Within each block of ``period`` indices along ``dim``, target index ``i`` comes from pre index ``order[i]``.

    ``label`` (and ``inverse_label``, the inverse's) name it in words; a permutation with none is described by its
    numbers. Example: ``Permute(0, 4, (0, 2, 1, 3))`` swaps rows 1 and 2 of every block of four rows.
    """

    dim: int
    period: int
    order: tuple[int, ...]
    label: str = ""
    inverse_label: str = ""

    @property
    def name(self) -> str:
        return self.label or f"permute dim {self.dim} in blocks of {self.period} as {list(self.order)}"

    def source_shape(self, shape: Shape) -> Shape:
        """The shape of the pre tensor of a target of ``shape``: the same."""
        return tuple(shape)

    def target_shape(self, shape: Shape) -> Shape:
        """The shape of the target of a pre tensor of ``shape``: the same."""
        return tuple(shape)

    def inverse(self) -> Permute:
        """The permutation that undoes this one."""
        inverse = [0] * len(self.order)
        for i, j in enumerate(self.order):
            inverse[j] = i
        return Permute(self.dim, self.period, tuple(inverse), self.inverse_label or f"inverse of {self.name}", self.label)

    def bound(self, shape: Shape, name: str) -> Permute:
        """This permutation checked against a target of ``shape`` called ``name``, its dim made plain.

        Raises:
            ConfigError: the dim is out of range, ``period`` does not divide it, or ``order`` is not a permutation
                of ``0..period-1``; the message names the target.
        """
        dim = _dim(self.dim, shape, name, self.name)
        if self.period < 1 or shape[dim] % self.period:
            raise ConfigError(f"'{name}': {self.name} needs blocks of {self.period} along dim {dim}, which does not "
                              f"divide its size {shape[dim]} (shape {list(shape)})")
        if len(self.order) != self.period or sorted(self.order) != list(range(self.period)):
            raise ConfigError(f"'{name}': {self.name}: the order {list(self.order)} is not a permutation of "
                              f"0..{self.period - 1}")
        return self if dim == self.dim else replace(self, dim=dim)

    def bijective(self) -> bool:
        """Whether every pre element is one target element (a permutation: yes)."""
        return True

    def moves_rows(self) -> bool:
        """Whether a target row is made of pre rows from all over the tensor (never: blocks stay in place)."""
        return False

    def align(self, shape: Shape, rows: int) -> int:
        """``rows`` rounded up to whole blocks when the blocks lie along dim 0 (never past the whole tensor)."""
        if self.dim != 0:
            return rows
        return min(shape[0], -(-rows // self.period) * self.period)

    def pre_rows(self, shape: Shape, a: int, b: int) -> tuple[int, int]:
        """The rows of the pre tensor target rows ``a..b`` are made of: the same rows, or their whole blocks."""
        if self.dim != 0:
            return a, b
        return a // self.period * self.period, -(-b // self.period) * self.period

    def pre_box(self, shape: Shape, box: Box) -> Box | None:
        """The box of the pre tensor that this permutation (bound to ``box.sizes``) makes ``box`` of the target
        of: the same box when it holds whole blocks along the dim; None when it cuts through one."""
        if box.offsets[self.dim] % self.period or box.sizes[self.dim] % self.period:
            return None
        return box

    def scratch_bytes(self, shape: Shape, a: int, b: int, itemsize: int) -> dict[str, int]:
        """The bytes of each buffer :meth:`apply` takes for target rows ``a..b`` (``buffer`` as there)."""
        return _one_buffer(self, shape, a, b, itemsize)

    def apply(self, pre: Tensor, shape: Shape, a: int, b: int, dtype: str, scratch: Scratch,
              buffer: str = BUFFER) -> Tensor:
        """Target rows ``a..b`` (a C-order tensor on ``buffer``) from ``pre``, rows :meth:`pre_rows` of the pre
        tensor, both in ``dtype``: one gather of the permuted index (its bytes moved as they are)."""
        pa, pb = self.pre_rows(shape, a, b)
        whole = (pb - pa, *shape[1:])
        out = scratch(buffer if (pa, pb) == (a, b) else f"{buffer}.blocks", whole, dtype)
        index = torch.tensor(self.order, dtype=torch.int64)
        blocks = (shape[self.dim] // self.period if self.dim else (pb - pa) // self.period, self.period)
        source, target = _ints(pre, dtype).unflatten(self.dim, blocks), _ints(out, dtype).unflatten(self.dim, blocks)
        torch.index_select(source, self.dim + 1, index, out=target)
        if (pa, pb) == (a, b):
            return out
        rows = scratch(buffer, (b - a, *shape[1:]), dtype)
        return rows.copy_(out[a - pa:b - pa])


@dataclass(frozen=True, slots=True)
class Transpose:
    """Dims ``dim0`` and ``dim1`` swapped: the target's element ``[.., i, .., j, ..]`` is the pre tensor's
    ``[.., j, .., i, ..]``. Its own inverse."""

    dim0: int
    dim1: int

    @property
    def name(self) -> str:
        return f"transpose dims {self.dim0} and {self.dim1}"

    def source_shape(self, shape: Shape) -> Shape:
        """The shape of the pre tensor of a target of ``shape``: the two dims swapped."""
        found = list(shape)
        found[self.dim0], found[self.dim1] = shape[self.dim1], shape[self.dim0]
        return tuple(found)

    def target_shape(self, shape: Shape) -> Shape:
        """The shape of the target of a pre tensor of ``shape``: the two dims swapped."""
        return self.source_shape(shape)

    def inverse(self) -> Transpose:
        """Itself: a transpose undoes itself."""
        return self

    def bound(self, shape: Shape, name: str) -> Transpose:
        """This transpose checked against a target of ``shape`` called ``name``, its dims made plain and in order.

        Raises:
            ConfigError: a dim is out of range, or the two are the same dim; the message names the target.
        """
        dims = sorted((_dim(self.dim0, shape, name, self.name), _dim(self.dim1, shape, name, self.name)))
        if dims[0] == dims[1]:
            raise ConfigError(f"'{name}': {self.name} swaps a dim with itself (shape {list(shape)}); name two dims")
        return self if (self.dim0, self.dim1) == tuple(dims) else Transpose(*dims)

    def bijective(self) -> bool:
        """Whether every pre element is one target element (a transpose: yes)."""
        return True

    def moves_rows(self) -> bool:
        """Whether a target row is made of pre rows from all over the tensor: when dim 0 is swapped."""
        return self.dim0 == 0 or self.dim1 == 0

    def align(self, shape: Shape, rows: int) -> int:
        """``rows``, or the whole tensor when dim 0 is swapped (each target row is made of every pre row)."""
        return shape[0] if self.moves_rows() else rows

    def pre_rows(self, shape: Shape, a: int, b: int) -> tuple[int, int]:
        """The same rows, or every pre row when dim 0 is swapped."""
        return (0, self.source_shape(shape)[0]) if self.moves_rows() else (a, b)

    def pre_box(self, shape: Shape, box: Box) -> Box:
        """The box of the pre tensor that this transpose makes ``box`` of the target of: the two dims swapped."""
        return Box(self.source_shape(box.offsets), self.source_shape(box.sizes))

    def scratch_bytes(self, shape: Shape, a: int, b: int, itemsize: int) -> dict[str, int]:
        """The bytes of each buffer :meth:`apply` takes for target rows ``a..b``."""
        return _one_buffer(self, shape, a, b, itemsize)

    def apply(self, pre: Tensor, shape: Shape, a: int, b: int, dtype: str, scratch: Scratch,
              buffer: str = BUFFER) -> Tensor:
        """Target rows ``a..b`` (a C-order tensor on ``buffer``) from ``pre``, rows :meth:`pre_rows` of the pre
        tensor: a transposed view of it, copied once."""
        out = scratch(buffer, (b - a, *shape[1:]), dtype)
        swapped = _ints(pre, dtype).transpose(self.dim0, self.dim1)
        _ints(out, dtype).copy_(swapped[a:b] if self.moves_rows() else swapped)
        return out


@dataclass(frozen=True, slots=True)
class Chain:
    """``steps`` applied in order: the pre tensor goes through the first step, its result through the second, and
    the last step's result is the target."""

    steps: tuple[Transform, ...]

    @property
    def name(self) -> str:
        return ", then ".join(step.name for step in self.steps)

    def shapes(self, shape: Shape) -> list[Shape]:
        """The shapes from the pre tensor to a target of ``shape``: one more than there are steps."""
        found = [tuple(shape)]
        for step in reversed(self.steps):
            found.append(step.source_shape(found[-1]))
        return found[::-1]

    def source_shape(self, shape: Shape) -> Shape:
        """The shape of the pre tensor of a target of ``shape``."""
        return self.shapes(shape)[0]

    def target_shape(self, shape: Shape) -> Shape:
        """The shape of the target of a pre tensor of ``shape``."""
        for step in self.steps:
            shape = step.target_shape(shape)
        return tuple(shape)

    def inverse(self) -> Chain:
        """Each step's inverse, in the opposite order."""
        return Chain(tuple(step.inverse() for step in reversed(self.steps)))

    def bound(self, shape: Shape, name: str) -> Chain:
        """Every step checked against the shape it produces (see each kind's ``bound``).

        Raises:
            ConfigError: a step does not fit, or there is no step; the message names the target.
        """
        if not self.steps:
            raise ConfigError(f"'{name}': a chain of transforms needs at least one step")
        shapes = self.shapes(shape)
        return Chain(tuple(step.bound(shapes[i + 1], name) for i, step in enumerate(self.steps)))

    def _ranges(self, shape: Shape, a: int, b: int) -> tuple[list[Shape], list[tuple[int, int]]]:
        """Each step's shape and the rows of it a chunk of target rows ``a..b`` needs, from pre to target."""
        shapes, ranges = self.shapes(shape), [(a, b)]
        for i in range(len(self.steps) - 1, -1, -1):
            ranges.append(self.steps[i].pre_rows(shapes[i + 1], *ranges[-1]))
        return shapes, ranges[::-1]

    def bijective(self) -> bool:
        """Whether every pre element is one target element: when every step's is."""
        return all(step.bijective() for step in self.steps)

    def moves_rows(self) -> bool:
        """Whether some step swaps dim 0."""
        return any(step.moves_rows() for step in self.steps)

    def align(self, shape: Shape, rows: int) -> int:
        """``rows`` rounded up to what every step wants (the whole tensor when a step swaps dim 0)."""
        shapes = self.shapes(shape)
        if self.moves_rows():
            return shape[0]
        granule = 1
        for i, step in enumerate(self.steps):  # dim 0 is the same in every step here: their rows are one
            granule = math.lcm(granule, step.align(shapes[i + 1], 1))
        return min(shape[0], -(-rows // granule) * granule)

    def pre_box(self, shape: Shape, box: Box) -> Box | None:
        """The box of the pre tensor that this chain (bound to ``box.sizes``) makes ``box`` of the target of,
        step by step; None when a step's box cuts through a block it permutes."""
        shapes = self.shapes(shape)
        found: Box | None = box
        for i in range(len(self.steps) - 1, -1, -1):
            found = self.steps[i].pre_box(shapes[i + 1], found) if found is not None else None
        return found

    def pre_rows(self, shape: Shape, a: int, b: int) -> tuple[int, int]:
        """The rows of the pre tensor target rows ``a..b`` are made of, step by step."""
        return self._ranges(shape, a, b)[1][0]

    def scratch_bytes(self, shape: Shape, a: int, b: int, itemsize: int) -> dict[str, int]:
        """The bytes of each buffer :meth:`apply` takes: each step's, the last on ``transform``, the others on
        ``transform.N``."""
        shapes, ranges = self._ranges(shape, a, b)
        found: dict[str, int] = {}
        for i, step in enumerate(self.steps):
            last = i == len(self.steps) - 1
            for buffer, n in step.scratch_bytes(shapes[i + 1], *ranges[i + 1], itemsize).items():
                found[buffer if last else buffer.replace(BUFFER, f"{BUFFER}.{i}", 1)] = n
        return found

    def apply(self, pre: Tensor, shape: Shape, a: int, b: int, dtype: str, scratch: Scratch,
              buffer: str = BUFFER) -> Tensor:
        """Target rows ``a..b`` from ``pre`` (rows :meth:`pre_rows` of the pre tensor), one step after another."""
        shapes, ranges = self._ranges(shape, a, b)
        for i, step in enumerate(self.steps):
            last = i == len(self.steps) - 1
            pre = step.apply(pre, shapes[i + 1], *ranges[i + 1], dtype, scratch, buffer if last else f"{buffer}.{i}")
        return pre


@dataclass(frozen=True, slots=True)
class Take:
    """Part ``part`` of ``parts`` interleaved along ``dim``: target index ``i`` is pre index ``i * parts + part``,
    as ``pre[..., part::parts, ...]``. Not a bijection (the other parts are left unread), so it has no inverse; a
    split uses it (:func:`within_part`), never a merge's plan. Example: ``Take(0, 2, 1)`` of rows ``g0 u0 g1 u1``
    is ``u0 u1``."""

    dim: int
    parts: int
    part: int

    @property
    def name(self) -> str:
        return f"take part {self.part} of {self.parts} interleaved along dim {self.dim}"

    def source_shape(self, shape: Shape) -> Shape:
        """The shape of the pre tensor of a target of ``shape``: ``parts`` times as long along ``dim``."""
        found = list(shape)
        found[self.dim] *= self.parts
        return tuple(found)

    def target_shape(self, shape: Shape) -> Shape:
        """The shape of the target of a pre tensor of ``shape``: one part of ``dim``."""
        found = list(shape)
        found[self.dim] //= self.parts
        return tuple(found)

    def inverse(self) -> Take:
        """None exists: the other parts are dropped.

        Raises:
            ConfigError: always, naming the transform.
        """
        raise ConfigError(f"{self.name}: drops the other parts, so it has no inverse")

    def bound(self, shape: Shape, name: str) -> Take:
        """This selection checked against a target of ``shape`` called ``name``, its dim made plain.

        Raises:
            ConfigError: the dim is out of range, or ``part`` is not one of ``0..parts-1``; the message names the
                target.
        """
        dim = _dim(self.dim, shape, name, self.name)
        if self.parts < 1 or not 0 <= self.part < self.parts:
            raise ConfigError(f"'{name}': {self.name}: the part is not one of 0..{self.parts - 1}")
        return self if dim == self.dim else replace(self, dim=dim)

    def bijective(self) -> bool:
        """Whether every pre element is one target element (no: the other parts are dropped)."""
        return False

    def moves_rows(self) -> bool:
        """Whether a target row is made of pre rows from all over the tensor (never: ``parts`` rows each)."""
        return False

    def align(self, shape: Shape, rows: int) -> int:
        """``rows``: any row range of the target is taken from a row range of the pre tensor."""
        return rows

    def pre_rows(self, shape: Shape, a: int, b: int) -> tuple[int, int]:
        """The rows of the pre tensor target rows ``a..b`` are taken from: their ``parts`` rows each along dim 0
        (every part, so the range is contiguous), else the same rows."""
        return (a * self.parts, b * self.parts) if self.dim == 0 else (a, b)

    def pre_box(self, shape: Shape, box: Box) -> Box:
        """The box of the pre tensor ``box`` of the target is taken from: every part of its range along ``dim``."""
        return Box(self.source_shape(box.offsets), self.source_shape(box.sizes))

    def scratch_bytes(self, shape: Shape, a: int, b: int, itemsize: int) -> dict[str, int]:
        """The bytes of each buffer :meth:`apply` takes for target rows ``a..b``."""
        return _one_buffer(self, shape, a, b, itemsize)

    def apply(self, pre: Tensor, shape: Shape, a: int, b: int, dtype: str, scratch: Scratch,
              buffer: str = BUFFER) -> Tensor:
        """Target rows ``a..b`` (a C-order tensor on ``buffer``) from ``pre``, rows :meth:`pre_rows` of the pre
        tensor: a strided view of its part, copied once."""
        out = scratch(buffer, (b - a, *shape[1:]), dtype)
        size = b - a if self.dim == 0 else shape[self.dim]
        _ints(out, dtype).copy_(_ints(pre, dtype).unflatten(self.dim, (size, self.parts)).select(self.dim + 1, self.part))
        return out


Transform = Union[Permute, Transpose, Chain, Take]


def within_part(transform: Transform, shape: Shape, box: Box) -> tuple[Transform, Shape, Box] | None:
    """``box`` of the target of ``transform`` (of ``shape``; its dims plain) as a box of one part of it, when the
    transform's last step takes parts apart (a de-interleave: :func:`interleave`'s inverse, one block along its dim)
    and ``box`` lies within one part: ``(the transform with that step a Take of the part, the part's shape, the box
    in the part)``; None otherwise. The part is then a transform of the pre tensor in which a box's source is a box
    (every part of its range), where the whole de-interleave needs whole blocks.

    Example:
        >>> # [gate; up] rows taken apart from gate/up interleaved: rows 2..4 of gate are pre rows 4..8, part 0
        >>> within_part(interleave(2, 8).inverse(), (8, 3), Box((2, 0), (2, 3)))[2]  # doctest: +SKIP
        Box(offsets=(2, 0), sizes=(2, 3))
    """
    steps = transform.steps if isinstance(transform, Chain) else (transform,)
    last = steps[-1]
    if not isinstance(last, Permute) or last.period != shape[last.dim] or last.period < 2:
        return None
    parts = last.order[1] if last.period > 1 else 0
    if parts < 2 or last.period % parts:
        return None
    each = last.period // parts
    if last.order != tuple(k * parts + p for p in range(parts) for k in range(each)):
        return None
    d = last.dim
    part = box.offsets[d] // each
    if box.sizes[d] < 1 or (box.ends[d] - 1) // each != part:
        return None
    take = Take(d, parts, part)
    inner = Box(tuple(o - part * each if i == d else o for i, o in enumerate(box.offsets)), box.sizes)
    found: Transform = Chain((*steps[:-1], take)) if len(steps) > 1 else take
    return found, take.target_shape(shape), inner


def _one_buffer(transform: Permute | Transpose | Take, shape: Shape, a: int, b: int, itemsize: int) -> dict[str, int]:
    """A step's buffers: the chunk's rows, and for a permutation of blocks a chunk does not align with, the blocks."""
    found = {BUFFER: (b - a) * _row_bytes(shape, itemsize)}
    pa, pb = transform.pre_rows(shape, a, b)
    if isinstance(transform, Permute) and (pa, pb) != (a, b):
        found[f"{BUFFER}.blocks"] = (pb - pa) * _row_bytes(shape, itemsize)
    return found


def _ints(tensor: Tensor, dtype: str) -> Tensor:
    """``tensor`` seen as integers of its width, so any dtype (float8 too) is moved bit for bit."""
    return tensor.view(getattr(torch, _INTS[itemsize(dtype)]))


def rope_halves(head_dim: int, dim: int = 0) -> Permute:
    """Meta's (and torchtitan's) interleaved RoPE pairs to HF's two halves per head, along ``dim`` (rows of a
    Q or K projection): target row ``a * half + b`` of a head is pre row ``2 * b + a``, what HF's
    ``convert_llama_weights_to_hf.permute`` and torchtitan's state-dict adapter (``_permute``) compute with
    ``w.view(heads, half, 2, -1).transpose(1, 2)``. Its :meth:`~Permute.inverse` goes back to pairs.

    Raises:
        ConfigError: ``head_dim`` is not a positive even number.
    """
    if head_dim < 2 or head_dim % 2:
        raise ConfigError(f"rope_halves: head_dim {head_dim} is not a positive even number; RoPE rotates pairs")
    half = head_dim // 2
    order = tuple(2 * b + a for a in range(2) for b in range(half))
    return Permute(dim, head_dim, order, f"RoPE pairs to halves (head_dim {head_dim})",
                   f"RoPE halves to pairs (head_dim {head_dim})")


def interleave(parts: int, size: int, dim: int = 0) -> Permute:
    """``parts`` equal parts stacked along ``dim`` (of ``size``) interleaved element by element: ``[a; b]`` becomes
    ``a0 b0 a1 b1 ...`` (gpt-oss's gate/up columns), as ``torch.stack([a, b], dim + 1).flatten(dim, dim + 1)``.
    Its :meth:`~Permute.inverse` takes them apart again.

    Raises:
        ConfigError: ``parts`` is less than 1 or does not divide ``size``.
    """
    if parts < 1 or size < 1 or size % parts:
        raise ConfigError(f"interleave: {parts} parts do not divide a dim of {size}; each part needs the same size")
    each = size // parts
    order = tuple(p * each + k for k in range(each) for p in range(parts))
    return Permute(dim, size, order, f"interleave {parts} parts of {each} along dim {dim}",
                   f"de-interleave {parts} parts of {each} along dim {dim}")


def transform_tensor(transform: Transform, pre: Tensor, name: str = "tensor") -> Tensor:
    """The whole target ``transform`` makes of ``pre`` (a new tensor): what the executor writes chunk by chunk,
    for references and tests.

    Raises:
        ConfigError: ``transform`` does not fit ``pre``'s shape.
    """
    shape = transform.target_shape(tuple(pre.shape))
    bound = transform.bound(shape, name)
    dtype = dtype_name(pre.dtype)

    def fresh(buffer: str, sizes: tuple[int, ...], dtype: str) -> Tensor:
        return torch.empty(sizes, dtype=pre.dtype)

    return bound.apply(pre.contiguous(), shape, 0, shape[0], dtype, fresh)
