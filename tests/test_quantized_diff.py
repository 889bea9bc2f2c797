"""``diff`` of quantized checkpoints: stored bytes by default, dequantized float32 values with ``dequantize``.

The pair compared holds the same FP8 values with power-of-two (``ue8m0``) scales, stored as float32 in one and as
E8M0 in the other (DeepSeek-V3.1's scales come both ways): different bytes, the same dequantized weights."""

from __future__ import annotations

import json

import torch
from conftest import load_output
from test_quantize import fixture_script
from test_quantized import QWEN3, checkpoint, rewrite

import ckpttool


def _ue8m0(scale_dtype: torch.dtype):
    """The Qwen3 fixture's weights quantized again with power-of-two scales (the fixture script's quantizer)."""
    make = fixture_script()

    def change(tensors, config):
        config["quantization_config"]["scale_fmt"] = "ue8m0"
        for name in [n for n in tensors if n.endswith("_scale_inv")]:
            weight = name.removesuffix("_scale_inv")
            w = make.fp8_dequantize(tensors[weight], tensors[name], (8, 8))
            tensors[weight], scales = make.fp8_quantize(w, (8, 8), True)
            tensors[name] = scales.to(scale_dtype)

    return change


def test_equal_values_in_other_scale_formats_differ_by_bytes_and_agree_dequantized(tmp_path, cli):
    a = rewrite(checkpoint(QWEN3), tmp_path / "f32", _ue8m0(torch.float32))
    b = rewrite(checkpoint(QWEN3), tmp_path / "e8m0", _ue8m0(torch.float8_e8m0fnu))
    by_bytes = ckpttool.diff(a, b)
    assert not by_bytes.equal and not by_bytes.dequantized
    assert {d.name for d in by_bytes.differences} == {n for n in load_output(a) if n.endswith("_scale_inv")}
    assert {d.status for d in by_bytes.differences} == {"dtype"}  # F32 against F8_E8M0, the same values
    values = ckpttool.diff(a, b, dequantize=True)
    assert values.equal and values.dequantized
    assert not [n for n in values.fingerprints if n.endswith("_scale_inv")]  # each weight once, dequantized
    result = cli("diff", a, b, "--dequantize", "--json")
    assert result.exit_code == 0 and json.loads(result.stdout)["dequantized"] is True
    assert cli("diff", a, b).exit_code == 3


def test_a_dequantized_diff_measures_an_fp8_checkpoint_against_its_bfloat16_source(tmp_path):
    """The fixture against its own float32 dequantization: equal; against a requantization in 16x16 blocks of its
    bfloat16 dequantization: every quantized weight differs, by at most E4M3's rounding of the weights."""
    ckpttool.merge(checkpoint(QWEN3), tmp_path / "f32", dtype="float32")
    assert ckpttool.diff(checkpoint(QWEN3), tmp_path / "f32", dequantize=True).equal
    ckpttool.merge(checkpoint(QWEN3), tmp_path / "bf16", dtype="bfloat16")
    ckpttool.merge(tmp_path / "bf16", tmp_path / "again", quantize="fp8", block=16)
    result = ckpttool.diff(tmp_path / "bf16", tmp_path / "again", dequantize=True)
    quantized = {n for n in load_output(checkpoint(QWEN3)) if n.endswith("_scale_inv")}
    assert {d.name + "_scale_inv" for d in result.differences} == quantized
    assert all(d.status == "different" and 0 < d.max_abs_diff < 0.02 for d in result.differences)
