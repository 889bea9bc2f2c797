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
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import torch

from .formats import E8M0_BIAS, E8M0_NAN, FP4_VALUES

#: ``scratch(name, shape, dtype)``: a tensor of that shape and safetensors dtype on a reused per-thread buffer
Scratch = Callable[[str, tuple[int, ...], str], torch.Tensor]

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


@cache
def fp8_table(dtype: torch.dtype) -> torch.Tensor:
    """float32 value of each of the 256 codes of an FP8 dtype (exact; NaN codes are NaN)."""
    return torch.arange(256, dtype=torch.uint8).view(dtype).float()


def to_float32(stored: torch.Tensor, work: torch.Tensor, scratch: Scratch) -> torch.Tensor:
    """``work`` (float32, ``stored``'s shape) := ``stored``'s values, exactly. FP8 codes go through a 256-entry table:
    torch converts FP8 on the CPU one element at a time, several times slower than the gather."""
    if stored.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        return work.copy_(stored)
    index = scratch("index", (stored.numel(),), "I32").copy_(stored.contiguous().view(torch.uint8).reshape(-1))
    torch.index_select(fp8_table(stored.dtype), 0, index, out=work.view(-1))
    return work


def scale_values(scales: torch.Tensor, scratch: Scratch, ue8m0_bytes: bool) -> torch.Tensor:
    """Scales as float32 values: floats converted exactly, E8M0 (``float8_e8m0fnu``) by torch, and bytes as E8M0
    exponents when ``ue8m0_bytes``."""
    out = scratch("scale-f32", tuple(scales.shape), "F32")
    if scales.dtype == torch.uint8 and ue8m0_bytes:
        index = scratch("scale-index", (scales.numel(),), "I32").copy_(scales.reshape(-1))
        torch.index_select(e8m0_values(), 0, index, out=out.view(-1))
        return out
    return out.copy_(scales)


@dataclass(frozen=True, slots=True)
class Fp8Blocks:
    """FP8 values with one scale per ``block`` (rows x columns) of the last two dims, edge blocks cropped.

    A 2-D weight's rows map to scale rows ``start // B0 .. ceil(stop / B0)``; a stacked ``[E, O, I]`` weight's
    experts to the same scale experts.
    """

    block: tuple[int, int]
    ndim: int = 2
    ue8m0_bytes: bool = False

    def stored_rows(self, start: int, stop: int) -> tuple[int, int]:
        return start, stop

    def align(self, rows: int) -> int:
        return rows

    def scale_rows(self, start: int, stop: int) -> tuple[int, int]:
        if self.ndim > 2:
            return start, stop
        return start // self.block[0], -(-stop // self.block[0])

    def decode(self, stored: torch.Tensor, scales: torch.Tensor, start: int, out: torch.Tensor, scratch: Scratch) -> None:
        work = out if out.dtype == torch.float32 else scratch("work", tuple(stored.shape), "F32")
        to_float32(stored, work, scratch)  # exact: every FP8 value is a float32
        values = scale_values(scales, scratch, self.ue8m0_bytes)
        if self.ndim > 2:
            for e in range(stored.shape[0]):  # a stacked [E, O, I] weight: each expert is a matrix
                scale_blocks(work[e], values[e], 0, self.block)
        else:
            scale_blocks(work, values, start, self.block)
        if work is not out:
            out.copy_(work)  # one rounding, as the oracle's .to(dtype)

    def scratch_bytes(self, stored: tuple[int, ...], scales: tuple[int, ...], out_dtype: str) -> dict[str, int]:
        sizes = {"scale-f32": math.prod(scales) * 4, "scale-index": math.prod(scales) * 4 if self.ue8m0_bytes else 0,
                 "index": math.prod(stored) * 4}
        sizes["work"] = 0 if out_dtype == "F32" else math.prod(stored) * 4
        return sizes


def scale_blocks(work: torch.Tensor, scales: torch.Tensor, start: int, block: tuple[int, int], divide: bool = False) -> None:
    """Multiply (or ``divide``) rows ``start..`` of a ``[O, I]`` weight (``work``, float32, in place) by their
    blocks' scales (``scales``: rows ``start // B0 ..`` of the scale matrix).

    Each block row's scales are spread over the columns once (``[I]``, small) and the rows multiplied by that
    vector: a broadcast over a ``[.., I/B1, B1]`` view is 50 times slower with torch's two intra-op threads."""
    rows, cols = block
    per_column = scales.repeat_interleave(cols, dim=-1)[:, : work.shape[-1]]
    first = start // rows
    for k in range(scales.shape[0]):
        lo = max((first + k) * rows - start, 0)
        hi = min((first + k + 1) * rows - start, work.shape[0])
        if lo < hi:
            work[lo:hi].div_(per_column[k]) if divide else work[lo:hi].mul_(per_column[k])


@dataclass(frozen=True, slots=True)
class Mxfp4Groups:
    """MXFP4: ``[E, R, G, 16]`` bytes (two FP4 values each, low nibble first) and ``[E, R, G]`` E8M0 exponents give
    ``[E, R, G*32]`` values, written transposed as ``[E, G*32, R]`` when ``transpose`` (transformers' names for
    gpt-oss's experts). Rows are experts: one expert's rows of scales go with its blocks."""

    transpose: bool = True

    def stored_rows(self, start: int, stop: int) -> tuple[int, int]:
        return start, stop

    def align(self, rows: int) -> int:
        return rows

    def scale_rows(self, start: int, stop: int) -> tuple[int, int]:
        return start, stop

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
        return Fp8Blocks(block, int(options.get("ndim", 2)), bool(options.get("ue8m0_bytes", False)))  # type: ignore[arg-type]
    if method == MXFP4_GROUPS:
        return Mxfp4Groups(bool(options.get("transpose", True)))
    raise ValueError(f"no decoder {method!r}")

