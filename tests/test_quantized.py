"""Quantized checkpoints (FP8 block-scaled, MXFP4): the formats' facts, the decoders against torch's and
transformers' own dequantization, and quantized sources merged and audited as themselves.

Dequantizing merges are in test_quantized_merge.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, load_output

import ckpttool
from ckpttool.errors import ConfigError
from ckpttool.quant.decode import Fp8Blocks, Mxfp4Groups
from ckpttool.quant.formats import (
    FP8,
    GATE_UP_INTERLEAVE,
    MXFP4,
    Quantization,
    fp8_scale_shape,
    links,
    mxfp4_logical_shape,
    mxfp4_stored_shapes,
    read_quantization,
)

QWEN3, DEEPSEEK, GPT_OSS = "quantized_qwen3_fp8", "quantized_deepseek_v3_fp8", "quantized_gpt_oss_mxfp4"
QUANTIZED_FIXTURES = (QWEN3, DEEPSEEK, GPT_OSS)


def checkpoint(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def scratch(name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    from ckpttool.io.dtypes import torch_dtype

    return torch.empty(shape, dtype=torch_dtype(dtype))


def rewrite(src: Path, dest: Path, change) -> Path:
    """A copy of an HF checkpoint as one file, after ``change(tensors, config)`` edits it in place."""
    from safetensors.torch import save_file

    tensors, config = load_output(src), json.loads((src / "config.json").read_text())
    change(tensors, config)
    dest.mkdir(parents=True)
    (dest / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, dest / "model.safetensors", metadata={"format": "pt"})
    return dest


# ---------------------------------------------------------------------------------------------- the config


def test_a_deepseek_config_gives_its_block_size_and_formats():
    config = {"quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                      "weight_block_size": [128, 64], "scale_fmt": "ue8m0"}}
    quant = read_quantization(config)
    assert (quant.method, quant.block, quant.scale_fmt, quant.weight_dtype) == (FP8, (128, 64), "ue8m0", "F8_E4M3")
    assert read_quantization({"quantization_config": {"quant_method": "mxfp4"}}).method == MXFP4
    assert read_quantization({"model_type": "llama"}) is None
    # no weight_block_size: transformers' FineGrainedFP8Config default, never a guess from the tensors' shapes
    assert read_quantization({"quantization_config": {"quant_method": "fp8"}}).block == (128, 128)


@pytest.mark.parametrize(("quantization", "message"), [
    ({"quant_method": "awq"}, "quant_method 'awq'; ckpttool reads 'fp8' (block-scaled) and 'mxfp4' checkpoints only"),
    ({"quant_method": "fp8", "weight_block_size": None}, "weight_block_size is null (one scale per tensor)"),
    ({"quant_method": "fp8", "weight_block_size": [128]}, "weight_block_size is [128]; it must be two positive integers"),
    ({"quant_method": "fp8", "weight_block_size": [0, 128]}, "weight_block_size is [0, 128]"),
    ({"quant_method": "fp8", "fmt": "e3m4"}, "fmt is 'e3m4'; FP8 weights are 'e4m3' or 'e5m2'"),
    ({"quant_method": "fp8", "scale_fmt": "ue4m3"}, "scale_fmt is 'ue4m3'; known: float, ue8m0"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "activation_scheme is 'static'"),
    ({"quant_method": "fp8", "modules_to_not_convert": "lm_head"}, "modules_to_not_convert must be a list"),
    ("fp8", "quantization_config is str, not an object"),
])
def test_a_config_ckpttool_cannot_honour_is_an_error_naming_it(quantization, message):
    with pytest.raises(ConfigError) as e:
        read_quantization({"quantization_config": quantization}, "ckpt/config.json")
    assert str(e.value).startswith("'ckpt/config.json': quantization_config")
    assert message in str(e.value)


@pytest.mark.parametrize("module", [
    "lm_head", "model.layers.1.self_attn", "model.layers.11.self_attn.q_proj", "model.layers.1.mlp.gate",
    "model.layers.1.mlp.gate_proj", "model.layers.1.mlp.experts", "model.embed_tokens", "model.layers.1.fc1",
])
def test_modules_to_not_convert_match_as_transformers_matches_them(module):
    from transformers.quantizers.quantizers_utils import should_convert_module

    patterns = ["lm_head", "model.layers.*.self_attn", "model.layers.1.mlp.gate", "fc1", "model.embed_tokens"]
    quant = Quantization(FP8, (128, 128), "float", "F8_E4M3", tuple(patterns))
    assert quant.converts(module) == should_convert_module(module, patterns)


# ---------------------------------------------------------------------------------------------- names and shapes


def test_linked_tensors_and_their_shapes():
    names = ["a.weight", "a.weight_scale_inv", "b.weight_scale_inv", "e.down_proj_blocks", "e.down_proj_scales",
             "f.gate_up_proj_blocks", "norm.weight"]
    found, lonely, orphans = links(names)
    assert [(x.method, x.logical, x.weight, x.scale) for x in found] == [
        (FP8, "a.weight", "a.weight", "a.weight_scale_inv"),
        (MXFP4, "e.down_proj", "e.down_proj_blocks", "e.down_proj_scales")]
    assert (lonely, orphans) == (["f.gate_up_proj_blocks"], ["b.weight_scale_inv"])
    assert fp8_scale_shape((576, 7168), (128, 128)) == (5, 56)  # DeepSeek-V3's kv_a_proj_with_mqa: a cropped edge
    assert fp8_scale_shape((3, 40, 72), (16, 16)) == (3, 3, 5)
    assert mxfp4_stored_shapes((32, 2880, 5760)) == ((32, 5760, 90, 16), (32, 5760, 90))  # gpt-oss-20b gate_up_proj
    assert mxfp4_logical_shape((32, 5760, 90, 16)) == (32, 2880, 5760)
    assert mxfp4_stored_shapes((3, 40, 64)) is None  # 40 values do not make whole groups of 32


def test_gpt_oss_reads_gate_from_the_even_columns_and_up_from_the_odd_ones():
    """transformers' GptOssExperts with up = 0: the output is non-zero only when the gate holds the ones."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    experts = GptOssExperts(GptOssConfig(hidden_size=8, intermediate_size=4, num_local_experts=1))
    gate, up = GATE_UP_INTERLEAVE
    for ones, nonzero in ((gate, True), (up, False)):
        gate_up = torch.zeros(2, 8)
        gate_up[..., ones] = 1.0
        assert bool(experts._apply_gate(gate_up).ne(0).all()) is nonzero


