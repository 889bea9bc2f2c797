"""A transpose: :class:`Transpose`, a projection stored with two dims swapped (gpt-oss's Megatron-Core experts).

When it swaps dim 0, every target row is made of every pre row, so a chunk of the target needs the whole pre tensor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpttool.errors import ConfigError
from ckpttool.layout.layout import Box, Shape
from ckpttool.plan.transforms.base import BUFFER, Scratch, as_ints, chunk_buffer, plain_dim

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Transpose"]


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
        dims = sorted((plain_dim(self.dim0, shape, name, self.name), plain_dim(self.dim1, shape, name, self.name)))
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
        return chunk_buffer(shape, a, b, itemsize)

    def apply(self, pre: Tensor, shape: Shape, a: int, b: int, dtype: str, scratch: Scratch,
              buffer: str = BUFFER) -> Tensor:
        """Target rows ``a..b`` (a C-order tensor on ``buffer``) from ``pre``, rows :meth:`pre_rows` of the pre
        tensor: a transposed view of it, copied once."""
        out = scratch(buffer, (b - a, *shape[1:]), dtype)
        swapped = as_ints(pre, dtype).transpose(self.dim0, self.dim1)
        as_ints(out, dtype).copy_(swapped[a:b] if self.moves_rows() else swapped)
        return out

