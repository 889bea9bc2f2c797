"""Permutations within blocks: :class:`Permute`, and the two made by name, :func:`rope_halves` and :func:`interleave`.

Meta's (and torchtitan's) Q/K rows hold each head's RoPE pairs interleaved where HF wants two halves; gpt-oss's
gate/up projection interleaves its two parts column by column. Both are one permutation repeated in every block of
``period`` indices along a dim, so a block never leaves its place and a chunk of rows needs only whole blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from ckpttool.errors import ConfigError
from ckpttool.fast.deferred import torch
from ckpttool.layout.layout import Box, Shape
from ckpttool.plan.transforms.base import BUFFER, Scratch, as_ints, chunk_buffer, plain_dim, row_bytes

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["Permute", "interleave", "rope_halves"]


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
        dim = plain_dim(self.dim, shape, name, self.name)
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
        """The bytes of each buffer :meth:`apply` takes for target rows ``a..b`` (``buffer`` as there): the chunk's
        rows, and the whole blocks too when the chunk does not align with them."""
        found = chunk_buffer(shape, a, b, itemsize)
        pa, pb = self.pre_rows(shape, a, b)
        if (pa, pb) != (a, b):
            found[f"{BUFFER}.blocks"] = (pb - pa) * row_bytes(shape, itemsize)
        return found

    def apply(self, pre: Tensor, shape: Shape, a: int, b: int, dtype: str, scratch: Scratch,
              buffer: str = BUFFER) -> Tensor:
        """Target rows ``a..b`` (a C-order tensor on ``buffer``) from ``pre``, rows :meth:`pre_rows` of the pre
        tensor, both in ``dtype``: one gather of the permuted index (its bytes moved as they are)."""
        pa, pb = self.pre_rows(shape, a, b)
        whole = (pb - pa, *shape[1:])
        out = scratch(buffer if (pa, pb) == (a, b) else f"{buffer}.blocks", whole, dtype)
        index = torch.tensor(self.order, dtype=torch.int64)
        blocks = (shape[self.dim] // self.period if self.dim else (pb - pa) // self.period, self.period)
        source = as_ints(pre, dtype).unflatten(self.dim, blocks)
        target = as_ints(out, dtype).unflatten(self.dim, blocks)
        torch.index_select(source, self.dim + 1, index, out=target)
        if (pa, pb) == (a, b):
            return out
        rows = scratch(buffer, (b - a, *shape[1:]), dtype)
        return rows.copy_(out[a - pa:b - pa])



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
