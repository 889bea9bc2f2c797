"""Sharded quantized sources: a TP=2 split of the FP8 fixtures, written with ckpttool's sidecar API as a training
loop would, merges byte for byte into the unsharded release (each scale block moved with its weight block) and
dequantizes as torch's reader does; a split off the block boundaries is refused, naming tensor, split and block."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from conftest import load_output
from test_quantized import DEEPSEEK, QWEN3, checkpoint
from test_quantized_merge import assert_bitwise, fp8_oracle

import ckpttool
from ckpttool.errors import ConfigError
from ckpttool.io.sidecar import PieceSpec, save_shard

ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")  # split on columns, as Megatron and torch's TP plans do


def _cut(size: int, block: int, aligned: bool) -> int:
    """Where a 2-way split falls: after half the blocks (aligned), or at half the rows (as DTensor's Shard does)."""
    return math.ceil(math.ceil(size / block) / 2) * block if aligned else math.ceil(size / 2)


def write_tp2(fixture: str, directory: Path, aligned: bool = True) -> Path:
    """Every matrix split in 2 along its TP dim; an FP8 weight's scale along the same dim, at the weight's cut / block."""
    tensors = load_output(checkpoint(fixture))
    config = json.loads((checkpoint(fixture) / "config.json").read_text())
    block = config["quantization_config"]["weight_block_size"][0]
    ranks: list[tuple[dict, dict]] = [({}, {}), ({}, {})]
    for name, tensor in tensors.items():
        weight = name.removesuffix("_scale_inv")
        if tensor.ndim < 2:
            for local, specs in ranks:
                local[name], specs[name] = tensor, PieceSpec.replicated(tuple(tensor.shape))
            continue
        dim = 1 if weight.endswith(ROW_PARALLEL) else 0
        size = tensors[weight].shape[dim]
        cut = _cut(size, block, aligned) if weight in tensors and tensors[weight].dtype == torch.float8_e4m3fn else math.ceil(size / 2)
        if name != weight:  # a scale: its rows (or columns) of blocks
            cut = math.ceil(cut / block)
        for rank, (local, specs) in enumerate(ranks):
            lo, hi = (0, cut) if rank == 0 else (cut, tensor.shape[dim])
            local[name] = tensor.narrow(dim, lo, hi - lo)
            specs[name] = PieceSpec(tuple(tensor.shape), tuple(lo if d == dim else 0 for d in range(tensor.ndim)),
                                    coordinates=(("tp_rank", rank),))
    for rank, (local, specs) in enumerate(ranks):
        save_shard(local, specs, directory, rank=rank, world_size=2)
    shutil.copyfile(checkpoint(fixture) / "config.json", directory / "config.json")
    return directory


@pytest.mark.parametrize("fixture", [QWEN3, DEEPSEEK])
def test_a_tp_split_fp8_checkpoint_merges_into_the_release_byte_for_byte(tmp_path, fixture):
    source = write_tp2(fixture, tmp_path / "tp2")
    layout = ckpttool.read_layout(source)
    assert layout.format == "sidecar"
    assert all(len(t.pieces) == 2 for n, t in layout.tensors.items() if len(t.global_shape) == 2)
    ckpttool.merge(source, tmp_path / "kept")
    assert_bitwise(load_output(tmp_path / "kept"), load_output(checkpoint(fixture)))
    assert "quantization_config" in json.loads((tmp_path / "kept" / "config.json").read_text())


@pytest.mark.parametrize("fixture", [QWEN3, DEEPSEEK])
def test_a_tp_split_fp8_checkpoint_dequantizes_as_torchs_reader(tmp_path, fixture):
    ckpttool.merge(write_tp2(fixture, tmp_path / "tp2"), tmp_path / "out", dtype="bfloat16")
    assert_bitwise(load_output(tmp_path / "out"), fp8_oracle(fixture, torch.bfloat16))


def test_a_split_off_the_block_boundaries_is_refused_naming_tensor_split_and_block(tmp_path, cli):
    """DTensor's Shard(0) of the 24-row k_proj cuts at row 12, inside an 8-row block: which rows a shared block's
    scale was computed for cannot be told, so the merge refuses, and the audit reports each such weight."""
    source = write_tp2(QWEN3, tmp_path / "tp2", aligned=False)
    k_proj = "model.layers.0.self_attn.k_proj.weight"
    expected = (f"'{k_proj}' [24, 40] is split at row 12 (pieces in 'rank-00000-of-00002.safetensors', "
                "'rank-00001-of-00002.safetensors'), not on a 8-row block boundary (weight_block_size [8, 8] in "
                f"'{source / 'config.json'}'): the scale of the block holding rows 8..16 would serve two pieces")
    with pytest.raises(ConfigError) as e:
        ckpttool.merge(source, tmp_path / "api", dtype="bf16")
    assert expected in str(e.value)
    result = cli("merge", source, tmp_path / "out")
    assert result.exit_code == 1 and not (tmp_path / "out").exists() and expected in result.stderr
    findings = [f for f in ckpttool.audit(source, data=False).findings if f.code == "quant-split"]
    assert {f.tensor for f in findings} == {
        f"model.layers.{i}.{m}.weight" for i in (0, 1)
        for m in ("self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")}
    assert next(f.message for f in findings if f.tensor == k_proj).startswith(expected)
