"""Dequantization of a range of rows: the pure functions the streaming executor calls for a dequantizing merge.

A decoder turns rows ``start..stop`` of a stored (quantized) tensor, with the rows of its scales that
:meth:`scale_rows` names, into the same rows of the dequantized tensor, writing into ``out``. Every temporary it
needs comes from ``scratch(name, shape, dtype)`` (the executor's per-thread buffers, reused from chunk to chunk),
and :meth:`scratch_bytes` says how large each gets, so the executor's peak-memory prediction stays an upper bound.

The arithmetic is the one torch's ``QuantizedHuggingFaceStorageReader`` does, in the same order, so results are
bit for bit the same: FP8 ``float32(value) * float32(scale)`` rounded once to the output dtype (DeepSeek's
``weight_dequant`` too); MXFP4 ``FP4 value * 2 ** (byte - 127)``, exact in float32, rounded once. The one
difference: an E8M0 byte 0xFF is NaN here (the OCP MX definition), where torch and transformers compute
``2 ** 128`` (inf); the audit reports such scales.

A NaN or infinite scale would turn its whole block into NaN or infinity: :meth:`Fp8Blocks.bad_scale` and
:meth:`Mxfp4Groups.bad_scale` find the first among a chunk's scale rows, with the block it scales, and the executor
refuses to write that chunk (the audit, which counts such values, reads on).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

from ckpttool.fast.deferred import torch
from ckpttool.quant.formats import E8M0_BIAS, E8M0_NAN, FP4_VALUES, MXFP4_GROUP

#: ``scratch(name, shape, dtype)``: a tensor of that shape and safetensors dtype on a reused per-thread buffer
Scratch = Callable[[str, tuple[int, ...], str], "torch.Tensor"]

FP8_BLOCKS = "fp8-blocks"
MXFP4_GROUPS = "mxfp4"


@cache
def e8m0_values() -> torch.Tensor:
    """float32 value of each E8M0 byte: ``2 ** (byte - 127)``, exact down to ``2 ** -127``; 0xFF is NaN."""
    values = [math.ldexp(1.0, byte - E8M0_BIAS) for byte in range(256)]
    values[E8M0_NAN] = math.nan
    return torch.tensor(values, dtype=torch.float32)


@cache
def fp4_pairs() -> torch.Tensor:
    """For each byte, the float32 values of its two FP4 E2M1 codes, low nibble first: ``[256, 2]``."""
    return torch.tensor([[FP4_VALUES[b & 0x0F], FP4_VALUES[b >> 4]] for b in range(256)], dtype=torch.float32)


def to_float32(stored: torch.Tensor, work: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """``work`` (float32, ``stored``'s shape) := ``stored``'s values, exactly.

    FP8 codes are looked up two at a time (:func:`fp8_pairs`: one gather of 8 bytes per two codes, into ``work``
    seen as int64) with an index of half as many entries on the scratch buffer ``index``: torch converts FP8 on
    the CPU one element at a time, several times slower, and a 256-entry table looked up per code takes half as
    long again (measured with ``benchmarks/quant_bench.py --codec``)."""
    if str(stored.dtype) not in FP8_DTYPES:
        return work.copy_(stored)
    n = stored.numel()
    flat = work.view(-1)
    if flat.storage_offset() % 2:  # no int64 view of a float32 tensor at an odd offset (scratch tensors are not)
        return work.copy_(stored)
    codes = stored.contiguous().view(torch.uint8).reshape(-1)
    even = n - n % 2
    index = scratch("index", (even // 2,), "I32")
    if sys.byteorder == "little" and codes.storage_offset() % 2 == 0:
        index.copy_(codes[:even].view(torch.uint16))
    else:  # codes at an odd address (or a big-endian machine): the same index, computed
        index.copy_(codes[1:even:2]).mul_(256).add_(codes[0:even:2])
    torch.index_select(fp8_pairs(stored.dtype), 0, index, out=flat[:even].view(torch.int64))
    if n % 2:  # the last code has no pair
        flat[even:].copy_(stored.reshape(-1)[even:])
    return work


#: the torch FP8 dtypes by name (torch's own objects here would import torch with this module: ckpttool.fast.deferred)
FP8_DTYPES = ("torch.float8_e4m3fn", "torch.float8_e5m2")


@cache
def fp8_pairs(dtype: torch.dtype) -> torch.Tensor:
    """For each ``low + 256 * high`` (two FP8 codes, ``low`` at the lower address), the float32 values of both
    codes, ``low`` first, as one int64: ``[65536]`` (512 KiB). Exact, NaN payloads included: torch's own
    conversion of each code."""
    codes = torch.arange(65536, dtype=torch.int32)
    pairs = torch.stack((codes & 0xFF, codes >> 8), dim=1).to(torch.uint8)
    return pairs.view(dtype).float().view(torch.int64).reshape(-1)


def scale_values(scales: torch.Tensor, scratch: Scratch, ue8m0_bytes: bool) -> torch.Tensor:
    """Scales as float32 values: floats converted exactly, E8M0 (``float8_e8m0fnu``) by torch, and bytes as E8M0
    exponents when ``ue8m0_bytes``."""
    if scales.dtype == torch.float32:  # already their values (the caller's copy, not changed here)
        return scales
    out = scratch("scale-f32", tuple(scales.shape), "F32")
    if scales.dtype == torch.uint8 and ue8m0_bytes:
        index = scratch("scale-index", (scales.numel(),), "I32").copy_(scales.reshape(-1))
        torch.index_select(e8m0_values(), 0, index, out=out.view(-1))
        return out
    return out.copy_(scales)


@dataclass(frozen=True, slots=True)
class BadScale:
    """The first scale of a chunk's scale rows that no value may be dequantized with (see :func:`nonfinite`).

    Attributes:
        index: its index in the whole scale tensor.
        value: what it is: ``NaN``, ``inf``, ``-inf``, or ``0xFF (E8M0's NaN)``.
        block: the block of the weight it scales, in words: its block indices, rows and columns.
        count: how many of the chunk's scales no value may be dequantized with.
    """

    index: tuple[int, ...]
    value: str
    block: str
    count: int

    def message(self, weight: str, scale: str, file: str | None, rows: tuple[int, int]) -> str:
        """Why the weight ``weight`` is not dequantized: its scale tensor ``scale`` (in ``file``), whose ``rows``
        were read, holds this scale."""
        where = f" in '{file}'" if file else ""
        more = f" ({self.count} such scales in its rows {rows[0]}..{rows[1]})" if self.count > 1 else ""
        return (f"'{weight}': cannot dequantize {self.block}: its scale '{scale}'{list(self.index)}{where} is "
                f"{self.value}{more}, which would make every value of that block NaN or infinite. Quantize those "
                "blocks again from the original weights, or merge without a dtype to keep the checkpoint quantized; "
                "`ckpttool audit` lists every invalid scale")


def nonfinite(scales: torch.Tensor, e8m0_bytes: bool) -> torch.Tensor | None:
    """A mask of the ``scales`` that are NaN or infinite (E8M0, as ``float8_e8m0fnu`` or as bytes with
    ``e8m0_bytes``: the byte 0xFF, its NaN), or None when none is. One reduction over a chunk's scale rows, which
    are few: one scale per block (a 16384th of the values with 128x128 blocks).

    Raises:
        ValueError: scales of an integer dtype that are not E8M0 bytes (a bug: a plan is made only once
            :func:`ckpttool.quant.checks.check_tensors` found their dtype sound).
    """
    if not scales.numel():
        return None
    if (scales.dtype == torch.uint8 and e8m0_bytes) or str(scales.dtype) == E8M0_DTYPE:
        codes = scales.view(torch.uint8)
        return codes == E8M0_NAN if int(codes.max()) == E8M0_NAN else None  # 0xFF is the largest byte
    if not scales.is_floating_point():
        raise ValueError(f"scales of dtype {scales.dtype} are not a scale format a decoder reads")
    finite = torch.isfinite(scales)
    return None if bool(finite.all()) else ~finite


#: torch's E8M0 dtype by name (see :data:`FP8_DTYPES`)
E8M0_DTYPE = "torch.float8_e8m0fnu"


def _first_bad(scales: torch.Tensor, mask: torch.Tensor, e8m0_bytes: bool) -> tuple[tuple[int, ...], str, int]:
    """The index (in ``scales``) of the first scale ``mask`` marks, what it is, and how many are marked."""
    local = tuple(int(i) for i in mask.nonzero()[0])
    if (scales.dtype == torch.uint8 and e8m0_bytes) or str(scales.dtype) == E8M0_DTYPE:
        return local, "0xFF (E8M0's NaN)", int(mask.sum())
    value = float(scales[local])
    return local, "NaN" if math.isnan(value) else repr(value), int(mask.sum())


class RowForRow:
    """The row methods every decoder has, as identities: output row ``k`` reads stored row ``k`` and scale row ``k``
    (experts of MXFP4, rows of packed 4-bit weights), so a chunk may start and stop at any row. A decoder whose scale
    row covers several rows (FP8 blocks) redefines :meth:`scale_rows`."""

    __slots__ = ()

    def stored_rows(self, start: int, stop: int) -> tuple[int, int]:
        return start, stop

    def align(self, rows: int) -> int:
        return rows

    def scale_rows(self, start: int, stop: int) -> tuple[int, int]:
        return start, stop


@dataclass(frozen=True, slots=True)
class Fp8Blocks(RowForRow):
    """FP8 values with one scale per ``block`` (rows x columns) of the last two dims, edge blocks cropped.

    A 2-D weight's rows map to scale rows ``start // B0 .. ceil(stop / B0)``; a stacked ``[E, O, I]`` weight's
    experts to the same scale experts.

    ``origin``: where the stored tensor, a box of a larger weight (a TP shard: rows 288..576 of 576 at TP2), starts in
    its first block (row, column); its scales are those of every block it meets. Row ``k`` is scaled as block row
    ``origin[0] + k``, column ``j`` as ``origin[1] + j``.
    """

    block: tuple[int, int]
    ndim: int = 2
    ue8m0_bytes: bool = False
    origin: tuple[int, int] = (0, 0)

    def scale_rows(self, start: int, stop: int) -> tuple[int, int]:
        if self.ndim > 2:
            return start, stop
        shift = self.origin[0]
        return (start + shift) // self.block[0], -(-(stop + shift) // self.block[0])

    def bad_scale(self, scales: torch.Tensor, start: int, stored: tuple[int, ...]) -> BadScale | None:
        """The first scale among the rows :meth:`scale_rows` gave for rows ``start..`` of a weight ``stored``
        that is NaN or infinite (:func:`nonfinite`), with the block it scales; None when every one is finite."""
        mask = nonfinite(scales, self.ue8m0_bytes)
        if mask is None:
            return None
        local, value, count = _first_bad(scales, mask, self.ue8m0_bytes)
        # a stacked weight's scale rows are its experts; a matrix's start at the block row of ``start``
        (o0, o1), (b0, b1) = self.origin, self.block
        index = (start + local[0], *local[1:]) if self.ndim > 2 else ((start + o0) // b0 + local[0], local[1])
        *lead, i, j = index
        rows, cols = stored[-2:]  # the block's rows and columns in the stored tensor (a box: those it holds)
        block = (f"{f'expert {lead[0]}, ' if lead else ''}row block {i}, column block {j} (rows {max(i * b0 - o0, 0)}.."
                 f"{min((i + 1) * b0 - o0, rows)}, columns {max(j * b1 - o1, 0)}..{min((j + 1) * b1 - o1, cols)})")
        return BadScale(index, value, block, count)

    def decode(self, stored: torch.Tensor, scales: torch.Tensor, start: int, out: torch.Tensor, scratch: Scratch) -> None:
        values = scale_values(scales, scratch, self.ue8m0_bytes)
        if self.ndim > 2:
            for e in range(stored.shape[0]):  # a stacked [E, O, I] weight: each expert is a matrix
                self._decode_matrix(stored[e], values[e], self.origin[0], out[e], scratch)
        else:
            self._decode_matrix(stored, values, start + self.origin[0], out, scratch)

    def _decode_matrix(self, stored: torch.Tensor, scales: torch.Tensor, start: int, out: torch.Tensor,
                       scratch: Scratch) -> None:
        """Rows ``start..`` (counted from the first block row ``scales`` holds) of a ``[O, I]`` weight, a slab of whole
        block rows at a time: float32 values, times
        their scales in place, rounded once into ``out`` (the oracle's ``.to(dtype)``), while the slab is in the
        CPU's cache. No temporary as large as the chunk, and no allocation: torch's mixed-dtype ``mul`` into a
        bfloat16 ``out`` would allocate two float32 temporaries per call."""
        slab, rows, first = self._slab_rows(stored.shape[-1]), self.block[0], start // self.block[0]
        direct = out.dtype == torch.float32 and out.is_contiguous()  # float32 out: the values computed in place
        lo = 0
        while lo < stored.shape[0]:
            hi = min(stored.shape[0], (start + lo) // slab * slab + slab - start)  # slabs on block-row bounds
            work = to_float32(stored[lo:hi], out[lo:hi] if direct else scratch("work", (hi - lo, stored.shape[-1]), "F32"),
                              scratch)
            k0, k1 = (start + lo) // rows - first, -(-(start + hi) // rows) - first
            scale_blocks(work, scales[k0:k1], start + lo, self.block, column=self.origin[1])
            if not direct:
                out[lo:hi].copy_(work)
            lo = hi

    def _slab_rows(self, columns: int) -> int:
        """Rows per slab: whole block rows, about :data:`SLAB_ELEMENTS` values."""
        rows = self.block[0]
        return max(1, SLAB_ELEMENTS // max(columns * rows, 1)) * rows

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...], out_dtype: str) -> dict[str, int]:
        del out_dtype
        slab = min(stored[-2], self._slab_rows(stored[-1])) * stored[-1]
        return {"scale-f32": math.prod(scales) * 4, "scale-index": math.prod(scales) * 4 if self.ue8m0_bytes else 0,
                "index": slab // 2 * 4, "work": slab * 4}


#: the most values :func:`scale_blocks` scales with one broadcast call (a small weight, where calls cost most)
SMALL_ELEMENTS = 1 << 16
#: values per slab of the FP8 block decoder (2 MiB of float32: a slab stays in a core's cache between passes)
SLAB_ELEMENTS = 1 << 19


def scale_blocks(work: torch.Tensor, scales: torch.Tensor, start: int, block: tuple[int, int], divide: bool = False,
                 column: int = 0) -> None:
    """Multiply (or ``divide``) rows ``start..`` of a ``[O, I]`` weight (``work``, float32, in place) by their
    blocks' scales (``scales``: rows ``start // B0 ..`` of the scale matrix). ``column``: where ``work``'s first
    column lies in the first column block (a box of a weight that starts inside a block; 0 otherwise).

    Each block row's scales are spread over the columns once (``[I]``, small) and the rows multiplied by that
    vector: a broadcast over a ``[.., I/B1, B1]`` view is 50 times slower with torch's two intra-op threads."""
    rows, cols = block
    # a block wider than the weight has one scale column: spread it over the weight's columns, not the block's
    # (the same values; a width from a config is never an allocation's size)
    cols = min(cols, column + work.shape[-1])
    per_column = scales.repeat_interleave(cols, dim=-1)[:, column: column + work.shape[-1]]
    if (start % rows == 0 and work.shape[0] == scales.shape[0] * rows and work.numel() <= SMALL_ELEMENTS
            and work.is_contiguous()):
        # whole block rows of a small weight: one call (the same products), not one per block row
        blocked, factors = work.view(scales.shape[0], rows, work.shape[-1]), per_column.unsqueeze(1)
        blocked.div_(factors) if divide else blocked.mul_(factors)
        return
    first = start // rows
    for k in range(scales.shape[0]):
        lo = max((first + k) * rows - start, 0)
        hi = min((first + k + 1) * rows - start, work.shape[0])
        if lo < hi:
            work[lo:hi].div_(per_column[k]) if divide else work[lo:hi].mul_(per_column[k])


@dataclass(frozen=True, slots=True)
class Mxfp4Groups(RowForRow):
    """MXFP4: ``[E, R, G, 16]`` bytes (two FP4 values each, low nibble first) and ``[E, R, G]`` E8M0 exponents give
    ``[E, R, G*32]`` values, written transposed as ``[E, G*32, R]`` when ``transpose`` (transformers' names for
    gpt-oss's experts). Rows are experts: one expert's rows of scales go with its blocks."""

    transpose: bool = True

    def bad_scale(self, scales: torch.Tensor, start: int, stored: tuple[int, ...]) -> BadScale | None:
        """The first E8M0 byte 0xFF (NaN) among the scales of experts ``start..``, with the group of values it
        scales; None when there is none."""
        mask = nonfinite(scales, True)
        if mask is None:
            return None
        local, value, count = _first_bad(scales, mask, True)
        e, r, g = start + local[0], local[1], local[2]
        first = g * MXFP4_GROUP
        span = f"{first}:{first + MXFP4_GROUP}"
        named = f"[{e}, {span}, {r}]" if self.transpose else f"[{e}, {r}, {span}]"
        del stored  # the index says it all: a group is 32 values of one row of one expert
        return BadScale((e, r, g), value, f"expert {e}, row {r}, group {g} (the {MXFP4_GROUP} values {named} of the "
                        "dequantized tensor)", count)

    def decode(self, stored: torch.Tensor, scales: torch.Tensor, start: int, out: torch.Tensor, scratch: Scratch) -> None:
        del start  # blocks and scales share their leading dims
        experts, rows, groups, width = stored.shape
        index = scratch("index", (stored.numel(),), "I32").copy_(stored.reshape(-1))
        work = scratch("work", (stored.numel(), 2), "F32")
        torch.index_select(fp4_pairs(), 0, index, out=work)
        values = work.view(experts, rows, groups, 2 * width)
        values.mul_(scale_values(scales, scratch, True).unsqueeze(-1))  # exact: a power of two
        flat = values.view(experts, rows, groups * 2 * width)
        out.copy_(flat.transpose(1, 2) if self.transpose else flat)

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...], out_dtype: str) -> dict[str, int]:
        del out_dtype
        n = math.prod(stored)
        return {"index": n * 4, "work": n * 2 * 4, "scale-f32": math.prod(scales) * 4, "scale-index": math.prod(scales) * 4}


Decoder = Fp8Blocks | Mxfp4Groups


def decoder(method: str, params: tuple[tuple[str, object], ...]) -> Decoder:
    """The decoder a plan's ``Dequantize(method, params)`` names.

    Raises:
        ValueError: an unknown method (a bug: plans are made by :mod:`ckpttool.families.quantized`).
    """
    options = dict(params)
    if method == FP8_BLOCKS:
        block = tuple(options["block"])  # type: ignore[call-overload]
        return Fp8Blocks(block, int(options.get("ndim", 2)), bool(options.get("ue8m0_bytes", False)),  # type: ignore[arg-type]
                         tuple(options.get("origin", (0, 0))))  # type: ignore[arg-type, call-overload]
    if method == MXFP4_GROUPS:
        return Mxfp4Groups(bool(options.get("transpose", True)))
    raise ValueError(f"no decoder {method!r}")

