"""Dequantizing merges (``dtype=`` on an FP8 or MXFP4 checkpoint): the values torch's and transformers' own
dequantization give, bit for bit, streamed in row chunks that cut across blocks, and models that transformers
loads with the logits of the dequantized reference."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import load_output
from safetensors.torch import save_file
from test_quantized import DEEPSEEK, GPT_OSS, QWEN3, checkpoint

import ckpttool
from ckpttool.execute.reads import Reader
from ckpttool.execute.buffers import buffer_sizes, chunks, piece_uses
from ckpttool.execute.assembly import build
from ckpttool.execute.reference import PieceLoader, assemble

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}


def fp8_oracle(name: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """torch's QuantizedHuggingFaceStorageReader: every FP8 weight dequantized, the other tensors as stored."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import (
        QuantizedHuggingFaceStorageReader,
    )

    stored = load_output(checkpoint(name))
    block = json.loads((checkpoint(name) / "config.json").read_text())["quantization_config"]["weight_block_size"][0]
    state = {n: torch.empty(t.shape, dtype=dtype) for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    dcp.load(state, storage_reader=QuantizedHuggingFaceStorageReader(str(checkpoint(name)), target_dtype=dtype,
                                                                        block_size=block), no_dist=True)
    rest = {n: _cast(n, t, dtype) for n, t in stored.items() if n not in state and not n.endswith("_scale_inv")}
    return {**rest, **state}


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A tensor that is not quantized, as any merge with ``dtype=`` writes it (a family may keep a router bias)."""
    from ckpttool.families import keeps_dtype

    return tensor if keeps_dtype(name) else tensor.to(dtype)


def mxfp4_oracle(dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """transformers' gpt-oss loader (convert_moe_packed_tensors): the experts as gpt-oss computes with them."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    stored = load_output(checkpoint(GPT_OSS))
    out = {n: _cast(n, t, dtype) for n, t in stored.items() if not n.endswith(("_blocks", "_scales"))}
    for name in [n.removesuffix("_blocks") for n in stored if n.endswith("_blocks")]:
        out[name] = convert_moe_packed_tensors(stored[name + "_blocks"], stored[name + "_scales"], dtype=dtype)
    return out


def assert_bitwise(written: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(written) == sorted(expected)
    for name, tensor in expected.items():
        assert written[name].dtype == tensor.dtype, name
        assert torch.equal(written[name].view(torch.uint8), tensor.contiguous().view(torch.uint8)), name


@pytest.mark.parametrize("fixture", [QWEN3, DEEPSEEK])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32", "float16"])
def test_a_dequantized_fp8_merge_equals_torchs_reader_bit_for_bit(tmp_path, fixture, dtype):
    result = ckpttool.merge(checkpoint(fixture), tmp_path / "out", dtype=dtype, max_shard_size="40KB")
    assert len(result.files) > 1 and result.audit.ok
    assert_bitwise(load_output(tmp_path / "out"), fp8_oracle(fixture, DTYPES[dtype]))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == dtype
    assert any("dequantized the fp8 F8_E4M3" in note for note in result.plan.notes)


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_dequantized_mxfp4_merge_equals_transformers_gpt_oss_loader(tmp_path, dtype):
    ckpttool.merge(checkpoint(GPT_OSS), tmp_path / "out", dtype=dtype)
    assert_bitwise(load_output(tmp_path / "out"), mxfp4_oracle(DTYPES[dtype]))
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())


def _logits(model_dir: Path, **kwargs) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, **kwargs).eval()
    with torch.no_grad():
        logits = model(torch.tensor([[5, 17, 99, 3, 42, 7, 150, 2]])).logits
    return logits, {k: v.clone() for k, v in model.state_dict().items()}


def test_qwen3_dequantized_loads_as_transformers_own_fp8_loader_gives_it(tmp_path):
    """transformers dequantizes an FP8 checkpoint on load on CPU (to bfloat16): the same weights and logits as
    from_pretrained of the merge's bfloat16 output."""
    ckpttool.merge(checkpoint(QWEN3), tmp_path / "out", dtype="bfloat16")
    expected, expected_state = _logits(checkpoint(QWEN3))
    logits, state = _logits(tmp_path / "out")
    assert next(iter(expected_state.values())).dtype == torch.bfloat16
    assert_bitwise(state, expected_state)
    assert torch.equal(logits, expected)


