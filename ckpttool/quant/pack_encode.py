"""Packing of a range of rows to compressed-tensors ``pack-quantized`` INT4 (or INT8) and of a tensor to
``nvfp4-pack-quantized``: the pure functions the streaming executor calls for ``quantize="int4"`` and
``quantize="nvfp4"``.

A packed weight ``X.weight [O, I]`` is up to four output tensors computed from the same source rows
(:mod:`ckpttool.quant.packed` has the layout): ``X.weight_packed`` and ``X.weight_scale`` (:class:`IntRows`),
``X.weight_zero_point`` when asymmetric (:class:`IntZeroPoints`: packed along the rows, one
int32 row per ``32 / bits`` source rows) and ``X.weight_shape`` (:class:`WeightShape`). Each computes the scales
of the rows it reads, the same way, so they agree without sharing state; every row is its own groups, so a chunk
may start and stop at any row (a zero-point chunk at a multiple of ``32 / bits`` source rows).

The arithmetic is compressed-tensors' (0.20), in its order and its dtypes, so results are bit for bit those of
its min-max observer (``compute_dynamic_scales_and_zp``, ``calculate_qparams``) followed by its compressor
(``PackedQuantizationCompressor.compress``: ``quantize`` then ``pack_to_int32``), all in the weight's dtype,
bfloat16 (the source is rounded to bfloat16 first, the dtype every such release holds):

- per group of ``group`` values of a row (``group`` 0: the whole row, the ``channel`` strategy):
  ``lo = min(min(w), 0)``, ``hi = max(max(w), 0)``; symmetric: ``scale = max(|lo|, |hi|) / 7.5`` (half the
  range ``7 - (-8)``), asymmetric: ``scale = (hi - lo) / 15`` and ``zero = round(clamp(-8 - lo / scale, -8, 7))``,
  each operation rounded to bfloat16; a zero scale becomes bfloat16's epsilon (2**-7);
- ``q = round(clamp(bf16(w / scale) [+ zero, rounded to bfloat16], -8, 7))``, ties to even;
- ``q + 8`` packed eight to an int32, the first in the lowest bits (zero points the same way down the rows).

Example: a symmetric group whose largest magnitude is 0.75 gets the scale 0.1 (bfloat16's 0.10009765625), and
0.75 is written as round(7.49...) = 7.

NVFP4 (:class:`Nvfp4Part`) is compressed-tensors' ``generate_gparam``, ``compute_dynamic_scales_and_zp`` (strategy
``tensor_group``, groups of 16) and ``NVFP4PackedCompressor.compress``: ``global = bf16(2688 / max(|w|))`` in
float32 (448 * 6: the largest E4M3 scale times the largest E2M1 value); per group ``scale =
e4m3(global * bf16(max|w| / 6))`` (0 becomes 0.125); ``q = clamp(w / (scale / global), -6, 6)`` in float32,
rounded to the nearest E2M1 value with ties to the even code (:func:`~ckpttool.quant.encode.e2m1_codes`), a zero
without sign (the compressor multiplies by ``sign(x)``: ``-0`` is code 0, a negative value rounded to 0 code 8);
two codes per byte, the low nibble first. The global scale is the whole tensor's, so each of the three targets
reads its whole source tensor in one chunk (memory: one tensor, not the model), then scales and codes it a block of
rows at a time (the temporaries: one block's).

The scales come from the values, as the producer's observer computes them, not from a release: values that lie on
a release's grid (a dequantized release) get the scales ``max|q * s| / 7.5``, which are not the release's ``s``
(its largest code was 7 or -8, not 7.5), so their bytes differ from the release's (see docs/formats.md); to get
them back, the release's own scales are used instead (:mod:`ckpttool.quant.on_grid`, ``scales_from=``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ckpttool.fast.deferred import torch
from ckpttool.quant.decode import RowForRow, Scratch
from ckpttool.quant.encode import RoundTrip, e2m1_codes, e2m1_scratch
from ckpttool.quant.packed import NVFP4_GROUP

INT_PACKED = "int-pack"
INT_SCALES = "int-scales"
INT_ZERO_POINTS = "int-zero-points"
WEIGHT_SHAPE = "weight-shape"
NVFP4_PART = "nvfp4-pack"
#: the methods of this module
METHODS = (INT_PACKED, INT_SCALES, INT_ZERO_POINTS, WEIGHT_SHAPE, NVFP4_PART)
#: the largest E4M3 scale times the largest E2M1 value: what the largest group maps to, globally scaled
_NVFP4_RANGE = 448.0 * 6.0
#: how many values of an NVFP4 weight (whole rows, at least one) are scaled and coded at a time
NVFP4_BLOCK = 1 << 20


def _limits(bits: int) -> tuple[int, int]:
    return -(1 << (bits - 1)), (1 << (bits - 1)) - 1


def int_qparams(w: torch.Tensor, bits: int, group: int, symmetric: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The bfloat16 scales ``[r, G]`` of bfloat16 rows ``w`` ``[r, I]`` (``G = I / group``; 1 for ``group`` 0) and,
    when not ``symmetric``, their zero points (bfloat16 integers), as compressed-tensors' ``calculate_qparams``
    computes them from each group's minimum and maximum."""
    rows, cols = w.shape
    values = w.view(rows, cols // (group or cols), group or cols)
    lo = torch.clamp(values.amin(-1), max=0)
    hi = torch.clamp(values.amax(-1), min=0)
    qmin, qmax = _limits(bits)
    span = torch.tensor(float(qmax - qmin), dtype=w.dtype)
    zero = None
    if symmetric:
        scale = torch.maximum(lo.abs_(), hi).div_(span / 2)
    else:
        scale = hi.sub_(lo).div_(span)
        zero = lo.div_(scale).neg_().add_(qmin)  # qmin - lo / scale
        # an all-zero group's 0 / 0: the producer's NaN becomes the int8 zero point 0 (its float-to-int cast)
        zero = zero.nan_to_num_(0.0).clamp_(qmin, qmax).round_()
    eps = torch.tensor(torch.finfo(w.dtype).eps, dtype=w.dtype)
    return torch.where(scale == 0, eps, scale), zero


def int_codes(w: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor | None, bits: int, group: int,
              out: torch.Tensor | None = None) -> torch.Tensor:
    """The integer codes (bfloat16 integers ``[r, I]``) of rows ``w`` given their ``scale`` and ``zero``: compressed-
    tensors' ``_quantize``, in the rows' dtype; into ``out`` (``w``'s shape and dtype) when given."""
    rows, cols = w.shape
    grouped = w.view(rows, cols // (group or cols), group or cols)
    scaled = torch.div(grouped, scale.unsqueeze(-1), out=None if out is None else out.view(grouped.shape))
    if zero is not None:
        scaled.add_(zero.unsqueeze(-1))
    qmin, qmax = _limits(bits)
    return scaled.clamp_(qmin, qmax).round_().view(rows, cols)


def pack_int32(codes: torch.Tensor, bits: int, scratch: Scratch | None = None) -> torch.Tensor:
    """Codes ``[r, n]`` (any dtype holding integers in range) as int32 words ``[r, ceil(n * bits / 32)]``: each
    ``code + 2 ** (bits - 1)``, ``32 / bits`` to a word, the first in the lowest bits (``pack_to_int32``). With
    ``scratch``, the int64 codes are shifted on its ``int-words`` buffer."""
    per = 32 // bits
    rows, cols = codes.shape
    if scratch is None:
        unsigned = codes.to(torch.int64)
    else:
        unsigned = scratch("int-words", (rows, cols), "I64").copy_(codes)
    unsigned.add_(1 << (bits - 1))
    if cols % per:  # the last word's unused bits are zeros
        unsigned = torch.nn.functional.pad(unsigned, (0, per - cols % per))
    words = unsigned.view(rows, -1, per).bitwise_left_shift_(torch.arange(0, 32, bits)).sum(-1)
    return words.sub_(words.ge(1 << 31).to(torch.int64) << 32).to(torch.int32)  # two's complement of bit 31


def _bfloat16(stored: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    if stored.dtype == torch.bfloat16:
        return stored
    return scratch("bf16", tuple(stored.shape), "BF16").copy_(stored)


@dataclass(frozen=True, slots=True)
class IntRows(RowForRow):
    """``X.weight_packed`` (int32 ``[O, ceil(I * bits / 32)]``) or, ``scales``, ``X.weight_scale`` (bfloat16
    ``[O, G]``) of a ``[O, I]`` weight, row for row."""

    bits: int
    group: int
    symmetric: bool
    scales: bool = False

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor,
               scratch: Scratch) -> RoundTrip | None:
        """Writes the scales, or the packed codes, of ``stored``'s rows into ``out``; the codes return their round
        trip: dequantized as compressed-tensors' ``_dequantize`` does (in bfloat16), against the bfloat16 source."""
        del scales, start  # the scales are computed here, from the rows themselves
        w = _bfloat16(stored, scratch)
        scale, zero = int_qparams(w, self.bits, self.group, self.symmetric)
        if self.scales:
            out.copy_(scale)
            return None
        codes = int_codes(w, scale, zero, self.bits, self.group)
        out.copy_(pack_int32(codes, self.bits))
        rows, cols = w.shape
        grouped = codes.view(rows, scale.shape[1], -1)
        if zero is not None:
            grouped.sub_(zero.unsqueeze(-1))
        return round_trip(grouped.mul_(scale.unsqueeze(-1)).view(rows, cols), w)

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...] | None, out_dtype: str) -> dict[str, int]:
        del scales, out_dtype
        return _scratch(stored, packed=not self.scales)


