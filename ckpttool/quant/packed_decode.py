"""Dequantization of packed 4-bit weights (:mod:`ckpttool.quant.packed`), rows at a time, with each producer's
own arithmetic, so results are bit for bit its own decompressor's:

- compressed-tensors ``pack-quantized`` (its ``_dequantize``): ``q.to(s.dtype)``, minus ``zero_point.to(s.dtype)``
  when asymmetric, times ``s``, in the scale's dtype (bf16 most often: the product rounded once to bf16), then cast
  to the output dtype. The integer difference times a bf16 scale is exact in float32, so computing it in float32
  and rounding once to the scale's dtype is the same.
- compressed-tensors ``nvfp4-pack-quantized`` (its ``NVFP4PackedCompressor.decompress``): ``fp4 * (float32(scale) /
  global_scale)`` in float32, rounded to bfloat16 (the dtype its unpacking gives), then cast to the output dtype.
- ModelOpt NVFP4 (``NVFP4QTensor.dequantize``): ``fp4 * (float32(scale) * weight_scale_2)`` in float32, rounded
  once.

A decoder's small inputs besides its scales (``aux``: compressed-tensors' ``weight_shape``, zero points and global
scale, ModelOpt's ``weight_scale_2``) are read whole with every chunk and checked first (:meth:`check_aux`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

from ckpttool.fast.deferred import torch
from ckpttool.quant.decode import BadScale, RowForRow, Scratch, fp4_pairs
from ckpttool.quant.packed import NVFP4_GROUP

PACKED_INT_GROUPS = "ct-int"
NVFP4_GROUPS = "nvfp4"
FP8_TENSOR = "fp8-tensor"


def _bad(scales: torch.Tensor, start: int, group: int, width: int) -> BadScale | None:
    """The first NaN or infinite scale among rows ``start..`` of a ``[O, G]`` scale matrix, with its group."""
    values = scales.float()
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return None
    mask = ~finite
    r, g = (int(i) for i in mask.nonzero()[0])
    value = float(values[r, g])
    lo = g * group if group else 0
    hi = min(lo + group, width) if group else width
    return BadScale((start + r, g), "NaN" if math.isnan(value) else repr(value),
                    f"row {start + r}, group {g} (columns {lo}..{hi})", int(mask.sum()))


def _shape_problem(aux: torch.Tensor, shape: tuple[int, ...]) -> str | None:
    """compressed-tensors' ``weight_shape`` against the shape the packed headers give."""
    found = [int(v) for v in aux.reshape(-1)]
    if found != list(shape):
        return (f"its weight_shape is {found}, but the packed values and scales hold {list(shape)}: the packing does "
                "not match the weight it names (a packed tensor cut, or a weight_shape of another tensor). ckpttool "
                "does not guess; restore the release's tensors, or merge without a dtype to keep them as they are")
    return None