# ---------------------------------------------------------------------------------------------- decoders vs oracles


def _fp8_oracle(directory: Path, names: dict[str, tuple[int, ...]], dtype: torch.dtype, block: int) -> dict[str, torch.Tensor]:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.quantized_hf_storage import (
        QuantizedHuggingFaceStorageReader,
    )

    state = {n: torch.empty(shape, dtype=dtype) for n, shape in names.items()}
    dcp.load(state, storage_reader=QuantizedHuggingFaceStorageReader(str(directory), target_dtype=dtype, block_size=block),
             no_dist=True)
    return state


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_fp8_rows_decode_bit_for_bit_as_torchs_reader(dtype):
    """Any range of rows, cut across blocks, with the scale rows the decoder names: torch's
    QuantizedHuggingFaceStorageReader's values, bit for bit (cropped edge blocks included)."""
    tensors = load_output(checkpoint(DEEPSEEK))
    weights = {n: tuple(t.shape) for n, t in tensors.items() if t.dtype == torch.float8_e4m3fn}
    oracle = _fp8_oracle(checkpoint(DEEPSEEK), weights, dtype, 16)
    decoder = Fp8Blocks((16, 16))
    for name in weights:
        rows = weights[name][0]
        for start, stop in [(0, rows), (0, 5), (5, 21), (rows - 3, rows)]:
            lo, hi = decoder.scale_rows(start, stop)
            out = torch.empty(stop - start, weights[name][1], dtype=dtype)
            decoder.decode(tensors[name][start:stop], tensors[name + "_scale_inv"][lo:hi], start, out, scratch)
            assert torch.equal(out.view(torch.uint8), oracle[name][start:stop].contiguous().view(torch.uint8)), (name, start)


