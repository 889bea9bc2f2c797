"""The FP8 block decoder against its definition, bit for bit: ``float32(value) * float32(scale)`` rounded once to
the output dtype, for every FP8 code (NaN codes and their payloads included), every output dtype, odd sizes and
codes at odd addresses (the two ways the pair index is made), and rows that start inside a block."""

from __future__ import annotations

import math

import pytest
import torch

from ckpttool.quant import decode
from ckpttool.quant.decode import Fp8Blocks, fp8_pairs, to_float32

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}


def scratch_buffers():
    """A scratch like the executor's: one byte buffer per name, reused, at the requested shape and dtype."""
    buffers: dict[str, torch.Tensor] = {}
    dtypes = {"F32": torch.float32, "I32": torch.int32, "BF16": torch.bfloat16}

    def scratch(name, shape, dtype):
        nbytes = math.prod(shape) * dtypes[dtype].itemsize
        if name not in buffers or buffers[name].numel() < nbytes:
            buffers[name] = torch.empty(max(nbytes, 1), dtype=torch.uint8)
        return buffers[name][:nbytes].view(dtypes[dtype]).reshape(shape)

    return scratch


def fp8_codes(shape, dtype, offset=0, seed=0):
    """Every one of the 256 codes (then seeded random ones), as ``dtype`` at byte ``offset`` of a buffer."""
    n = math.prod(shape)
    raw = torch.randint(0, 256, (n + offset,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    every = torch.arange(256, dtype=torch.uint8)[:n]
    raw[offset : offset + len(every)] = every
    return raw[offset:].view(dtype).view(shape)


def oracle(stored, scales, start, block, out_dtype):
    """The definition: each value in float32 times its block's float32 scale, rounded once (``scales`` from the
    block row of ``start``)."""
    rows, cols = block
    first = start // rows
    per_row = scales.repeat_interleave(rows, dim=0)[start - first * rows :][: stored.shape[0]]
    per_element = per_row.repeat_interleave(cols, dim=1)[:, : stored.shape[1]]
    return (stored.float() * per_element).to(out_dtype)


def same_bits(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("shape,offset,start", [((256, 256), 0, 0), ((256, 256), 1, 0), ((37, 45), 0, 0),
                                                ((37, 45), 1, 0), ((300, 129), 0, 128), ((1, 1), 1, 0)])
def test_fp8_blocks_decode_is_the_float32_product_rounded_once(fp8, out_dtype, shape, offset, start):
    """Odd sizes (a last code without a pair) and odd offsets (codes not readable as uint16) included; scales of
    zero, NaN, inf, a negative and a huge one among random ones."""
    block = (128, 128)
    stored = fp8_codes(shape, fp8, offset, seed=shape[0])
    grid = (math.ceil((start + shape[0]) / block[0]), math.ceil(shape[1] / block[1]))
    scales = torch.rand(grid, generator=torch.Generator().manual_seed(1)).mul_(1e-3).add_(1e-6)
    specials = torch.tensor([0.0, math.nan, math.inf, -1.5, 3e38, 1e-40])
    scales.view(-1)[: min(6, scales.numel())] = specials[: scales.numel()]
    first = start // block[0]
    out = torch.full(shape, 7, dtype=out_dtype)
    Fp8Blocks(block).decode(stored, scales[first:], start, out, scratch_buffers())
    assert same_bits(out, oracle(stored, scales[first:], start, block, out_dtype))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("count,offset,work_offset", [(256, 0, 0), (257, 0, 0), (257, 1, 0), (256, 1, 0), (255, 0, 1)])
def test_fp8_codes_become_their_float32_values_exactly_nan_payloads_included(fp8, count, offset, work_offset):
    """Every code, in pairs at even and odd addresses, an odd last code, and a float32 ``work`` at an odd offset."""
    codes = fp8_codes((count,), fp8, offset)
    work = torch.full((count + work_offset,), 7.0)[work_offset:]
    assert to_float32(codes, work, scratch_buffers()) is work
    assert torch.equal(work.view(torch.int32), codes.float().view(torch.int32))
    assert fp8_pairs(fp8).shape == (65536,) and fp8_pairs(fp8).dtype == torch.int64


@pytest.mark.parametrize("slab", [1 << 19, 300, 1])
def test_slabs_of_block_rows_give_the_same_bits(monkeypatch, slab):
    """A chunk that starts inside a block, decoded a slab at a time (one block row, or a few), as a whole."""
    monkeypatch.setattr(decode, "SLAB_ELEMENTS", slab)
    block, start = (16, 8), 40
    stored = fp8_codes((75, 21), torch.float8_e4m3fn, seed=5)
    scales = torch.rand(8, 3, generator=torch.Generator().manual_seed(6))
    out = torch.empty(75, 21, dtype=torch.bfloat16)
    Fp8Blocks(block).decode(stored, scales[start // 16 :], start, out, scratch_buffers())
    assert same_bits(out, oracle(stored, scales[start // 16 :], start, block, torch.bfloat16))


def test_stacked_experts_and_e8m0_byte_scales_decode_as_defined():
    stored = fp8_codes((3, 200, 260), torch.float8_e4m3fn, seed=3)
    scales = torch.rand(3, 2, 3, generator=torch.Generator().manual_seed(2))
    out = torch.empty(3, 200, 260, dtype=torch.bfloat16)
    Fp8Blocks((128, 128), ndim=3).decode(stored, scales, 0, out, scratch_buffers())
    for e in range(3):
        assert same_bits(out[e], oracle(stored[e], scales[e], 0, (128, 128), torch.bfloat16))
    exponents = torch.randint(100, 140, (2, 3), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    out = torch.empty(200, 260, dtype=torch.bfloat16)
    Fp8Blocks((128, 128), ue8m0_bytes=True).decode(stored[0], exponents, 0, out, scratch_buffers())
    powers = torch.ldexp(torch.ones(2, 3), exponents.int() - 127)
    assert same_bits(out, oracle(stored[0], powers, 0, (128, 128), torch.bfloat16))


def test_the_decoder_declares_every_temporary_it_uses():
    """The memory prediction reads scratch_bytes: each buffer the decoder asks for is declared, at that size."""
    asked: dict[str, int] = {}
    inner = scratch_buffers()

    def scratch(name, shape, dtype):
        tensor = inner(name, shape, dtype)
        asked[name] = max(asked.get(name, 0), tensor.numel() * tensor.element_size())
        return tensor

    stored = fp8_codes((37, 45), torch.float8_e4m3fn)
    out = torch.empty(37, 45, dtype=torch.bfloat16)
    Fp8Blocks((16, 16)).decode(stored, torch.ones(3, 3), 0, out, scratch)
    declared = Fp8Blocks((16, 16)).scratch_bytes((37, 45), (3, 3), "BF16")
    assert asked and all(asked[name] <= declared[name] for name in asked)
    assert declared["work"] == 37 * 45 * 4 and declared["index"] == 37 * 45 // 2 * 4
    slab = Fp8Blocks((128, 128)).scratch_bytes((11008, 7168), (86, 56), "BF16")  # a slab, not the chunk
    assert slab["work"] == 128 * 7168 * 4 and slab["index"] == 128 * 7168 // 2 * 4


def test_the_fp8_encoder_declares_its_round_trip_index_at_one_entry_per_two_codes():
    """Quantizing reads its FP8 codes back through the same pair lookup: half the index the per-code table took."""
    from ckpttool.quant.encode import Fp8Values

    asked: dict[str, int] = {}
    inner = scratch_buffers()

    def scratch(name, shape, dtype):
        tensor = inner(name, shape, dtype)
        asked[name] = max(asked.get(name, 0), tensor.numel() * tensor.element_size())
        return tensor

    source = torch.randn(32, 48, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    out = torch.empty(32, 48, dtype=torch.float8_e4m3fn)
    trip = Fp8Values((16, 16)).decode(source, None, 0, out, scratch)
    declared = Fp8Values((16, 16)).scratch_bytes((32, 48), None, "F8_E4M3")
    assert declared["index"] == 32 * 48 // 2 * 4 and asked["index"] == declared["index"]
    assert trip.relative_error < 0.1
