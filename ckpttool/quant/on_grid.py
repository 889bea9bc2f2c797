"""Re-packing values that lie on a release's grid with that release's own scales (``scales_from=``): the encoders
the streaming executor calls when a merged model goes back to the release it came from, byte for byte.

The observer of :mod:`ckpttool.quant.pack_encode` computes scales from the values (``max|w| / 7.5``), which cannot
give a release's scales back: a dequantized release's largest value is ``7 * s`` or ``-8 * s``, not ``7.5 * s``.
Here each weight's scales (and zero points, global scales) are read from the release, rows at a time, and only the
codes are computed, with the producer's own arithmetic:

- compressed-tensors ``pack-quantized`` (its ``_quantize``): ``q = round(clamp(bf16(w / s) [+ zero], qmin, qmax))``
  in the scale's dtype (:func:`~ckpttool.quant.pack_encode.int_codes`);
- NVFP4: ``q = clamp(w / f, -6, 6)`` in float32, ``f = float32(scale) / global`` (compressed-tensors) or
  ``float32(scale) * weight_scale_2`` (ModelOpt), rounded to the nearest E2M1 code, ties to even
  (:func:`~ckpttool.quant.encode.e2m1_codes`, which keeps a negative zero's sign: compressed-tensors' ``-0``
  code 8). A value that is zero takes the release's own zero code (0 or 8): the sign of a zero is no value, and
  ModelOpt's dequantizer turns its code 8 into ``+0``, so the values alone cannot tell which the release holds.

Every code is decoded again with the same formula and compared with the source: a value off the grid by more than
rounding (one bfloat16 ulp of the value) is refused, naming the tensor, row, group and error, since its bytes
would silently be another model's. The other tensors of a packed weight (scales, zero points, ``weight_shape``,
global and input scales) are the release's, copied (:class:`ReleaseRows`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

from ckpttool.errors import SourceError
from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import dtype_name, itemsize, torch_dtype
from ckpttool.quant.decode import RowForRow, Scratch
from ckpttool.quant.encode import RoundTrip, e2m1_codes, e2m1_scratch
from ckpttool.quant.pack_encode import OneSourceRow, int_codes, measured, pack_int32
from ckpttool.quant.packed import NVFP4_GROUP

GRID_INT = "grid-int"
GRID_NVFP4 = "grid-nvfp4"
RELEASE_ROWS = "release-rows"
#: the methods of this module
METHODS = (GRID_INT, GRID_NVFP4, RELEASE_ROWS)
#: how far (in the value's own bfloat16 ulps, 2**-7 of it) a value may be from its code's value and still count
#: as on the grid: a QAT model trained in another formula's rounding is one ulp away in places
_ULPS = 1.0


@dataclass(frozen=True, slots=True)
class ReleaseTensor:
    """One tensor of the release, where its raw bytes lie: ``file`` (an absolute path), ``offset`` (its first
    byte), its safetensors ``dtype`` and ``shape``, and its ``name`` (for messages)."""

    name: str
    file: str
    offset: int
    dtype: str
    shape: tuple[int, ...]

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Rows ``start..stop`` (of dim 0; all of a 0-d tensor), read from the file.

        Raises:
            SourceError: the file cannot be read, or is shorter than its header says.
        """
        if not self.shape:
            start, stop, shape = 0, 1, ()
        else:
            stop = min(stop, self.shape[0])
            shape = (max(stop - start, 0), *self.shape[1:])
        row = math.prod(self.shape[1:]) * itemsize(self.dtype)
        size = max(stop - start, 0) * row
        try:
            with open(self.file, "rb") as handle:
                data = os.pread(handle.fileno(), size, self.offset + start * row)
        except OSError as e:
            raise SourceError(f"'{self.file}': cannot read the release's '{self.name}' ({e.strerror})") from None
        if len(data) != size:
            raise SourceError(f"'{self.file}': the release's '{self.name}' is cut short ({len(data)} of {size} bytes "
                              f"at rows {start}..{stop}); is the file complete?")
        if not size:
            return torch.empty(shape, dtype=torch_dtype(self.dtype))
        return torch.frombuffer(bytearray(data), dtype=torch_dtype(self.dtype)).reshape(shape)


