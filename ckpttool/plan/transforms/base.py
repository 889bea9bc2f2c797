"""What every kind of transform shares: the scratch buffers a chunk is computed on, dims made plain, bytes moved as is.

A transform's :meth:`apply` writes a chunk of target rows into a tensor it asks for by buffer name (:data:`Scratch`,
the reader's per-thread ``Reader.scratch``), so the executor reuses one allocation per buffer across chunks;
:meth:`scratch_bytes` reports those buffers' sizes for ``--dry-run``'s peak. Elements are moved as integers of
their width (:func:`as_ints`), so any dtype, float8 too, is permuted bit for bit.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from ckpttool.errors import ConfigError
from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import itemsize
from ckpttool.layout.layout import Shape

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["BUFFER", "Scratch", "as_ints", "chunk_buffer", "plain_dim", "row_bytes"]

#: ``scratch(buffer, shape, dtype)``: a tensor on the calling thread's buffer ``buffer`` (``Reader.scratch``)
Scratch = Callable[[str, tuple[int, ...], str], "Tensor"]
#: the buffer a transformed chunk is computed into (:meth:`Permute.apply`); a chain's steps use ``transform.N``
BUFFER = "transform"

_INTS = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}  # a dtype's bytes seen as integers: any dtype is moved as is


def plain_dim(dim: int, shape: Shape, name: str, what: str) -> int:
    """``dim`` made plain (a negative dim counts from the end), or a ConfigError naming the target ``name`` and the
    transform ``what`` that works on it."""
    if not -len(shape) <= dim < len(shape):
        raise ConfigError(f"'{name}': {what} works on dim {dim}, out of range for the target's shape {list(shape)}")
    return dim % len(shape)


def row_bytes(shape: Shape, itemsize: int) -> int:
    """The bytes of one row (along dim 0) of a tensor of ``shape`` with elements of ``itemsize`` bytes."""
    return math.prod(shape[1:]) * itemsize


def chunk_buffer(shape: Shape, a: int, b: int, itemsize: int) -> dict[str, int]:
    """A step's buffer for target rows ``a..b`` of a target of ``shape``: :data:`BUFFER`, the chunk's rows."""
    return {BUFFER: (b - a) * row_bytes(shape, itemsize)}


def as_ints(tensor: Tensor, dtype: str) -> Tensor:
    """``tensor`` seen as integers of its width, so any dtype (float8 too) is moved bit for bit."""
    return tensor.view(getattr(torch, _INTS[itemsize(dtype)]))
