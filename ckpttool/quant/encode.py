"""Quantization of a range of rows: the pure functions the streaming executor calls for ``quantize="fp8"`` and
``quantize="mxfp4"``.

A quantized weight is two output tensors computed from the same source rows: the FP8 values (:class:`Fp8Values`)
and one float32 scale per block (:class:`Fp8Scales`, ``weight_scale_inv``). A block row needs all of its ``B0``
source rows, so the values are computed in chunks of whole block rows (:meth:`Fp8Values.align`), and a chunk of
scale rows reads ``B0`` source rows per scale row (:meth:`Fp8Scales.stored_rows`). Both compute the scale the same
way, so they agree without sharing state.

The arithmetic is DeepSeek-V3's ``weight_quant`` (and ``fixtures/make_quantized.py``'s), in its order, so results
are bit for bit the same: per block, ``scale = float32(amax) / 448`` (1 for an all-zero block), then
``fp8 = float8_e4m3fn(clamp(float32(w) / scale, -448, 448))`` (round to nearest even). transformers' own
``Fp8Quantize`` multiplies by ``448 / amax`` instead, which can differ in the last bit of a value.

MXFP4 (gpt-oss's experts, :class:`Mxfp4Blocks` and :class:`Mxfp4Scales`) is the arithmetic of triton_kernels'
``downcast_to_mxfp_torch`` (``numerics_details/mxfp.py``, the function transformers' ``quantize_to_mxfp4`` calls,
with its default ``ROUND_UP`` scales and ``uint8`` scale bytes), after the values are rounded to bfloat16 as
``quantize_to_mxfp4`` does: per group of 32 values along the input dim of the stored ``[E, out, in]`` matrix,
``scale = 2 ** ceil(log2(float32(amax) / 6))`` (computed on the float's bits: exponent rounded up, mantissa dropped;
0 for an all-zero group), ``q = value * (1 / scale)``, ``q`` rounded to the nearest E2M1 value with ties to the even
code and saturated at 6, sign kept (``-0`` too); codes two per byte, low nibble first; the scale byte is the
float's exponent field. A value of the grid encodes to itself; a release decoded and encoded again gives its bytes.

While it writes the values, :class:`Fp8Values` dequantizes them again (``float32(fp8) * scale``, what every
FP8 loader computes) and measures the round trip against the source: :class:`RoundTrip`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from ckpttool.fast.deferred import torch
from ckpttool.quant.decode import Scratch, scale_blocks, to_float32
from ckpttool.quant.formats import FP4_VALUES, MXFP4_GROUP, MXFP4_GROUP_BYTES

#: the largest finite float8_e4m3fn value
E4M3_MAX = 448.0
FP8_VALUES = "fp8-quantize"
FP8_SCALES = "fp8-scales"
MXFP4_BLOCKS = "mxfp4-quantize"
MXFP4_SCALES = "mxfp4-scales"
#: the largest E2M1 value
E2M1_MAX = 6.0


@dataclass(frozen=True, slots=True)
class RoundTrip:
    """How far a quantized tensor's dequantized values are from the source, over the rows measured so far.

    ``max_abs_error`` is the largest ``|dequantized - source|``; ``relative_error`` is the root of the summed
    squared errors over the summed squared source values (relative RMS error); ``source_max`` the largest
    ``|source|``.
    """

    max_abs_error: float
    squared_error: float
    squared_source: float
    source_max: float
    elements: int

    @property
    def relative_error(self) -> float:
        return math.sqrt(self.squared_error / self.squared_source) if self.squared_source else 0.0

    def __add__(self, other: RoundTrip) -> RoundTrip:
        return RoundTrip(max(self.max_abs_error, other.max_abs_error), self.squared_error + other.squared_error,
                         self.squared_source + other.squared_source, max(self.source_max, other.source_max),
                         self.elements + other.elements)

    def to_json(self) -> dict[str, float]:
        return {"max_abs_error": self.max_abs_error, "relative_error": self.relative_error,
                "source_max_abs": self.source_max}


def block_amax(work: torch.Tensor, block: tuple[int, int], out: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """``out`` (float32 ``[ceil(r/B0), ceil(I/B1)]``) := each block's largest ``|value|`` over the ``r`` rows of
    ``work`` (float32; rows start on a block boundary), edge blocks cropped. Rows are reduced first, then columns
    (a max is exact in any order; NaN wins)."""
    rows, cols = work.shape
    b0, b1 = block
    size = scratch("abs", (rows, cols), "F32")
    torch.abs(work, out=size)
    columns = scratch("column-amax", (out.shape[0], cols), "F32")
    fr, full = rows // b0, cols // b1
    if fr:
        torch.amax(size[: fr * b0].view(fr, b0, cols), dim=1, out=columns[:fr])
    if rows % b0:
        torch.amax(size[fr * b0:], dim=0, out=columns[fr])
    if full:
        torch.amax(columns[:, : full * b1].unflatten(-1, (full, b1)), dim=-1, out=out[:, :full])
    if cols % b1:
        torch.amax(columns[:, full * b1:], dim=-1, out=out[:, full])
    return out


def scales_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """In place: ``amax / 448``, and 1 where the block is all zeros (DeepSeek's and the fixture script's rule)."""
    zero = amax == 0
    return amax.div_(E4M3_MAX).masked_fill_(zero, 1.0)


@dataclass(frozen=True, slots=True)
class Fp8Values:
    """The FP8 E4M3 values of a ``[O, I]`` weight, computed from its source rows in chunks of whole block rows."""

    block: tuple[int, int]

    def stored_rows(self, start: int, stop: int) -> tuple[int, int]:
        return start, stop

    def align(self, rows: int) -> int:
        return max(self.block[0], rows // self.block[0] * self.block[0])

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor,
               scratch: Scratch) -> RoundTrip:
        del scales, start  # the scales are computed here, from the rows themselves
        rows, cols = stored.shape
        work = to_float32(stored, scratch("work", (rows, cols), "F32"), scratch)
        scale = block_amax(work, self.block, scratch("scale-f32", _grid(rows, cols, self.block), "F32"), scratch)
        source_max = float(scale.max())
        scales_from_amax(scale)
        flat = work.view(-1)
        squared_source = float(torch.dot(flat, flat))
        scale_blocks(work, scale, 0, self.block, divide=True)
        out.copy_(work.clamp_(-E4M3_MAX, E4M3_MAX))
        to_float32(out, work, scratch)  # the round trip: float32(fp8) * scale, as every FP8 loader dequantizes
        scale_blocks(work, scale, 0, self.block)
        work.sub_(to_float32(stored, scratch("abs", (rows, cols), "F32"), scratch))
        error = torch.abs(work, out=scratch("abs", (rows, cols), "F32"))
        return RoundTrip(float(error.max()) if error.numel() else 0.0, float(torch.dot(flat, flat)), squared_source,
                         source_max, flat.numel())

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...] | None, out_dtype: str) -> dict[str, int]:
        del scales, out_dtype
        return _scratch_bytes(stored, self.block)


@dataclass(frozen=True, slots=True)
class Fp8Scales:
    """The float32 ``weight_scale_inv`` of a ``[O, I]`` weight: row ``k`` from source rows ``k*B0 .. (k+1)*B0``."""

    block: tuple[int, int]
    rows: int

    def stored_rows(self, start: int, stop: int) -> tuple[int, int]:
        return start * self.block[0], min(stop * self.block[0], self.rows)

    def align(self, rows: int) -> int:
        return max(1, rows)

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor,
               scratch: Scratch) -> None:
        del scales, start
        work = to_float32(stored, scratch("work", tuple(stored.shape), "F32"), scratch)
        scales_from_amax(block_amax(work, self.block, out, scratch))

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...] | None, out_dtype: str) -> dict[str, int]:
        del scales, out_dtype
        sizes = _scratch_bytes(stored, self.block)
        del sizes["scale-f32"]
        return sizes


def _grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    return math.ceil(rows / block[0]), math.ceil(cols / block[1])


def _scratch_bytes(stored: tuple[int, ...], block: tuple[int, int]) -> dict[str, int]:
    """The temporaries of quantizing ``stored`` rows: float32 copy, absolute values, per-column block-row maxima,
    the scales, and the FP8 codes' table indices of the round trip (one per two codes: :func:`.decode.to_float32`)."""
    n = math.prod(stored)
    grid = _grid(stored[0], stored[1], block)
    return {"work": n * 4, "abs": n * 4, "column-amax": grid[0] * stored[1] * 4, "scale-f32": math.prod(grid) * 4,
            "index": n // 2 * 4}


def mxfp4_encode(stored: torch.Tensor, blocks: torch.Tensor | None, scales: torch.Tensor | None,
                 scratch: Scratch) -> RoundTrip | None:
    """Encode experts ``stored`` (a named ``[n, A, B]`` tensor: transformers' ``[E, in, out]``; any float dtype)
    as MXFP4: ``blocks`` (uint8 ``[n, B, A/32, 16]``) and ``scales`` (uint8 ``[n, B, A/32]``), either may be None.
    Returns the round trip (values dequantized against the bfloat16-rounded source) when ``blocks`` is written.

    Example: a group whose largest value is 7 gets the scale 2 (7/6 rounded up to a power of two, byte 128)
    and 7 is written as 3.5 -> the code of 4 (a tie to the even code), read back as 8."""
    experts, cols, rows = stored.shape
    groups = cols // MXFP4_GROUP
    shape = (experts, rows, groups, MXFP4_GROUP)
    source = stored if stored.dtype == torch.bfloat16 else scratch("bf16", tuple(stored.shape), "BF16").copy_(stored)
    work = scratch("work", shape, "F32")
    transposed_copy(work.view(experts, rows, cols), source)  # the stored [E, out, in] orientation
    size = torch.abs(work, out=scratch("abs", shape, "F32"))
    amax = torch.amax(size, dim=-1, out=scratch("amax", shape[:3], "F32"))
    bits = amax.div_(E2M1_MAX).view(torch.int32)  # amax / 6, its exponent rounded up and its mantissa dropped
    bits.add_(0x007FFFFF).bitwise_and_(0x7F800000)
    if scales is not None:
        scales.copy_(bits.bitwise_right_shift(23))
    if blocks is None:
        return None
    scale = bits.view(torch.float32)
    inverse = torch.where(scale == 0, 0.0, torch.reciprocal(scale))
    q = torch.mul(work, inverse.unsqueeze(-1), out=size)
    codes = e2m1_codes(q, scratch)
    pairs = codes.view(experts, rows, groups, MXFP4_GROUP_BYTES, 2)
    blocks.copy_(pairs[..., 0].bitwise_or(pairs[..., 1].bitwise_left_shift(4)))
    # the round trip: each code's value times its scale (exact), against the values encoded
    values = torch.index_select(_fp4_values(), 0, codes.view(-1), out=q.view(-1)).view(shape)
    return _round_trip(work, values.mul_(scale.unsqueeze(-1)))


#: input rows of ``[E, in, out]`` transposed at a time: torch copies a whole transposed view element by element in a
#: poor order (3.5x slower on a gpt-oss expert, one thread); slabs of this many rows go at memory speed
TRANSPOSE_ROWS = 512


def transposed_copy(out: torch.Tensor, source: torch.Tensor) -> None:
    """``out`` (``[E, out, in]``) = ``source`` (``[E, in, out]``) transposed, any dtypes, a slab of rows at a time."""
    for e in range(source.shape[0]):
        for a in range(0, source.shape[1], TRANSPOSE_ROWS):
            out[e, :, a:a + TRANSPOSE_ROWS].copy_(source[e, a:a + TRANSPOSE_ROWS].T)


#: float32 bit patterns: 0.25 and 0.75 minus one ulp (the codes below 1: 0 up to 0.25, 1 below 0.75, 2 from it)
_BELOW_ONE = (0x3E800000, 0x3F400000 - 1)


def e2m1_codes(q: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """The E2M1 code (int32, sign bit 8) of each float32 ``q``: the nearest E2M1 value, ties to the even code,
    saturated at 6; NaN gives the largest code, as the reference's bit arithmetic does.

    On the float's bits, a few integer passes and no float arithmetic: from 1 up, E2M1 is a float with one mantissa
    bit whose exponent starts at 0, so the code is the float32's (exponent, top mantissa bit) rounded half to even,
    ``(bits + 0x1FFFFF + bit 22) >> 22`` (the carry moves into the exponent: 1.75 -> 2, 3.5 -> 4, 5 -> 4), less
    ``127 << 1`` and plus 2; below 1 (codes 0, 1, 2: the values 0, 0.5, 1) it is which of 0.25 and 0.75 it passes
    (0.25 is a tie to 0, 0.75 to 1). Below 1 the first is at most 2 and above it the second is 2, so the code is
    the larger of the two. NaN and infinity are clamped to infinity's bits first (code 7)."""
    shape = tuple(q.shape)
    bits = torch.bitwise_and(q.view(torch.int32), 0x7FFFFFFF, out=scratch("e2m1", shape, "I32"))
    bits.clamp_(max=0x7F800000)
    code = scratch("e2m1.code", shape, "I32").copy_(bits)
    code >>= 22
    code.bitwise_and_(1).add_(bits).add_(0x1FFFFF)
    code >>= 22
    code.sub_((127 << 1) - 2).clamp_(max=7)
    below = torch.bucketize(bits, _below_one(), out_int32=True, out=scratch("e2m1.sub", shape, "I32"))
    torch.maximum(code, below, out=code)
    sign = torch.bitwise_right_shift(q.view(torch.int32), 28, out=below)
    return code.bitwise_or_(sign.bitwise_and_(8))


def e2m1_scratch(n: int) -> dict[str, int]:
    """The buffers :func:`e2m1_codes` takes for ``n`` values: ``|q|``'s bits, the codes, ``0..2`` below one (then
    the signs), int32 each."""
    return {"e2m1": n * 4, "e2m1.code": n * 4, "e2m1.sub": n * 4}


@cache
def _below_one() -> torch.Tensor:
    return torch.tensor(_BELOW_ONE, dtype=torch.int32)


def _round_trip(source: torch.Tensor, decoded: torch.Tensor) -> RoundTrip:
    flat, error = source.reshape(-1), decoded.sub_(source).reshape(-1)
    return RoundTrip(_largest_magnitude(error), float(torch.dot(error, error)), float(torch.dot(flat, flat)),
                     _largest_magnitude(flat), flat.numel())


def _largest_magnitude(values: torch.Tensor) -> float:
    """``max(|values|)`` (0 for none) from one pass that allocates nothing: the larger of ``-min`` and ``max``."""
    if not values.numel():
        return 0.0
    low, high = torch.aminmax(values)
    return max(-float(low), float(high))


@cache
def _fp4_values() -> torch.Tensor:
    return torch.tensor(FP4_VALUES, dtype=torch.float32)


@dataclass(frozen=True, slots=True)
class Mxfp4Blocks:
    """The ``_blocks`` (uint8 ``[E, B, A/32, 16]``) of a named ``[E, A, B]`` expert tensor: rows are experts."""

    def stored_rows(self, start: int, stop: int) -> tuple[int, int]:
        return start, stop

    def align(self, rows: int) -> int:
        return max(1, rows)

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor,
               scratch: Scratch) -> RoundTrip | None:
        del scales, start
        return mxfp4_encode(stored, out, None, scratch)

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...] | None, out_dtype: str) -> dict[str, int]:
        del scales, out_dtype
        return _mxfp4_scratch(stored, blocks=True)