def _on_grid(name: str, source: torch.Tensor, decoded: torch.Tensor, start: int, group: int, release: str,
             scratch: Scratch) -> RoundTrip:
    """The round trip of ``decoded`` (bfloat16 rows) against ``source``, after refusing rows whose values are further
    from their codes' values than rounding (see :data:`_ULPS`). The float32 copies, the error and the comparison
    live on the thread's ``grid.*`` buffers (:func:`_on_grid_scratch`): fresh ones per chunk grow every thread's
    heap beyond the predicted peak."""
    shape = tuple(source.shape)
    w = scratch("grid.source", shape, "F32").copy_(source)
    d = scratch("grid.decoded", shape, "F32").copy_(decoded)
    error = torch.sub(d, w, out=scratch("grid.error", shape, "F32")).abs_()
    found = measured(error, w)  # |error| squared is error squared, bit for bit: round_trip's sums
    allowed = torch.maximum(w.abs_(), d.abs_(), out=d).mul_(_ULPS * 2.0 ** -7)
    bad = torch.gt(error, allowed, out=scratch("grid.bad", shape, "BOOL"))
    if not bool(bad.any()):
        return found
    r, c = (int(i) for i in bad.nonzero()[0])
    g = c // group if group else 0
    lo, hi = (g * group, min((g + 1) * group, shape[1])) if group else (0, shape[1])
    raise SourceError(
        f"'{name}': {int(bad.sum())} values of rows {start}..{start + shape[0]} lie off the grid of '{release}' "
        f"beyond rounding; the first at row {start + r}, group {g} (columns {lo}..{hi}): {float(source[r, c])!r} "
        f"where the nearest value its scale gives is {float(decoded[r, c])!r} (max |error| {float(error.max())!r} "
        "in these rows). "
        "These are not the release's values (trained off its grid, or another release): re-pack without "
        "scales_from= (--scales-from) to compute scales from the values, or give the release they came from")


def _on_grid_scratch(n: int) -> dict[str, int]:
    """The buffers :func:`_on_grid` takes for ``n`` values."""
    return {"grid.source": n * 4, "grid.decoded": n * 4, "grid.error": n * 4, "grid.bad": n}


def _bfloat16(stored: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """``stored`` rounded to bfloat16 (the dtype every release holds), on the thread's ``grid.bf16`` buffer."""
    if stored.dtype == torch.bfloat16:
        return stored
    return scratch("grid.bf16", tuple(stored.shape), "BF16").copy_(stored)


@dataclass(frozen=True, slots=True)
class GridInt(RowForRow):
    """``X.weight_packed`` of compressed-tensors ``pack-quantized`` from values on the grid of the release's
    ``scale`` (``[O, G]``) and, asymmetric, ``zero`` (``[ceil(O * bits / 32), G]``, packed along the rows)."""

    name: str
    bits: int
    group: int
    scale: ReleaseTensor
    zero: ReleaseTensor | None = None
    release: str = ""

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor,
               scratch: Scratch) -> RoundTrip:
        """Writes the packed codes of ``stored``'s rows (on the release's grid) into ``out``; returns the round trip.

        Raises:
            SourceError: a value off the grid beyond rounding.
        """
        del scales
        w = _bfloat16(stored, scratch)
        rows, cols = w.shape
        scale = self.scale.rows(start, start + rows)
        zero = self._zero(start, rows, scale) if self.zero is not None else None
        # the codes and their dequantized values on the thread's buffers, in the dtype torch's division gives
        kind = dtype_name(torch.result_type(w, scale))
        codes = int_codes(w, scale, zero, self.bits, self.group, out=scratch("grid.codes", (rows, cols), kind))
        grouped = scratch("grid.values", (rows, cols), kind).copy_(codes).view(rows, scale.shape[1], -1)
        if zero is not None:
            grouped.sub_(zero.unsqueeze(-1))
        decoded = grouped.mul_(scale.unsqueeze(-1)).view(rows, cols)  # compressed-tensors' _dequantize
        measured = _on_grid(self.name, w, decoded, start, self.group or cols, self.release, scratch)
        out.copy_(pack_int32(codes, self.bits, scratch))
        return measured

    def _zero(self, start: int, rows: int, scale: torch.Tensor) -> torch.Tensor:
        """The zero points of rows ``start..start+rows``, unpacked from the release's words, in the scale's dtype."""
        assert self.zero is not None  # called only when asymmetric (a bug otherwise, not data)
        per, mask = 32 // self.bits, (1 << self.bits) - 1
        first, last = start // per, -(-(start + rows) // per)
        words = self.zero.rows(first, last).to(torch.int64)
        unpacked = torch.stack([(words >> (self.bits * k)) & mask for k in range(per)], dim=1)
        full = unpacked.reshape(-1, words.shape[-1]) - (1 << (self.bits - 1))
        lo = start - first * per
        return full[lo: lo + rows].to(scale.dtype)

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...] | None, out_dtype: str) -> dict[str, int]:
        """The thread's buffers: the bfloat16 copy, the codes and their dequantized values (in the scale's dtype
        with bfloat16: 4 bytes unless both are bfloat16), :func:`_on_grid`'s, the int64 words; and what torch
        allocates per chunk (the packed words' sums, an eighth of the int64 words, and the release's scales)."""
        del scales, out_dtype
        n = math.prod(stored)
        code = 2 if self.scale.dtype == "BF16" else 4
        return {"grid.bf16": n * 2, "grid.codes": n * code, "grid.values": n * code, **_on_grid_scratch(n),
                "int-words": n * 8, "grid-int-temporaries": n * 8 // (32 // self.bits) + n * 2}


@dataclass(frozen=True, slots=True)
class GridNvfp4(RowForRow):
    """An NVFP4 weight's packed codes (uint8 ``[O, I/2]``) from values on the grid of the release's E4M3 ``scale``
    and float32 ``glob`` (compressed-tensors' ``weight_global_scale``, divided by: ``divide``; ModelOpt's
    ``weight_scale_2``, multiplied by); ``packed``: the release's codes, whose zero codes a zero keeps."""

    name: str
    divide: bool
    scale: ReleaseTensor
    glob: ReleaseTensor
    packed: ReleaseTensor
    release: str = ""

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor,
               scratch: Scratch) -> RoundTrip:
        """Writes the packed codes of ``stored``'s rows (on the release's grid) into ``out``; returns the round trip.

        Raises:
            SourceError: a value off the grid beyond rounding.
        """
        del scales
        w = _bfloat16(stored, scratch)
        rows, cols = w.shape
        factor = self.scale.rows(start, start + rows).float()
        glob = self.glob.rows(0, 1).float().reshape(1, 1)
        factor = factor.div_(glob) if self.divide else factor.mul_(glob)
        q = w.float().view(rows, -1, NVFP4_GROUP).div_(factor.unsqueeze(-1)).clamp_(-6.0, 6.0).view(rows, cols)
        codes = e2m1_codes(q, scratch)
        release = self.packed.rows(start, start + rows).to(torch.int32)
        theirs = torch.stack((release & 15, release >> 4), dim=-1).view(rows, cols)
        zero = codes.bitwise_and(7).eq(0) & theirs.bitwise_and(7).eq(0)
        codes = torch.where(zero, theirs, codes)  # a zero keeps the release's zero code (see the module's text)
        magnitude = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])[codes.bitwise_and(7).long()]
        values = torch.where(codes.ge(8), -magnitude, magnitude).view(rows, -1, NVFP4_GROUP)
        decoded = values.mul_(factor.unsqueeze(-1)).view(rows, cols).to(torch.bfloat16)
        measured = _on_grid(self.name, w, decoded, start, NVFP4_GROUP, self.release, scratch)
        pairs = codes.view(rows, cols // 2, 2)
        out.copy_(pairs[..., 0].bitwise_or(pairs[..., 1].bitwise_left_shift(4)))
        return measured

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...] | None, out_dtype: str) -> dict[str, int]:
        """The thread's buffers (the bfloat16 copy, :func:`e2m1_codes`' and :func:`_on_grid`'s) and the
        temporaries torch allocates per chunk (an upper bound): the float32 values, codes, the release's codes,
        magnitudes and decoded values."""
        del scales, out_dtype
        n = math.prod(stored)
        return {"grid.bf16": n * 2, **e2m1_scratch(n), **_on_grid_scratch(n),
                "grid-nvfp4-temporaries": n * (4 + 4 + 4 + 4 + 8 + 4 + 4 + 2)}


