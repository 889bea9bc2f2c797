"""One part of interleaved parts: :class:`Take`, the one transform that is not a bijection.

A split writes one part of a de-interleaved tensor from the contiguous block that holds it: gpt-oss's gate rows of an
expert-TP rank lie interleaved with its up rows in one HuggingFace box, and its DCP chunks hold them apart
(:func:`~ckpttool.plan.transforms.chain.within_part` makes the Take). A merge's plans never use it: every stored
element is read.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ckpttool.errors import ConfigError
from ckpttool.layout.layout import Box, Shape
from ckpttool.plan.transforms.base import BUFFER, Scratch, as_ints, chunk_buffer, plain_dim

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Take"]


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
        dim = plain_dim(self.dim, shape, name, self.name)
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
        return chunk_buffer(shape, a, b, itemsize)

    def apply(self, pre: Tensor, shape: Shape, a: int, b: int, dtype: str, scratch: Scratch,
              buffer: str = BUFFER) -> Tensor:
        """Target rows ``a..b`` (a C-order tensor on ``buffer``) from ``pre``, rows :meth:`pre_rows` of the pre
        tensor: a strided view of its part, copied once."""
        out = scratch(buffer, (b - a, *shape[1:]), dtype)
        size = b - a if self.dim == 0 else shape[self.dim]
        part = as_ints(pre, dtype).unflatten(self.dim, (size, self.parts)).select(self.dim + 1, self.part)
        as_ints(out, dtype).copy_(part)
        return out