@dataclass(frozen=True, slots=True)
class Mxfp4Scales:
    """The ``_scales`` (uint8 ``[E, B, A/32]``, E8M0 bytes) of a named ``[E, A, B]`` expert tensor."""

    def stored_rows(self, start: int, stop: int) -> tuple[int, int]:
        return start, stop

    def align(self, rows: int) -> int:
        return max(1, rows)

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor,
               scratch: Scratch) -> None:
        del scales, start
        mxfp4_encode(stored, None, out, scratch)

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...] | None, out_dtype: str) -> dict[str, int]:
        del scales, out_dtype
        return _mxfp4_scratch(stored, blocks=False)


def _mxfp4_scratch(stored: tuple[int, ...], blocks: bool) -> dict[str, int]:
    """The named temporaries of :func:`mxfp4_encode` (bfloat16 copy, float32 values and their magnitudes, the
    group maxima; for the blocks :func:`e2m1_codes`' buffer), and for the blocks what torch allocates besides
    (counted on a buffer of their own: the prediction stays an upper bound)."""
    n = math.prod(stored)
    sizes = {"bf16": n * 2, "work": n * 4, "abs": n * 4, "amax": n // MXFP4_GROUP * 4}
    if blocks:
        sizes.update(e2m1_scratch(n))
        # what torch allocates besides: the high nibbles shifted and the pairs or-ed (int32 each, half the codes),
        # and the group scales' mask and inverses
        sizes["mxfp4-temporaries"] = n * (2 + 2) + n // MXFP4_GROUP * (1 + 4 + 4)
    return sizes


def encoder(method: str, params: tuple[tuple[str, object], ...]) -> Fp8Values | Fp8Scales | Mxfp4Blocks | Mxfp4Scales | None:
    """The encoder a plan's computed target names, or None when ``method`` is not an encoder's."""
    options = dict(params)
    block = tuple(options.get("block", (0, 0)))  # type: ignore[call-overload]
    if method == FP8_VALUES:
        return Fp8Values(block)  # type: ignore[arg-type]
    if method == FP8_SCALES:
        return Fp8Scales(block, int(options["rows"]))  # type: ignore[arg-type, call-overload]
    if method == MXFP4_BLOCKS:
        return Mxfp4Blocks()
    if method == MXFP4_SCALES:
        return Mxfp4Scales()
    return None
