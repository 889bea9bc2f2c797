"""Quantizing merges (``quantize="fp8"``): the FP8 values and scales the fixture script's quantizer (DeepSeek-V3's
``weight_quant`` order) gives, bit for bit, from sharded sources (FSDP2 DCP pieces cut across blocks); outputs that
torch's QuantizedHuggingFaceStorageReader and transformers' own FP8 loader dequantize to what ckpttool does; the
round trip within E4M3's rounding and reported; modules_to_not_convert as transformers matches it; clear refusals."""

from __future__ import annotations

import importlib.util
import json
import math

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, load_output
from test_quantized import QWEN3, checkpoint
from test_quantized_merge import assert_bitwise

import ckpttool
from ckpttool.execute.reads import Reader
from ckpttool.execute.buffers import buffer_sizes, chunks, piece_uses
from ckpttool.execute.assembly import build
from ckpttool.execute.reference import PieceLoader, assemble
from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.families.quantize import not_converted, quantizes

DEEPSEEK_DCP, MIXTRAL_DCP = "deepseek_v3_fsdp2_dcp", "mixtral_fsdp2_dcp"


def fixture_script():
    """fixtures/make_quantized.py, whose quantizer made the FP8 fixtures (checked there against torch's reader)."""
    spec = importlib.util.spec_from_file_location("make_quantized", FIXTURES / "make_quantized.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _quantized(written: dict[str, torch.Tensor]) -> list[str]:
    return sorted(n for n, t in written.items() if t.dtype == torch.float8_e4m3fn)


@pytest.mark.parametrize(("fixture", "block"), [(DEEPSEEK_DCP, 16), (MIXTRAL_DCP, 8), (DEEPSEEK_DCP, 128)])
def test_values_and_scales_equal_the_fixture_scripts_quantizer_bit_for_bit(tmp_path, fixture, block):
    """FSDP2 pieces are cut at half a tensor's rows, off the block rows: each chunk still holds whole blocks."""
    result = ckpttool.merge(FIXTURES / fixture / "checkpoint", tmp_path / "out", quantize="fp8", block=block,
                            max_shard_size="200KB")
    assert result.audit.ok, [f.message for f in result.audit.findings]
    assert not [f for f in result.audit.findings if f.code.startswith(("quant-", "tensor-", "dtype"))], result.audit.findings
    written, source = load_output(tmp_path / "out"), load_output(FIXTURES / fixture / "reference")
    make = fixture_script()
    quantized = _quantized(written)
    assert quantized and sorted(n for n in written if n.endswith("_scale_inv")) == [n + "_scale_inv" for n in quantized]
    for name in quantized:
        values, scales = make.fp8_quantize(source[name], (block, block), False)
        assert torch.equal(written[name].view(torch.uint8), values.view(torch.uint8)), name
        assert written[name + "_scale_inv"].dtype == torch.float32
        assert torch.equal(written[name + "_scale_inv"], scales), name
    for name, tensor in source.items():  # everything else as it was
        if name not in quantized:
            assert torch.equal(written[name], tensor), name
    assert sorted(result.round_trips) == quantized


def test_what_is_quantized_and_what_modules_to_not_convert_says_as_transformers_matches_it(tmp_path):
    from transformers.quantizers.quantizers_utils import should_convert_module

    ckpttool.merge(FIXTURES / DEEPSEEK_DCP / "checkpoint", tmp_path / "out", quantize="fp8", block=16)
    written = load_output(tmp_path / "out")
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    qc = config["quantization_config"]
    assert {k: v for k, v in qc.items() if k != "modules_to_not_convert"} == {
        "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [16, 16]}
    assert config["dtype"] == "float32"  # the kept tensors' dtype; FP8 values and their scales are no model dtype
    kept = {n.rsplit(".", 1)[0] for n in written} - {n.removesuffix(".weight") for n in _quantized(written)}
    quantized = {n.removesuffix(".weight") for n in _quantized(written)}
    assert {"lm_head", "model.embed_tokens", "model.norm", "model.layers.1.mlp.gate",
            "model.layers.0.self_attn.kv_a_layernorm"} <= kept
    assert {"model.layers.1.mlp.experts.0.gate_proj", "model.layers.1.mlp.shared_experts.down_proj",
            "model.layers.0.self_attn.q_a_proj", "model.layers.0.self_attn.kv_b_proj", "model.layers.0.self_attn.o_proj"} <= quantized
    assert written["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    patterns = qc["modules_to_not_convert"]
    assert all(should_convert_module(m, patterns) for m in quantized)
    assert not [m for m in kept if should_convert_module(m, patterns)]
    assert len(patterns) < len(kept)  # layer numbers folded: model.layers.*.input_layernorm


def test_a_folded_pattern_that_would_catch_a_quantized_module_is_spelled_out():
    kept = ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"]
    assert not_converted(kept, ["model.layers.2.mlp.gate"]) == kept  # layer 2's gate is quantized
    assert not_converted(kept, ["model.layers.2.mlp.gate_proj"]) == ["model.layers.*.mlp.gate"]


@pytest.mark.parametrize(("name", "shape", "dtype", "expected"), [
    ("model.layers.0.self_attn.q_proj.weight", (8, 8), "BF16", True),
    ("model.layers.0.block_sparse_moe.experts.1.w2.weight", (8, 8), "F32", True),
    ("model.layers.0.self_attn.q_proj.bias", (8,), "BF16", False),
    ("model.layers.0.input_layernorm.weight", (8,), "BF16", False),
    ("model.layers.0.block_sparse_moe.gate.weight", (4, 8), "BF16", False),
    ("model.layers.0.mlp.gate.weight", (4, 8), "BF16", False),
    ("model.layers.0.mlp.router.weight", (4, 8), "BF16", False),
    ("model.layers.0.mlp.shared_expert_gate.weight", (1, 8), "BF16", False),
    ("model.layers.3.shared_head.head.weight", (32, 8), "BF16", False),
    ("model.layers.3.embed_tokens.weight", (32, 8), "BF16", False),
    ("model.layers.0.mlp.experts.gate_up_proj", (2, 8, 16), "BF16", False),
    ("model.embed_tokens.weight", (32, 8), "BF16", False),
    ("lm_head.weight", (32, 8), "BF16", False),
    ("model.layers.0.self_attn.q_proj.weight", (8, 8), "I32", False),
])
def test_only_linear_weights_of_the_decoder_layers_are_quantized(name, shape, dtype, expected):
    assert quantizes(name, shape, dtype) is expected


@pytest.fixture(scope="module")
def qwen3_bf16(tmp_path_factory):
    """A BF16 Qwen3 (every dim a multiple of 8, which transformers' FP8 loader needs): the FP8 fixture dequantized."""
    out = tmp_path_factory.mktemp("qwen3") / "bf16"
    ckpttool.merge(checkpoint(QWEN3), out, dtype="bfloat16")
    return out


def test_transformers_fp8_loader_dequantizes_the_output_as_ckpttool_does(tmp_path, qwen3_bf16):
    from transformers import AutoModelForCausalLM

    ckpttool.merge(qwen3_bf16, tmp_path / "fp8", quantize="fp8", block=(8, 8))
    ckpttool.merge(tmp_path / "fp8", tmp_path / "back", dtype="bfloat16")
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "fp8")  # dequantized on load on CPU, to bfloat16
    state = {k: v for k, v in loaded.state_dict().items() if k != "lm_head.weight" or "lm_head.weight" in load_output(tmp_path / "back")}
    assert next(iter(state.values())).dtype == torch.bfloat16
    assert_bitwise(state, load_output(tmp_path / "back"))


def test_torchs_reader_dequantizes_the_output_as_ckpttool_does(tmp_path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import (
        QuantizedHuggingFaceStorageReader,
    )

    ckpttool.merge(FIXTURES / DEEPSEEK_DCP / "checkpoint", tmp_path / "fp8", quantize="fp8", block=16,
                   max_shard_size="20KB")  # torch's reader reads an index
    ckpttool.merge(tmp_path / "fp8", tmp_path / "back", dtype="float32")
    mine = load_output(tmp_path / "back")
    quantized = _quantized(load_output(tmp_path / "fp8"))
    state = {n: torch.empty(mine[n].shape) for n in quantized}
    dcp.load(state, storage_reader=QuantizedHuggingFaceStorageReader(str(tmp_path / "fp8"), target_dtype=torch.float32,
                                                                       block_size=16), no_dist=True)
    assert_bitwise(state, {n: mine[n] for n in quantized})


def test_the_round_trip_is_within_e4m3_rounding_and_reported(tmp_path):
    result = ckpttool.merge(FIXTURES / DEEPSEEK_DCP / "checkpoint", tmp_path / "fp8", quantize="fp8", block=16, workers=3)
    ckpttool.merge(tmp_path / "fp8", tmp_path / "back", dtype="float32")
    source, back, written = load_output(FIXTURES / DEEPSEEK_DCP / "reference"), load_output(tmp_path / "back"), load_output(tmp_path / "fp8")
    for name in _quantized(written):
        w, scale = source[name], written[name + "_scale_inv"]
        expanded = scale.repeat_interleave(16, 0).repeat_interleave(16, 1)[: w.shape[0], : w.shape[1]]
        error = (back[name] - w).abs()
        assert bool((error <= 2.0 ** -4 * w.abs() + 2.0 ** -10 * expanded).all()), name  # half an E4M3 step
        trip = result.round_trips[name]
        assert trip.max_abs_error == float(error.max()) and trip.source_max == float(w.abs().max())
        assert math.isclose(trip.relative_error, float(error.norm() / w.norm()), rel_tol=1e-4)
        assert 0 < trip.relative_error < 2.0 ** -4
    doc = result.to_json()["quantization"]
    worst = max(result.round_trips, key=lambda n: result.round_trips[n].relative_error)
    assert doc["tensors"] == len(_quantized(written)) and doc["worst"]["name"] == worst
    assert set(doc["worst"]) == {"name", "max_abs_error", "relative_error", "source_max_abs"}


def test_quantizing_streams_whole_block_rows_within_the_predicted_buffers():
    """Chunks of 3 rows asked for become one block row (16 rows) for the values, 3 scale rows (48 source rows) for
    the scales: the same bytes as the reference executor's whole tensors; buffers allocated once, as predicted."""
    plan = ckpttool.prepare(FIXTURES / DEEPSEEK_DCP / "checkpoint", quantize=(16, 16)).plan
    computed = [t for t in plan.targets if t.dequant is not None]
    assert {t.dtype for t in computed} == {"F8_E4M3", "F32"}
    small = [c for t in computed for c in chunks(t, 0, rows=3)]
    assert all(c.start % 16 == 0 for c in small if c.target.dtype == "F8_E4M3")
    assert any(c.stop - c.start == 3 for c in small if c.target.dtype == "F32")
    sizes = buffer_sizes(small)
    reader, loader = Reader(plan.root, piece_uses(small), sizes), PieceLoader(plan.root)
    try:
        parts: dict[str, list[torch.Tensor]] = {t.name: [] for t in computed}
        for chunk in small:
            parts[chunk.target.name].append(build(chunk, reader).clone())
        allocated = {name: len(buffer) for name, buffer in reader._local.buffers.items()}
        for t in computed:
            assert torch.equal(torch.cat(parts[t.name]).view(torch.uint8), assemble(t, loader).view(torch.uint8)), t.name
    finally:
        reader.close()
    assert allocated == {name: max(n, 1) for name, n in sizes.items() if name in allocated}
    assert min(len(p) for p in parts.values()) >= 1 and max(len(p) for p in parts.values()) >= 3


# ---------------------------------------------------------------------------------------------- refusals


def test_quantizing_a_quantized_source_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"quantize='fp8': '.*quantized_qwen3_fp8/checkpoint' is quantized already "
                       r"\(fp8 F8_E4M3 with 8x8 blocks \(float scales\)\); quantizing FP8 values again would compound"):
        ckpttool.merge(checkpoint(QWEN3), tmp_path / "out", quantize="fp8")
    assert not (tmp_path / "out").exists()


def test_quantize_with_a_dtype_unknown_method_or_lonely_block_is_refused(tmp_path):
    src = FIXTURES / DEEPSEEK_DCP / "checkpoint"
    with pytest.raises(ArgumentError, match=r"quantize='fp8' and dtype='bf16' together: quantize writes FP8 weights"):
        ckpttool.merge(src, tmp_path / "out", quantize="fp8", dtype="bf16")
    with pytest.raises(ArgumentError, match=r"quantize='int3': ckpttool quantizes to fp8, "):  # int4 packs (issue 28)
        ckpttool.merge(src, tmp_path / "out", quantize="int3")
    with pytest.raises(ArgumentError, match=r"block=16 is the FP8 block size of quantize='fp8'; give quantize='fp8' too"):
        ckpttool.merge(src, tmp_path / "out", block=16)
    with pytest.raises(ArgumentError, match=r"block=\(0, 16\): the FP8 block size is one or two positive integers"):
        ckpttool.merge(src, tmp_path / "out", quantize="fp8", block=(0, 16))
    assert not (tmp_path / "out").exists()


def test_quantizing_without_a_config_is_refused(tmp_path):
    import shutil

    src = tmp_path / "src"
    shutil.copytree(FIXTURES / DEEPSEEK_DCP / "checkpoint", src)
    (src / "config.json").unlink()
    with pytest.raises(ConfigError, match=r"quantize='fp8' needs the model's config \(none usable for '.*src'\): "
                       r"which tensors are Linear weights"):
        ckpttool.merge(src, tmp_path / "out", quantize="fp8")
    assert not (tmp_path / "out").exists()


def test_the_cli_quantizes_reports_the_round_trip_and_refuses_clearly(tmp_path, cli):
    src = str(FIXTURES / DEEPSEEK_DCP / "checkpoint")
    result = cli("merge", src, tmp_path / "out", "--quantize", "fp8", "--block", "16")
    assert result.exit_code == 0, result.output
    assert "weights quantized; worst round trip model.layers." in result.output
    result = cli("merge", src, tmp_path / "j", "--quantize", "fp8", "--block", "16x8", "--json")
    doc = json.loads(result.stdout)
    assert doc["quantization"]["worst"]["relative_error"] > 0
    assert json.loads((tmp_path / "j" / "config.json").read_text())["quantization_config"]["weight_block_size"] == [16, 8]
    result = cli("merge", checkpoint(QWEN3), tmp_path / "x", "--quantize", "fp8")
    assert_failed_cleanly(result, tmp_path / "x", "Error: --quantize fp8: '",
                          "Dequantize it first (--dtype bfloat16), or merge it without --quantize to keep it")
    result = cli("merge", src, tmp_path / "x", "--quantize", "fp8", "--dtype", "bf16")
    assert result.exit_code == 2 and "--quantize and --dtype are exclusive" in result.output
    result = cli("merge", src, tmp_path / "x", "--block", "16")
    assert result.exit_code == 2 and "give --quantize fp8 too" in result.output
    result = cli("merge", src, tmp_path / "x", "--quantize", "fp8", "--block", "0")
    assert result.exit_code == 2 and "give the FP8 block size as 128 or ROWSxCOLS" in result.output