@dataclass(frozen=True, slots=True)
class IntZeroPoints:
    """``X.weight_zero_point`` (int32 ``[ceil(O * bits / 32), G]``) of a ``[O, I]`` weight of ``rows`` rows: its
    row ``k`` packs the zero points of source rows ``k * 32 / bits ..`` (``pack_to_int32(..., packed_dim=0)``)."""

    bits: int
    group: int
    rows: int

    def stored_rows(self, start: int, stop: int) -> tuple[int, int]:
        per = 32 // self.bits
        return start * per, min(stop * per, self.rows)

    def align(self, rows: int) -> int:
        return max(1, rows)

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor,
               scratch: Scratch) -> None:
        del scales, start
        zero = int_qparams(_bfloat16(stored, scratch), self.bits, self.group, False)[1]
        assert zero is not None  # asymmetric by construction (a bug otherwise, not data)
        out.copy_(pack_int32(zero.t(), self.bits).t())

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...] | None, out_dtype: str) -> dict[str, int]:
        del scales, out_dtype
        return _scratch(stored, packed=False)


class OneSourceRow:
    """The row methods of a target that is no function of the source's values (a constant, or another file's
    tensor): any chunk of rows reads the source's first row only (the executor reads some)."""

    __slots__ = ()

    def stored_rows(self, start: int, stop: int) -> tuple[int, int]:
        del start, stop
        return 0, 1

    def align(self, rows: int) -> int:
        return max(1, rows)


