"""The audit's data checks on quantized checkpoints judge the dequantized values (streamed), not the stored FP8 or
FP4 codes: a block a NaN scale turns into NaN, a weight a zero scale turns into zeros, an MXFP4 group whose E8M0
byte is 0xFF. The stored codes of those weights are all finite and non-zero."""

from __future__ import annotations

import math

import torch
from conftest import load_output
from test_quantized import DEEPSEEK, GPT_OSS, QWEN3, checkpoint, rewrite
from test_quantized_merge import fp8_oracle, mxfp4_oracle

import ckpttool
from ckpttool.audit.stats import Statistics

Q = "model.layers.0.self_attn.q_proj.weight"  # Qwen3: [48, 40] in 8x8 blocks
GATE = "model.layers.0.mlp.gate_proj.weight"  # DeepSeek: [72, 40] in 16x16 blocks, edge blocks cropped
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"  # gpt-oss: named [3, 64, 192]


def _scale(name, change):
    def edit(tensors, config):
        scale = tensors[name].clone()
        change(scale)
        tensors[name] = scale

    return edit


def _codes(report, tensor):
    return {f.code: f.message for f in report.findings if f.tensor == tensor}


def test_a_nan_scale_makes_its_block_nan_in_the_data_checks(tmp_path):
    def nan_block(scale):
        scale[4, 2] = float("nan")  # rows 64..72, columns 32..40 of a [72, 40] weight: a cropped 8x8 corner

    src = rewrite(checkpoint(DEEPSEEK), tmp_path / "hf", _scale(GATE + "_scale_inv", nan_block))
    report = ckpttool.audit(src)
    assert _codes(report, GATE)["nan"] == f"'{GATE}' holds 64 NaN values of 2880"
    assert "quant-scale-invalid" in _codes(report, GATE + "_scale_inv")
    assert torch.isfinite(load_output(src)[GATE].float()).all()  # the stored codes alone say nothing


def test_a_zero_scale_makes_a_zero_tensor(tmp_path):
    src = rewrite(checkpoint(QWEN3), tmp_path / "hf", _scale(Q + "_scale_inv", lambda s: s.zero_()))
    report = ckpttool.audit(src)
    assert _codes(report, Q)["zero-tensor"] == f"'{Q}' is all zeros (1920 elements)"


def test_an_e8m0_nan_byte_makes_its_mxfp4_group_nan(tmp_path):
    src = rewrite(checkpoint(GPT_OSS), tmp_path / "hf", _scale(EXPERTS + "_scales", lambda s: s[1, 5].fill_(0xFF)))
    report = ckpttool.audit(src)
    assert _codes(report, EXPERTS)["nan"] == f"'{EXPERTS}' holds 64 NaN values of {3 * 64 * 192}"
    assert "quant-scale-invalid" in _codes(report, EXPERTS + "_scales")


def test_the_statistics_are_those_of_the_dequantized_weights():
    """RMS, min and max of each quantized weight equal those of torch's (FP8) and transformers' (MXFP4)
    dequantization; other tensors keep their stored dtype and fingerprint."""
    for fixture, oracle in ((DEEPSEEK, fp8_oracle(DEEPSEEK, torch.float32)), (GPT_OSS, mxfp4_oracle(torch.float32))):
        report = ckpttool.audit(checkpoint(fixture))
        stats = {s.name: s for s in report.stats}
        assert not [n for n in stats if n.endswith(("_scale_inv", "_scales", "_blocks"))]
        for name, tensor in oracle.items():
            s = stats[name]
            x = tensor.double()
            assert s.min == float(x.min()) and s.max == float(x.max()), name
            assert math.isclose(s.rms, float(x.square().mean().sqrt()), rel_tol=1e-6), name
        kept = "model.norm.weight"
        assert stats[kept].dtype == "BF16" and stats[kept].fingerprint == _fingerprint(checkpoint(fixture), kept)


def _fingerprint(directory, name):
    from ckpttool.io.dtypes import dtype_name
    from ckpttool.plan.plan import Target

    tensor = load_output(directory)[name]
    stats = Statistics(Target(name, tuple(tensor.shape), dtype_name(tensor.dtype), dtype_name(tensor.dtype), (), ()))
    stats.add(tensor)
    return stats.result().fingerprint