@dataclass(frozen=True, slots=True)
class PackedInt(RowForRow):
    """compressed-tensors ``pack-quantized``: int32 words of ``32 / bits`` values (the first in the lowest bits,
    each ``q + 2 ** (bits - 1)``), ``[O, G]`` scales (``group`` values each; 0: one per row) and, when not
    ``symmetric``, ``[ceil(O * bits / 32), G]`` zero points packed along the rows. ``aux``: ``(weight_shape,)`` or
    ``(weight_shape, weight_zero_point)``."""

    bits: int
    group: int
    symmetric: bool = True

    def bad_scale(self, scales: torch.Tensor, start: int, stored: tuple[int, ...]) -> BadScale | None:
        """The first NaN or infinite scale among the chunk's rows, with the group it scales."""
        return _bad(scales, start, self.group, stored[-1] * (32 // self.bits))

    def check_aux(self, aux: tuple[torch.Tensor, ...], shape: tuple[int, ...]) -> str | None:
        """Why ``aux`` cannot serve a weight of ``shape``, or None."""
        return _shape_problem(aux[0], shape)

    def decode(self, stored: torch.Tensor, scales: torch.Tensor, start: int, out: torch.Tensor, scratch: Scratch,
               aux: tuple[torch.Tensor, ...] = ()) -> None:
        rows, width = out.shape
        per, mask, offset = 32 // self.bits, (1 << self.bits) - 1, 1 << (self.bits - 1)
        work = scratch("work", (rows, stored.shape[-1] * per), "F32")
        unpacked = work.view(rows, stored.shape[-1], per)
        # the int32 words shifted in a buffer of ours (an arithmetic shift: the sign it carries in lies above the
        # mask), not in fresh tensors per chunk, which let each thread's heap grow
        nibble = scratch("nibble", tuple(stored.shape), "I32")
        for k in range(per):
            torch.bitwise_right_shift(stored, self.bits * k, out=nibble)
            unpacked[:, :, k].copy_(nibble.bitwise_and_(mask))
        values = work[:, :width]
        values.sub_(offset)
        if not self.symmetric:
            zero = self._zero_points(aux[1], start, rows, per, mask, offset)
            by_group(torch.Tensor.sub_, values, zero, self.group or width)
        by_group(torch.Tensor.mul_, values, scales.float(), self.group or width)
        if scales.dtype != torch.float32:  # the producer's product is in the scale's dtype: rounded there once
            rounded = scratch("rounded", (rows, width), _NAMES[str(scales.dtype)])
            rounded.copy_(values)
            out.copy_(rounded)
        else:
            out.copy_(values)

    def _zero_points(self, packed: torch.Tensor, start: int, rows: int, per: int, mask: int, offset: int) -> torch.Tensor:
        """Rows ``start..start+rows`` of the zero points, unpacked from their int32 words along the rows."""
        first, last = start // per, -(-(start + rows) // per)
        words = packed[first:last].to(torch.int64)
        unpacked = torch.stack([(words >> (self.bits * k)) & mask for k in range(per)], dim=1)  # [W, per, G]
        full = unpacked.reshape(-1, packed.shape[-1]).float() - offset
        lo = start - first * per
        return full[lo: lo + rows]

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...], out_dtype: str) -> dict[str, int]:
        del scales, out_dtype
        n = math.prod(stored) * (32 // self.bits)
        return {"work": n * 4, "rounded": n * 4, "nibble": math.prod(stored) * 4}


@dataclass(frozen=True, slots=True)
class Nvfp4(RowForRow):
    """NVFP4: bytes of two FP4 E2M1 codes (low nibble first), one F8_E4M3 scale per 16 values, and one float32
    global scale (``aux[-1]``), which compressed-tensors divides by (``divide``) and ModelOpt multiplies by."""

    divide: bool

    def bad_scale(self, scales: torch.Tensor, start: int, stored: tuple[int, ...]) -> BadScale | None:
        """The first NaN F8_E4M3 scale among the chunk's rows, with its 16 values."""
        return _bad(scales, start, NVFP4_GROUP, stored[-1] * 2)

    def check_aux(self, aux: tuple[torch.Tensor, ...], shape: tuple[int, ...]) -> str | None:
        """Why ``aux`` cannot serve a weight of ``shape`` (a ``weight_shape`` of another shape; a global scale that
        is NaN, infinite or zero), or None."""
        if len(aux) > 1 and (problem := _shape_problem(aux[0], shape)) is not None:
            return problem
        value = float(aux[-1].reshape(-1)[0])
        if not math.isfinite(value) or value == 0:
            name = "weight_global_scale" if self.divide else "weight_scale_2"
            return (f"its {name} is {value!r}, which would make every value of the tensor NaN, infinite or zero. "
                    "Export it again from the original weights, or merge without a dtype to keep it quantized")
        return None

    def decode(self, stored: torch.Tensor, scales: torch.Tensor, start: int, out: torch.Tensor, scratch: Scratch,
               aux: tuple[torch.Tensor, ...] = ()) -> None:
        del start
        rows, width = out.shape
        index = scratch("index", (stored.numel(),), "I32").copy_(stored.reshape(-1))
        work = scratch("work", (stored.numel(), 2), "F32")
        torch.index_select(fp4_pairs(), 0, index, out=work)
        values = work.view(rows, -1)[:, :width]
        factors = scratch("scale-f32", tuple(scales.shape), "F32").copy_(scales)
        glob = aux[-1].reshape(1, 1).float()
        factors.div_(glob) if self.divide else factors.mul_(glob)
        by_group(torch.Tensor.mul_, values, factors, NVFP4_GROUP)
        if self.divide:  # compressed-tensors' decompressor returns its float32 product as bfloat16, its unpack dtype
            out.copy_(scratch("rounded", (rows, width), "BF16").copy_(values))
        else:
            out.copy_(values)

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...], out_dtype: str) -> dict[str, int]:
        del out_dtype
        n = math.prod(stored)
        return {"index": n * 4, "work": n * 2 * 4, "scale-f32": math.prod(scales) * 4, "rounded": n * 2 * 2 if self.divide else 0}