@dataclass(frozen=True, slots=True)
class WeightShape(OneSourceRow):
    """``X.weight_shape`` (int64 ``[2]``): the logical shape, a constant; reads one source row (none is used)."""

    shape: tuple[int, ...]

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor,
               scratch: Scratch) -> None:
        del stored, scales, scratch
        out.copy_(torch.tensor(self.shape[start: start + out.shape[0]], dtype=out.dtype))

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...] | None, out_dtype: str) -> dict[str, int]:
        del stored, scales, out_dtype
        return {}


def round_trip(decoded: torch.Tensor, source: torch.Tensor) -> RoundTrip:
    """How far ``decoded`` is from ``source`` (both bfloat16 rows; ``decoded`` is spent)."""
    return measured(decoded.float().sub_(source.float()), source.float())


def measured(error: torch.Tensor, source: torch.Tensor) -> RoundTrip:
    """The round trip of float32 ``error`` (decoded - source, or its magnitude) against the float32 ``source``
    values, allocating nothing of their size (the largest magnitude is max(max, -min))."""
    error, flat = error.reshape(-1), source.reshape(-1)
    if not flat.numel():
        return RoundTrip(0.0, 0.0, 0.0, 0.0, 0)
    return RoundTrip(float(torch.maximum(error.max(), error.min().neg())), float(torch.dot(error, error)),
                     float(torch.dot(flat, flat)), float(torch.maximum(flat.max(), flat.min().neg())), flat.numel())


def nvfp4_global_scale(w: torch.Tensor) -> torch.Tensor:
    """The float32 ``[1]`` global scale of a bfloat16 weight ``w`` (compressed-tensors' ``generate_gparam``)."""
    largest = torch.maximum(torch.clamp(w.amin(), max=0).abs(), torch.clamp(w.amax(), min=0))
    found = _NVFP4_RANGE / torch.clamp(largest, min=torch.finfo(w.dtype).tiny)  # rounded to bfloat16, as there
    return torch.nan_to_num(found, nan=1.0, posinf=1.0, neginf=1.0).float().reshape(1)


def nvfp4_scales(w: torch.Tensor, glob: torch.Tensor) -> torch.Tensor:
    """The float32 scales ``[r, I/16]`` (E4M3 values) of bfloat16 rows ``w`` under the global scale ``glob``."""
    rows, cols = w.shape
    groups = w.view(rows, cols // NVFP4_GROUP, NVFP4_GROUP)
    largest = torch.maximum(torch.clamp(groups.amin(-1), max=0).abs_(), torch.clamp(groups.amax(-1), min=0))
    scale = glob * largest.div_(torch.tensor(6.0, dtype=w.dtype))  # bf16(max / 6), then float32 times the global
    scale = scale.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn).float()
    return scale.masked_fill_(scale == 0, 0.125)