@dataclass(frozen=True, slots=True)
class ReleaseRows(OneSourceRow):
    """A tensor of the release copied as it is (a scale, zero points, ``weight_shape``, a global or input scale):
    row ``k`` of the target is row ``k`` of ``tensor``; reads one source row (none is used)."""

    tensor: ReleaseTensor

    def decode(self, stored: torch.Tensor, scales: torch.Tensor | None, start: int, out: torch.Tensor,
               scratch: Scratch) -> None:
        del stored, scales, scratch
        rows = out.shape[0] if out.dim() else 1
        out.copy_(self.tensor.rows(start, start + rows).reshape(out.shape))

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...] | None, out_dtype: str) -> dict[str, int]:
        del stored, scales, out_dtype
        return {"release-rows": math.prod(self.tensor.shape) * itemsize(self.tensor.dtype)}


def grid_encoder(method: str, params: dict[str, object]) -> GridInt | GridNvfp4 | ReleaseRows | None:
    """The encoder ``method`` names with ``params``, or None for a method of another module."""
    if method not in METHODS:
        return None
    if method == RELEASE_ROWS:
        return ReleaseRows(params["tensor"])  # type: ignore[arg-type]
    if method == GRID_INT:
        return GridInt(str(params["name"]), int(params["bits"]), int(params["group"]),  # type: ignore[call-overload]
                       params["scale"], params.get("zero"), str(params.get("release", "")))  # type: ignore[arg-type]
    return GridNvfp4(str(params["name"]), bool(params["divide"]), params["scale"], params["glob"],  # type: ignore[arg-type]
                     params["packed"], str(params.get("release", "")))  # type: ignore[arg-type]