@pytest.mark.parametrize("scale_dtype", ["F8_E8M0", "U8"])
def test_fp8_ue8m0_scales_decode_as_transformers_does(scale_dtype):
    """E8M0 scales, as torch's float8_e8m0fnu or as bytes (2 ** (byte - 127)): transformers' Fp8Dequantize."""
    from transformers.integrations.finegrained_fp8 import Fp8Dequantize

    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(48, 40, generator=g) * 100).to(torch.float8_e4m3fn)
    exponents = torch.randint(100, 140, (6, 5), generator=g, dtype=torch.uint8)
    scales = exponents.view(torch.float8_e8m0fnu) if scale_dtype == "F8_E8M0" else exponents
    expected = Fp8Dequantize(None)._dequantize_one(weight, scales, output_dtype=torch.float32)
    out = torch.empty(48, 40)
    Fp8Blocks((8, 8), ue8m0_bytes=scale_dtype == "U8").decode(weight, scales, 0, out, scratch)
    assert torch.equal(out, expected)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_decodes_bit_for_bit_as_transformers_gpt_oss_loader(dtype):
    """Every byte value, and scale bytes at both ends of the range: transformers' convert_moe_packed_tensors (which
    gives the [E, in, out] tensor gpt-oss computes with), bit for bit."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.arange(256, dtype=torch.uint8).repeat(3 * 5 * 2 * 16 // 256 + 1)[: 3 * 5 * 2 * 16].view(3, 5, 2, 16)
    scales = torch.tensor([0, 1, 100, 127, 128, 150, 200, 254] * 4, dtype=torch.uint8)[:30].view(3, 5, 2)
    out = torch.empty(3, 64, 5, dtype=dtype)
    Mxfp4Groups(transpose=True).decode(blocks, scales, 0, out, scratch)
    assert torch.equal(out.view(torch.uint8), convert_moe_packed_tensors(blocks, scales, dtype=dtype).view(torch.uint8))


def test_an_e8m0_byte_0xff_is_nan_where_torch_and_transformers_give_infinity():
    """The one difference from the oracles, on purpose: the OCP MX definition of E8M0 makes 0xFF NaN; transformers
    computes ``value * 2 ** 128`` (0.5 gives 2 ** 127, 1.0 infinity). The audit reports such scales."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = torch.full((1, 1, 1, 16), 0x21, dtype=torch.uint8), torch.full((1, 1, 1), 0xFF, dtype=torch.uint8)
    out = torch.empty(1, 32, 1)
    Mxfp4Groups().decode(blocks, scales, 0, out, scratch)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.isnan(out).all()
    assert theirs[0, :2, 0].tolist() == [2.0 ** 127, math.inf]  # codes 1 (0.5) and 2 (1.0), low nibble first


@pytest.mark.parametrize("name", QUANTIZED_FIXTURES)
def test_every_fixture_was_checked_against_software_that_is_not_ckpttool(name):
    producer = json.loads((FIXTURES / name / "producer.json").read_text())
    assert producer["oracle"]["equal"] == "bit for bit (float32)" and producer["oracle"]["tensors"] >= 4
    assert producer["versions"]["transformers"] == "5.23.0"
    tensors = load_output(checkpoint(name))
    assert {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in tensors.items()} == {
        k: [v["dtype"], v["shape"]] for k, v in producer["tensors"].items()}
    blocks = producer["quantization"].get("weight_block_size")
    if blocks == [16, 16]:  # edge blocks: transformers 5.23's loader infers the block from the scale grid and fails
        assert producer["transformers_from_pretrained"]["cause"].startswith("ValueError: Weight shape")
        fp8 = [v["shape"] for v in producer["tensors"].values() if v["dtype"] == "float8_e4m3fn"]
        assert any(rows % 16 or cols % 16 for rows, cols in fp8)
    else:
        assert producer["transformers_from_pretrained"]["loads"] is True


