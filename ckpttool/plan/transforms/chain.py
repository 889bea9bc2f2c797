"""Steps in order: :class:`Chain`; :data:`Transform`, any kind; and what works on a whole transform of any kind.

:func:`within_part` turns a chain that ends in a de-interleave into the :class:`~.take.Take` of one part, for a split
whose box lies within that part; :func:`transform_tensor` computes a whole target at once, for references and tests.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Union

from ckpttool.errors import ConfigError
from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import dtype_name
from ckpttool.layout.layout import Box, Shape
from ckpttool.plan.transforms.base import BUFFER, Scratch
from ckpttool.plan.transforms.permute import Permute
from ckpttool.plan.transforms.take import Take
from ckpttool.plan.transforms.transpose import Transpose

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Chain", "Transform", "transform_tensor", "within_part"]


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