@dataclass(frozen=True, slots=True)
class Nvfp4Part:
    """One of an NVFP4 weight's three targets (``part``: ``"packed"``, uint8 ``[O, I/2]``; ``"scales"``, F8_E4M3
    ``[O, I/16]``; ``"global"``, float32 ``[1]``) computed from the whole ``[O, I]`` weight of ``rows`` rows."""

    part: str
    rows: int

    def stored_rows(self, start: int, stop: int) -> tuple[int, int]:
        del start, stop
        return 0, self.rows

    def align(self, rows: int) -> int:
        del rows
        return max(1, self.rows) if self.part != "global" else 1

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor,
               scratch: Scratch) -> RoundTrip | None:
        """Writes the part into ``out``; the packed values return their round trip: compressed-tensors'
        decompressor's ``fp4 * (scale / global)`` in float32, rounded to bfloat16, against the bfloat16 source.

        Only the global scale needs the whole weight: the scales and codes are computed :data:`NVFP4_BLOCK`
        values of rows at a time, so their temporaries are those of a block, not of the weight (a 28672 x 8192
        weight's would be ~9 GiB per thread). Every group lies in one row, so the bytes are the same."""
        del scales, start
        w = _bfloat16(stored, scratch)
        glob = nvfp4_global_scale(w)
        if self.part == "global":
            out.copy_(glob)
            return None
        rows, cols = w.shape
        step = max(1, NVFP4_BLOCK // max(1, cols))
        measured = None
        for first in range(0, rows, step):
            block = w[first: first + step]
            found = self._block(block, glob, out[first: first + step], scratch)
            if found is not None:
                measured = found if measured is None else measured + found
        return measured

    def _block(self, w: torch.Tensor, glob: torch.Tensor, out: torch.Tensor, scratch: Scratch) -> RoundTrip | None:
        """The scales, or the packed codes and their round trip, of the rows ``w`` into ``out``."""
        scale = nvfp4_scales(w, glob)
        if self.part == "scales":
            out.copy_(scale)
            return None
        rows, cols = w.shape
        factor = scale.div_(glob).unsqueeze(-1)
        q = w.view(rows, -1, NVFP4_GROUP).div(factor).clamp_(-6.0, 6.0).add_(0.0)  # + 0: -0 becomes 0
        codes = e2m1_codes(q.view(rows, cols), scratch)
        pairs = codes.view(rows, cols // 2, 2)
        out.copy_(pairs[..., 0].bitwise_or(pairs[..., 1].bitwise_left_shift(4)))
        magnitude = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[codes.bitwise_and(7).long()]
        values = torch.where(codes.ge(8), -magnitude, magnitude).view(rows, -1, NVFP4_GROUP)
        return round_trip(values.mul_(factor).view(rows, cols).to(torch.bfloat16), w)

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...] | None, out_dtype: str) -> dict[str, int]:
        """The temporaries, on buffers of their own (an upper bound): the bfloat16 copy of the weight, and for
        a block of rows the scales, the scaled values and :func:`~ckpttool.quant.encode.e2m1_codes`' buffer, its
        codes and masks, the round trip."""
        del scales, out_dtype
        n = math.prod(stored)
        cols = stored[-1] if len(stored) > 1 else max(1, n)
        block = min(n, max(1, NVFP4_BLOCK // max(1, cols)) * cols)
        return {"bf16": n * 2, **e2m1_scratch(block),
                "nvfp4-temporaries": block * (4 + 1 + 1 + 4 + 4 + 4 + 8 + 4 + 4 + 4 + 2)}


def _scratch(stored: tuple[int, ...], packed: bool) -> dict[str, int]:
    """The temporaries of packing ``stored`` rows, counted on buffers of their own (an upper bound): the bfloat16
    copy of a float32 source, the group minima and maxima, the scaled values; for the packed values also their
    int64 codes and words, and the float32 round trip (decoded values and source)."""
    n = math.prod(stored)
    sizes = {"bf16": n * 2, "int-qparams": n // 2 * 2 + 64, "int-scaled": n * 2}
    if packed:
        sizes["int-pack-temporaries"] = n * (8 + 8) + n * (4 + 4)
    return sizes


def pack_encoder(method: str, params: dict[str, object]) -> (
        IntRows | IntZeroPoints | WeightShape | Nvfp4Part | None):
    """The encoder ``method`` names with ``params``, or None for a method of another module."""
    if method == NVFP4_PART:
        return Nvfp4Part(str(params["part"]), int(params["rows"]))  # type: ignore[call-overload]
    if method == WEIGHT_SHAPE:
        return WeightShape(tuple(params["shape"]))  # type: ignore[arg-type]
    if method not in METHODS:
        return None
    bits, group = int(params["bits"]), int(params["group"])  # type: ignore[call-overload]
    if method == INT_ZERO_POINTS:
        return IntZeroPoints(bits, group, int(params["rows"]))  # type: ignore[call-overload]
    return IntRows(bits, group, bool(params.get("symmetric", True)), scales=method == INT_SCALES)