def test_the_fixture_script_regenerates_the_committed_fixtures_byte_for_byte(tmp_path):
    import subprocess
    import sys

    script = FIXTURES / "make_quantized.py"
    result = subprocess.run([sys.executable, str(script), "--out", str(tmp_path)], capture_output=True, text=True,
                            check=False, timeout=600)
    assert result.returncode == 0, result.stderr[-2000:]
    for name in QUANTIZED_FIXTURES:
        made = sorted(p.relative_to(tmp_path / name) for p in (tmp_path / name).rglob("*") if p.is_file())
        assert made == sorted(p.relative_to(FIXTURES / name) for p in (FIXTURES / name).rglob("*") if p.is_file())
        for rel in made:
            assert (tmp_path / name / rel).read_bytes() == (FIXTURES / name / rel).read_bytes(), rel


# ---------------------------------------------------------------------------------------------- kept quantized


@pytest.mark.parametrize("name", QUANTIZED_FIXTURES)
def test_a_quantized_checkpoint_merges_as_itself_byte_for_byte(name, tmp_path):
    result = ckpttool.merge(checkpoint(name), tmp_path / "out")
    source, written = load_output(checkpoint(name)), load_output(tmp_path / "out")
    assert sorted(source) == sorted(written)
    for key, tensor in source.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key].view(torch.uint8), tensor.view(torch.uint8))
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((checkpoint(name) / "config.json").read_text())["quantization_config"]
    assert config["dtype"] == "bfloat16"  # the float32 scales are no model dtype
    assert result.audit.ok and not result.audit.strict().errors, [f.message for f in result.audit.findings]
    report = ckpttool.audit(tmp_path / "out")
    assert report.ok and not [f for f in report.findings if f.code.startswith("quant-") or f.code == "dtype-mix"]


def test_the_model_check_accepts_only_the_quantized_tensors_of_the_architecture(tmp_path):
    def extra(tensors, config):
        tensors["model.layers.0.mlp.nonsense.weight_scale_inv"] = torch.ones(2, 2)
        tensors["model.layers.0.mlp.nonsense.weight"] = torch.zeros(4, 4).to(torch.float8_e4m3fn)

    report = ckpttool.audit(rewrite(checkpoint(QWEN3), tmp_path / "hf", extra), data=False)
    unexpected = sorted(f.tensor for f in report.findings if f.code == "tensor-unexpected")
    assert unexpected == ["model.layers.0.mlp.nonsense.weight", "model.layers.0.mlp.nonsense.weight_scale_inv"]


def test_an_fp8_release_with_an_mtp_layer_merges_as_itself_scales_included(tmp_path):
    """DeepSeek-V3's FP8 release quantizes its MTP layer (``model.layers.61.*.weight_scale_inv``): those scales are
    expected like the main layers' ones, never 'unexpected'."""
    from ckpttool.model.architecture import model_info
    from ckpttool.families import mtp

    def add_mtp(tensors, config):
        config["num_nextn_predict_layers"] = 1
        last, n = config["num_hidden_layers"] - 1, config["num_hidden_layers"]
        layer = mtp.expected(model_info(config))[n]
        for name, shape in layer.items():
            twin = name.replace(f"model.layers.{n}.", f"model.layers.{last}.", 1)
            if twin in tensors:  # the decoder block: a quantized copy of the last layer, with its scales
                tensors[name] = tensors[twin].clone()
                if twin + "_scale_inv" in tensors:
                    tensors[name + "_scale_inv"] = tensors[twin + "_scale_inv"].clone()
            else:  # enorm, hnorm, eh_proj, shared_head, embed_tokens
                tensors[name] = torch.full(shape, 0.5, dtype=torch.bfloat16)

    src = rewrite(checkpoint(DEEPSEEK), tmp_path / "hf", add_mtp)
    scales = sorted(k for k in load_output(src) if k.startswith("model.layers.2.") and k.endswith("_scale_inv"))
    assert scales, "the MTP layer holds quantized weights"
    ckpttool.merge(src, tmp_path / "out")
    written = load_output(tmp_path / "out")
    for key, tensor in load_output(src).items():
        assert torch.equal(written[key].view(torch.uint8), tensor.view(torch.uint8)), key
    report = ckpttool.audit(tmp_path / "out", data=False)
    assert not [f for f in report.findings if f.code.startswith(("tensor-", "quant-", "mtp-"))], report.findings
