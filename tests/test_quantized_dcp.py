"""An FP8 checkpoint saved by a real sharded producer: torch's DCP on 2 gloo ranks (torchrun), FP8 weights and their
float32 scales as DTensors (``q_proj`` ``Shard(0)``, ``o_proj`` ``Shard(1)``, on the 8x8 block boundaries; the rest
``Replicate()``), written by ``tests/fp8_dcp_worker.py``. Kept quantized it merges into the unsharded release byte
for byte; dequantized, into what torch's QuantizedHuggingFaceStorageReader gives; split inside a block, refused."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import load_output
from test_quantized import QWEN3, checkpoint
from test_quantized_merge import assert_bitwise, fp8_oracle

import ckpttool
from ckpttool.errors import ConfigError

WORKER = Path(__file__).resolve().parent / "fp8_dcp_worker.py"
Q = "model.layers.0.self_attn.q_proj.weight"


def save_with_dcp(out: Path, *flags: str) -> Path:
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                             str(WORKER), str(checkpoint(QWEN3)), str(out), *flags],
                            capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copyfile(checkpoint(QWEN3) / "config.json", out / "config.json")
    return out


@pytest.fixture(scope="module")
def dcp_fp8(tmp_path_factory):
    return save_with_dcp(tmp_path_factory.mktemp("dcp") / "checkpoint")


def test_torch_saved_fp8_dtensors_with_their_scales(dcp_fp8):
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(dcp_fp8)).read_metadata().state_dict_metadata
    assert meta[Q].properties.dtype == torch.float8_e4m3fn and len(meta[Q].chunks) == 2
    assert [c.offsets for c in meta[Q + "_scale_inv"].chunks] == [torch.Size([0, 0]), torch.Size([3, 0])]


def test_a_dcp_fp8_checkpoint_merges_kept_quantized_into_the_release_byte_for_byte(dcp_fp8, tmp_path):
    result = ckpttool.merge(dcp_fp8, tmp_path / "out")
    assert result.format == "dcp" and result.audit.ok
    assert_bitwise(load_output(tmp_path / "out"), load_output(checkpoint(QWEN3)))


def test_a_dcp_fp8_checkpoint_dequantizes_as_torchs_reader_does(dcp_fp8, tmp_path):
    ckpttool.merge(dcp_fp8, tmp_path / "out", dtype="bfloat16")
    assert_bitwise(load_output(tmp_path / "out"), fp8_oracle(QWEN3, torch.bfloat16))


def test_a_dcp_fp8_split_inside_a_block_is_refused(tmp_path):
    src = save_with_dcp(tmp_path / "checkpoint", "--unaligned")
    with pytest.raises(ConfigError, match=rf"'{Q}' \[48, 40\] is split at column 20 \(pieces in '__0_0.distcp', "
                       r"'__1_0.distcp'\), not on a 8-column block boundary"):
        ckpttool.merge(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()
