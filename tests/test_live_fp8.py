"""Live gather (``ckpttool.live.save_hf``) of FP8 weights with their scales, from real sharded jobs on gloo.

Each rank holds what a transformers FP8 model holds (``tests/live_fp8_worker.py``): ``float8_e4m3fn`` weights and
float32 ``weight_scale_inv`` tensors as parameters of transformers' own ``FP8Linear``, loaded from a checkpoint
``ckpttool merge --quantize fp8`` wrote from the reference Llama, then sharded with DTensor TP or FSDP2. gloo's
collectives refuse float8 ("Invalid scalar type"); the live gather sends pieces point to point, which gloo moves
as bytes. The output must be the unsharded quantized checkpoint byte for byte (weights, scales and
``quantization_config``), and a split inside a block must be refused on every rank with the tensor, the split and
the block size named.
"""

from __future__ import annotations

import json
import socket
from pathlib import Path

import pytest
import torch
from conftest import fixture_dir, load_output
from fork_client import launch_ranks
from test_live import digests

import ckpttool

WORKER = Path(__file__).resolve().parent / "live_fp8_worker.py"
LLAMA = fixture_dir("llama_fsdp2_dcp") / "reference"


def launch(world: int, out: Path, *scenarios: str, timeout: float = 300) -> tuple[list[int], list[str]]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return launch_ranks(WORKER, [["--rank", r, "--world", world, "--port", port, "--out", out, *scenarios]
                                 for r in range(world)], timeout)


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("live_fp8")
    for block in (8, 16):  # the unsharded quantized references the ranks load
        ckpttool.merge(LLAMA, out / f"q{block}", quantize="fp8", block=block)
    codes, outputs = launch(2, out, "fp8_tp", "fp8_tp_dequantized", "fp8_fsdp2", "fp8_unaligned")
    assert codes == [0, 0], "\n".join(outputs)
    return out, outputs


def test_the_ranks_hold_fp8_dtensors_with_their_scales(two):
    # what the worker checked before saving is in its reference: FP8 values and float32 scales
    tensors = load_output(two[0] / "q8")
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
    assert tensors["model.layers.0.self_attn.q_proj.weight_scale_inv"].shape == (4, 4)


def test_tensor_parallel_fp8_is_the_unsharded_quantized_checkpoint_byte_for_byte(two):
    out = two[0]
    assert (out / "fp8_tp" / "model.safetensors").read_bytes() == (out / "q8" / "model.safetensors").read_bytes()
    config = json.loads((out / "fp8_tp" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((out / "q8" / "config.json").read_text())["quantization_config"]
    assert config["quantization_config"]["weight_block_size"] == [8, 8]


def test_fsdp2_fp8_written_by_every_rank_equals_the_offline_merge(two, tmp_path):
    out, outputs = two
    ckpttool.merge(out / "q8", tmp_path / "offline", max_shard_size="30KB")
    assert digests(out / "fp8_fsdp2") == digests(tmp_path / "offline")
    assert len(list((out / "fp8_fsdp2").glob("model-*.safetensors"))) > 1
    assert "WRITERS [0, 1]" in outputs[0]


def test_tensor_parallel_fp8_dequantized_equals_the_offline_dequantizing_merge(two, tmp_path):
    """Scales travel with their weights to the writer; the offline merge equals torch's reader (test_quantized_merge)."""
    out = two[0]
    ckpttool.merge(out / "q8", tmp_path / "offline", dtype="bfloat16", max_shard_size="30KB")
    assert digests(out / "fp8_tp_bf16") == digests(tmp_path / "offline")
    tensors = load_output(out / "fp8_tp_bf16")
    assert not any(n.endswith("_scale_inv") for n in tensors)
    assert tensors["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert "quantization_config" not in json.loads((out / "fp8_tp_bf16" / "config.json").read_text())


def test_one_process_dequantizes_bucket_by_bucket(tmp_path):
    """Buckets far smaller than the model: a weight and its scales arrive together."""
    from safetensors.torch import load_file

    from ckpttool.live import save_hf

    ckpttool.merge(LLAMA, tmp_path / "q8", quantize="fp8", block=8)
    ckpttool.merge(tmp_path / "q8", tmp_path / "offline", dtype="float32", max_shard_size="20KB")
    config = json.loads((tmp_path / "q8" / "config.json").read_text())
    result = save_hf(load_file(tmp_path / "q8" / "model.safetensors"), tmp_path / "live", config=config,
                     dtype="float32", max_shard_size="20KB", bucket_bytes=8 * 1024)
    assert digests(tmp_path / "live") == digests(tmp_path / "offline")
    assert any("dequantized the fp8 F8_E4M3 with 8x8 blocks" in note for note in result.plan.notes)


def test_a_split_inside_an_fp8_block_is_refused_on_every_rank(two):
    out, outputs = two
    for rank, text in enumerate(outputs):
        assert f"RANK {rank} REFUSED: the quantized tensors of the live job are inconsistent (4 problems):" in text
        assert ("'model.layers.0.self_attn.k_proj.weight' [16, 32] is split at row 8 (pieces in 'rank 0', 'rank 1'), "
                "not on a 16-row block boundary (weight_block_size [16, 16] in 'config.json')") in text
        assert "ckpttool never guesses a missing scale or a block size." in text
    assert not (out / "fp8_unaligned").exists()


def test_fp8_travels_as_bytes():
    from ckpttool.live.gather import _wire

    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu):
        tensor = torch.zeros(3, 4, dtype=dtype)
        wire = _wire(tensor)
        assert wire.dtype == torch.uint8 and wire.shape == (3, 4) and wire.data_ptr() == tensor.data_ptr()
    plain = torch.zeros(3, dtype=torch.bfloat16)
    assert _wire(plain) is plain
