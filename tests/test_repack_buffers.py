"""Re-packing with a release's scales (``--scales-from``) works in the thread's predicted buffers: the codes, their
dequantized values, the float32 comparison with the source and the int64 words live on per-thread ``grid.*`` /
``int-words`` buffers, never in fresh ``[rows, width]`` tensors per chunk (a 1.15 GiB BF16 model re-packed to INT4
with 2 workers peaked at 1174 MiB before, 842 MiB after, 615 MiB above torch's start-up against 629 MiB predicted;
bytes unchanged)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import FIXTURES, build_in_row_chunks
from safetensors.torch import load_file

from ckpttool.commands.merge import prepare
from ckpttool.commands.release import read_release
from ckpttool.families.quantize import quantize_block

pytestmark = pytest.mark.usefixtures("describe_inline")

GRID = ("grid.codes", "grid.values", "grid.source", "grid.decoded", "grid.error", "grid.bad", "int-words")


def packed_targets(fixture: str, method: str, layer: str):
    release = read_release(FIXTURES / fixture / "checkpoint")
    plan = prepare(FIXTURES / fixture / "reference", quantize=replace(quantize_block(method, None, None),
                                                                       release=release)).plan
    return plan, [t for t in plan.targets if t.name.startswith(layer)]


@pytest.mark.parametrize(("fixture", "method"), [("quantized_qwen3_int4", "int4"),
                                                 ("quantized_llama_int4_asym", "int4-asym")])
def test_int4_repack_uses_the_grid_buffers_within_their_prediction_and_gives_the_release(fixture, method):
    plan, targets = packed_targets(fixture, method, "model.layers.0.mlp.")
    packed = [t for t in targets if t.name.endswith(".weight_packed")]
    assert packed
    parts, sizes, allocated = build_in_row_chunks(plan, packed, 5)
    for name in GRID:
        assert 0 < allocated.get(name, 0) <= sizes[name], name
    want = load_file(FIXTURES / fixture / "checkpoint" / "model.safetensors")
    for name, chunks in parts.items():
        assert torch.equal(torch.cat(chunks), want[name]), name


def test_nvfp4_repack_compares_on_the_grid_buffers_and_gives_the_release():
    plan, targets = packed_targets("quantized_qwen3_nvfp4", "nvfp4", "model.layers.0.self_attn.")
    packed = [t for t in targets if t.name.endswith(".weight_packed")]
    assert packed
    parts, sizes, allocated = build_in_row_chunks(plan, packed, 4)
    for name in ("grid.source", "grid.decoded", "grid.error", "grid.bad"):
        assert 0 < allocated.get(name, 0) <= sizes[name], name
    want = load_file(FIXTURES / "quantized_qwen3_nvfp4" / "checkpoint" / "model.safetensors")
    for name, chunks in parts.items():
        assert torch.equal(torch.cat(chunks), want[name]), name