def test_deepseek_dequantized_loads_with_the_logits_of_the_reference_model(tmp_path):
    """transformers 5.23 cannot load this checkpoint's cropped edge blocks (see its producer.json): the reference is
    torch's reader's dequantization saved as a plain checkpoint, loaded by transformers."""
    reference = tmp_path / "reference"
    reference.mkdir()
    config = json.loads((checkpoint(DEEPSEEK) / "config.json").read_text())
    del config["quantization_config"]
    config["dtype"] = "float32"
    (reference / "config.json").write_text(json.dumps(config))
    save_file(fp8_oracle(DEEPSEEK, torch.float32), reference / "model.safetensors", metadata={"format": "pt"})
    ckpttool.merge(checkpoint(DEEPSEEK), tmp_path / "out", dtype="float32")
    expected, expected_state = _logits(reference)
    logits, state = _logits(tmp_path / "out")
    assert_bitwise(state, expected_state)
    assert torch.equal(logits, expected)


def test_gpt_oss_dequantized_loads_as_transformers_mxfp4_loader_gives_it(tmp_path):
    ckpttool.merge(checkpoint(GPT_OSS), tmp_path / "out", dtype="float32")
    expected, expected_state = _logits(checkpoint(GPT_OSS), dtype=torch.float32)  # dequantized on load on CPU
    logits, state = _logits(tmp_path / "out")
    assert_bitwise(state, expected_state)
    assert torch.equal(logits, expected)


@pytest.mark.parametrize("fixture", [DEEPSEEK, GPT_OSS])
def test_dequantizing_streams_in_row_chunks_within_the_predicted_buffers(fixture):
    """Chunks of 3 rows cut across the 16-row blocks (and the scale rows they need): the same bytes as the whole
    tensor; every per-thread buffer is allocated once, at the size buffer_sizes predicts, so memory is bounded by a
    chunk whatever the tensor."""
    plan = ckpttool.prepare(checkpoint(fixture), dtype="bfloat16").plan
    dequantized = [t for t in plan.targets if t.dequant is not None]
    assert dequantized and not [t for t in plan.targets if t.name.endswith(("_scale_inv", "_scales", "_blocks"))]
    small = [c for t in dequantized for c in chunks(t, 0, rows=3 if t.dequant.method == "fp8-blocks" else 1)]
    whole = [c for t in dequantized for c in chunks(t, 0)]
    sizes = buffer_sizes(small)
    assert {"read", "chunk", "scale", "cast", "work", "scale-f32"} <= set(sizes)
    reader = Reader(plan.root, piece_uses(small), sizes)
    pieces: Counter[str] = Counter()
    try:
        parts = {t.name: [] for t in dequantized}
        for chunk in small:
            parts[chunk.target.name].append(build(chunk, reader).clone())
            pieces[chunk.target.name] += 1
        allocated = {name: len(buffer) for name, buffer in reader._local.buffers.items()}
    finally:
        reader.close()
    assert allocated == {name: max(n, 1) for name, n in sizes.items() if name in allocated}
    reader, loader = Reader(plan.root, piece_uses(whole), buffer_sizes(whole)), PieceLoader(plan.root)
    try:
        for chunk in whole:  # one chunk each, and the reference executor's whole tensor
            assert chunk.start == 0 and chunk.stop == chunk.target.shape[0]
            joined = torch.cat(parts[chunk.target.name]).view(torch.uint8)
            assert torch.equal(joined, build(chunk, reader).view(torch.uint8))
            assert torch.equal(joined, assemble(chunk.target, loader).view(torch.uint8))
    finally:
        reader.close()
    assert min(pieces.values()) >= 3  # every tensor in several chunks


def test_a_dry_run_shows_the_dequantized_plan_and_its_peak(tmp_path):
    kept = ckpttool.merge(checkpoint(DEEPSEEK), dry_run=True)
    result = ckpttool.merge(checkpoint(DEEPSEEK), dry_run=True, dtype="bf16")
    doc = result.to_json()
    names = {t["name"]: t for t in doc["targets"]}
    assert "model.layers.0.mlp.gate_proj.weight_scale_inv" not in names
    assert names["model.layers.0.mlp.gate_proj.weight"]["dtype"] == "BF16"
    assert names["model.layers.0.mlp.gate_proj.weight"]["sources"] == [
        "model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.gate_proj.weight_scale_inv"]
    assert doc["predicted_peak_bytes"] > kept.to_json()["predicted_peak_bytes"]  # the float32 work buffer
    assert not (tmp_path / "out").exists()
