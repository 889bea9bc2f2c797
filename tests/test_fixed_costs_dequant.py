"""The per-tensor shortcuts of dequantizing (a merge given a dtype, the audit's data checks of a quantized
checkpoint) give what the general paths give: rows read whole from their piece, one broadcast over the block rows
of a small weight, codecs and scratch tensors reused, and the audit's dequantized targets planned alone."""

from __future__ import annotations

import pytest
import torch
from test_quantized import DEEPSEEK, GPT_OSS, QWEN3, checkpoint

import ckpttool
import ckpttool.execute.assembly as executor  # where the chunk builder and its _read_rows live
from ckpttool.execute.reads import Reader
from ckpttool.execute.buffers import buffer_sizes, chunks, piece_uses
from ckpttool.execute.assembly import build
from ckpttool.commands.source import plan_source
from ckpttool.families.source import dequantized_targets, plan_layout
from ckpttool.quant import decode
from ckpttool.quant.codecs import codec
from ckpttool.quant.decode import scale_blocks


def _built(plan, rows, monkeypatch, fast: bool) -> tuple[dict[str, bytes], int]:
    """Every dequantized target's bytes, chunk by chunk, with or without the whole-rows read; and how many reads
    took it."""
    taken = [0]
    general = executor._read_rows

    def read_rows(*args):
        found = general(*args) if fast else None
        taken[0] += found is not None
        return found

    monkeypatch.setattr(executor, "_read_rows", read_rows)
    targets = [t for t in plan.targets if t.dequant is not None]
    every = [c for t in targets for c in chunks(t, 0, rows=rows)]
    reader = Reader(plan.root, piece_uses(every), buffer_sizes(every))
    out: dict[str, bytes] = {t.name: b"" for t in targets}
    try:
        for chunk in every:
            out[chunk.target.name] += build(chunk, reader).contiguous().view(torch.uint8).numpy().tobytes()
    finally:
        reader.close()
    return out, taken[0]


@pytest.mark.parametrize("fixture", [QWEN3, DEEPSEEK, GPT_OSS])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("rows", [None, 3])
def test_rows_read_whole_give_what_the_regions_give(monkeypatch, fixture, dtype, rows):
    plan = ckpttool.prepare(checkpoint(fixture), dtype=dtype).plan
    fast, taken = _built(plan, rows, monkeypatch, fast=True)
    general, none = _built(plan, rows, monkeypatch, fast=False)
    assert fast == general and fast and none == 0
    assert taken > 0  # the shortcut was taken


def test_only_one_raw_piece_holding_the_whole_tensor_is_read_whole():
    plan = ckpttool.prepare(checkpoint(DEEPSEEK), dtype="float32").plan
    target = next(t for t in plan.targets if t.dequant is not None and t.scale is not None)
    reader = Reader(plan.root, piece_uses([]), {})
    try:
        whole = executor.row_box(target.dequant.stored, 0, target.dequant.stored[0])
        assert executor._read_rows(target.copies, whole, target.source_dtype, reader, "chunk") is not None
        assert executor._read_rows(target.copies, whole, "BF16", reader, "chunk") is None  # another dtype
        assert executor._read_rows(target.copies * 2, whole, target.source_dtype, reader, "chunk") is None
        beyond = executor.row_box(target.dequant.stored, 1, target.dequant.stored[0] + 1)
        assert executor._read_rows(target.copies, beyond, target.source_dtype, reader, "chunk") is None
    finally:
        reader.close()


@pytest.mark.parametrize("divide", [False, True])
@pytest.mark.parametrize("shape,start,block", [((32, 16), 0, (16, 16)), ((48, 37), 32, (16, 8)), ((16, 5), 0, (16, 4))])
def test_one_broadcast_over_block_rows_gives_the_products_of_the_loop(monkeypatch, divide, shape, start, block):
    g = torch.Generator().manual_seed(3)
    values = torch.randn(shape, generator=g) * 100
    grid = (shape[0] // block[0], -(-shape[1] // block[1]))
    scales = torch.rand(grid, generator=g).add_(1e-3)
    scales.view(-1)[:3] = torch.tensor([0.0, float("nan"), float("inf")])[: scales.numel()]
    broadcast, looped = values.clone(), values.clone()
    scale_blocks(broadcast, scales, start, block, divide=divide)
    monkeypatch.setattr(decode, "SMALL_ELEMENTS", 0)
    scale_blocks(looped, scales, start, block, divide=divide)
    assert torch.equal(broadcast.view(torch.int32), looped.view(torch.int32))


def test_a_float32_out_is_decoded_in_place_with_the_bits_it_gets_through_the_work_buffer():
    """float32 ``out`` takes the values directly; the same values as the decoder writes through its work buffer."""
    stored = torch.randint(0, 256, (40, 24), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    stored = stored.view(torch.float8_e4m3fn)
    scales = torch.rand(3, 3, generator=torch.Generator().manual_seed(5))
    direct = torch.empty(40, 24)
    through = torch.empty(40, 24).t().contiguous().t()  # not contiguous: decoded through the work buffer

    def scratch(name, shape, dtype):
        return torch.empty(shape, dtype={"F32": torch.float32, "I32": torch.int32}[dtype])

    decode.Fp8Blocks((16, 8)).decode(stored, scales, 0, direct, scratch)
    decode.Fp8Blocks((16, 8)).decode(stored, scales, 0, through, scratch)
    assert torch.equal(direct.view(torch.int32), through.contiguous().view(torch.int32))


def test_codecs_are_made_once_per_method_and_parameters():
    params = (("block", (16, 16)), ("ndim", 2), ("ue8m0_bytes", False))
    assert codec("fp8-blocks", params) is codec("fp8-blocks", params)
    assert codec("fp8-blocks", (("block", [16, 8]),)).block == (16, 8)  # unhashable parameters: made each time
    with pytest.raises(ValueError):
        codec("no-such-codec", ())


def test_scratch_tensors_are_reused_until_their_buffer_grows(tmp_path):
    reader = Reader(tmp_path, piece_uses([]), {"work": 64})
    first = reader.scratch("work", (4, 4), "F32")
    assert reader.scratch("work", (4, 4), "F32") is first
    first.fill_(1.0)
    larger = reader.scratch("work", (8, 8), "F32")  # a new buffer: the views of the old one are dropped
    larger.fill_(2.0)
    again = reader.scratch("work", (4, 4), "F32")
    assert again is not first and torch.equal(again, torch.full((4, 4), 2.0))


@pytest.mark.parametrize("fixture", [QWEN3, DEEPSEEK, GPT_OSS])
def test_the_audits_dequantized_targets_are_those_of_a_whole_plan(fixture):
    merged = plan_source(checkpoint(fixture))
    assert merged.specs is None  # a merge does not hold them
    with pytest.raises(ValueError):
        dequantized_targets(merged, "F32")
    planned = plan_layout(merged.layout, config_path=merged.config_path, config=merged.config, model=merged.model,
                          keep_specs=True)
    assert planned.plan == merged.plan
    full = plan_layout(planned.layout, config_path=planned.config_path, config=planned.config, model=planned.model,
                       dtype="F32").plan
    expected = tuple(t for t in full.targets if t.dequant is not None)
    assert expected and sorted(dequantized_targets(planned, "F32"), key=lambda t: t.name) == sorted(
        expected, key=lambda t: t.name)