@dataclass(frozen=True, slots=True)
class Fp8Tensor(RowForRow):
    """ModelOpt FP8 per tensor: F8_E4M3 values and one float32 scale (``aux[0]``, 0-d), multiplied in the output
    dtype, as ModelOpt's ``FP8QTensor.dequantize(dtype)`` does: ``fp8.to(dtype) * scale.to(dtype)`` (in bfloat16 the
    scale is rounded to bfloat16 first, then the product)."""

    def check_aux(self, aux: tuple[torch.Tensor, ...], shape: tuple[int, ...]) -> str | None:
        """Why the scale cannot serve (NaN, infinite, zero or negative: every value of the tensor would be), or None."""
        del shape
        value = float(aux[0].reshape(-1)[0])
        if not math.isfinite(value) or value <= 0:
            return (f"its weight_scale is {value!r}, which would make every value of the tensor "
                    f"{'NaN' if math.isnan(value) else 'infinite' if math.isinf(value) else 'zero' if value == 0 else 'negated'}. "
                    "Export it again from the original weights, or merge without a dtype to keep it quantized")
        return None

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor, scratch: Scratch,
               aux: tuple[torch.Tensor, ...] = ()) -> None:
        del scales, start
        name = _OUT_NAMES[str(out.dtype)]
        values = scratch("work", tuple(out.shape), name).copy_(stored)  # FP8 to any float dtype: exact
        values.mul_(aux[0].reshape(()).to(out.dtype))
        out.copy_(values)

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...], out_dtype: str) -> dict[str, int]:
        del scales
        return {"work": math.prod(stored) * (4 if out_dtype == "F32" else 2)}


_OUT_NAMES = {"torch.bfloat16": "BF16", "torch.float16": "F16", "torch.float32": "F32"}


def by_group(op: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], values: torch.Tensor, per_group: torch.Tensor,
             group: int) -> None:
    """``op`` (``Tensor.mul_``, ``Tensor.sub_``) in place on ``values`` ``[r, width]`` with ``per_group`` ``[r, G]``
    spread over ``group`` columns each: through a broadcast view where ``width`` is whole groups (the same products,
    element for element, without an ``[r, width]`` copy of the operand per chunk), a last part group apart."""
    width = values.shape[1]
    whole = width // group
    if whole:
        op(values[:, :whole * group].unflatten(1, (whole, group)), per_group[:, :whole].unsqueeze(-1))
    if width > whole * group:
        op(values[:, whole * group:], per_group[:, whole:whole + 1])


#: the safetensors names of the 16-bit scale dtypes (the ``rounded`` scratch buffer's), by torch's name
_NAMES = {"torch.bfloat16": "BF16", "torch.float16": "F16"}


def packed_decoder(method: str, params: dict[str, object]) -> PackedInt | Nvfp4 | Fp8Tensor | None:
    """The decoder ``method`` names with ``params``, or None for a method of another module."""
    if method == PACKED_INT_GROUPS:
        return PackedInt(int(params["bits"]), int(params["group"]), bool(params.get("symmetric", True)))  # type: ignore[call-overload]
    if method == NVFP4_GROUPS:
        return Nvfp4(bool(params["divide"]))
    if method == FP8_TENSOR:
        return Fp8Tensor()
    return None
