"""What can be wrong with a quantized checkpoint: each defect is one audit finding with its message, and a merge
refuses it before writing anything."""

from __future__ import annotations

import pytest
import torch
from test_quantized import DEEPSEEK, GPT_OSS, QWEN3, checkpoint, rewrite

import ckpttool
from ckpttool.errors import ConfigError

Q = "model.layers.0.self_attn.q_proj.weight"
GATE = "model.layers.0.mlp.gate_proj.weight"  # DeepSeek's dense layer: [72, 40], 16x16 blocks -> scales [5, 3]
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"  # gpt-oss: blocks [3, 192, 2, 16], scales [3, 192, 2]


def _drop(name):
    return lambda tensors, config: tensors.pop(name)


def _set(name, value):
    return lambda tensors, config: tensors.__setitem__(name, value(tensors[name]))


def _config(change):
    return lambda tensors, config: change(config["quantization_config"])


def _bad_scales(scale):
    scale = scale.clone()
    scale[0, 0], scale[0, 1], scale[0, 2], scale[1, 0] = float("nan"), float("inf"), 0.0, -1.0
    return scale


def _dequantized_by_hand(tensors, config):
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        tensors[weight] = tensors[weight].to(torch.bfloat16)
        del tensors[name]


CASES = [
    (QWEN3, _drop(Q + "_scale_inv"), "quant-scale-missing", Q,
     (f"'{Q}' is F8_E4M3 (FP8) but '{Q}_scale_inv' is not in the checkpoint: its values cannot be dequantized "
      "(transformers would use them without a scale). Restore the scale tensor")),
    (QWEN3, _drop(Q), "quant-scale-orphan", Q + "_scale_inv",
     (f"'{Q}_scale_inv' is a scale, but its weight '{Q}' is not in the checkpoint (38 tensors). Restore the weight, or "
      "drop the scale")),
    (DEEPSEEK, _set(GATE + "_scale_inv", lambda s: s[:4, :2]), "quant-scale-shape", GATE + "_scale_inv",
     (f"'{GATE}_scale_inv' has shape [4, 2], but '{GATE}' [72, 40] in 16x16 blocks (weight_block_size in '{{config}}') "
      "needs [5, 3] (rounded down: the cropped edge blocks have no scale): one scale per block, edge blocks cropped. Was "
      "it quantized with another block size, or cut by a split?")),
    (QWEN3, _set(Q + "_scale_inv", lambda s: s.to(torch.uint8)), "quant-scale-dtype", Q + "_scale_inv",
     (f"'{Q}_scale_inv' is U8; FP8 scales are F32, BF16, F16 or F8_E8M0 (U8 only as E8M0 bytes, with scale_fmt "
      "\"ue8m0\"; '{config}' says 'float')")),
    (QWEN3, _set(Q + "_scale_inv", _bad_scales), "quant-scale-invalid", Q + "_scale_inv",
     (f"'{Q}_scale_inv': 1 NaN, 1 infinite, 1 zero, 1 negative of its 30 scales: every value of those blocks "
      "dequantizes to NaN, infinity, zero or its own negative, whatever is stored. Quantize those blocks again from "
      "the original weights")),
    (QWEN3, lambda tensors, config: config.pop("quantization_config"), "quant-config-missing", None,
     ("14 tensors are quantized ('model.layers.0.mlp.down_proj.weight', 'model.layers.0.mlp.gate_proj.weight', "
      "'model.layers.0.mlp.up_proj.weight' and 11 more) but the config has no quantization_config: transformers would "
      "load the stored values as plain weights, without their scales. Add the release's quantization_config to "
      "config.json")),
    (QWEN3, _config(lambda q: q.update(fmt="e5m2")), "quant-config-mismatch", "model.layers.0.mlp.down_proj.weight",
     ("'model.layers.0.mlp.down_proj.weight' is F8_E4M3, but '{config}' declares fp8 F8_E5M2 with 8x8 blocks (float "
      "scales)")),
    (QWEN3, _dequantized_by_hand, "quant-config-mismatch", None,
     ("'{config}' declares fp8 F8_E4M3 with 8x8 blocks (float scales) (quantization_config) but no tensor is "
      "quantized: transformers would build quantized layers and find no scales. Remove quantization_config")),
    (QWEN3, _config(lambda q: q.update(modules_to_not_convert=["lm_head", "model.layers.1.self_attn.o_proj"])),
     "quant-not-converted", "model.layers.1.self_attn.o_proj.weight",
     ("'model.layers.1.self_attn.o_proj.weight' is quantized, but modules_to_not_convert in '{config}' names "
      "'model.layers.1.self_attn.o_proj': transformers would load its stored values as a plain weight, without the "
      "scales. Remove it from the list")),
    (GPT_OSS, _drop(EXPERTS + "_scales"), "quant-scale-missing", EXPERTS + "_blocks",
     (f"'{EXPERTS}_blocks' holds MXFP4 blocks but '{EXPERTS}_scales' is not in the checkpoint: its values cannot be "
      "decoded. Restore the scales")),
    (GPT_OSS, _set(EXPERTS + "_scales", lambda s: s[:, :, :1]), "quant-scale-shape", EXPERTS + "_scales",
     (f"'{EXPERTS}_scales' has shape [3, 192, 1] and '{EXPERTS}_blocks' [3, 192, 2, 16]; MXFP4 stores [..., R, G, 16] "
      "blocks with [..., R, G] scales (one per 16 bytes)")),
    (GPT_OSS, _set(EXPERTS + "_scales", lambda s: s.index_fill(2, torch.tensor([0]), 0xFF)), "quant-scale-invalid",
     EXPERTS + "_scales", f"'{EXPERTS}_scales': 576 NaN of its 1152 scales: every value"),
]


@pytest.mark.parametrize(("fixture", "change", "code", "tensor", "message"), CASES,
                         ids=[f"{c[0].split('_')[1]}-{c[2]}-{i}" for i, c in enumerate(CASES)])
def test_each_defect_is_a_finding_with_its_message(tmp_path, fixture, change, code, tensor, message):
    damaged = rewrite(checkpoint(fixture), tmp_path / "hf", change)
    report = ckpttool.audit(damaged)
    found = [f for f in report.findings if f.code == code and f.tensor == tensor]
    assert found, [(f.code, f.tensor, f.message) for f in report.findings]
    assert found[0].message.startswith(message.replace("{config}", str(damaged / "config.json")))
    assert not report.ok


def test_a_merge_refuses_a_defect_before_writing_anything(tmp_path, cli):
    damaged = rewrite(checkpoint(QWEN3), tmp_path / "hf", _drop(Q + "_scale_inv"))
    with pytest.raises(ConfigError) as e:
        ckpttool.merge(damaged, tmp_path / "api")
    assert str(e.value).startswith(f"the quantized checkpoint in '{damaged}' is inconsistent (1 problem):\n  - '{Q}' is F8")
    assert str(e.value).endswith("ckpttool never guesses a missing scale or a block size; `ckpttool audit` lists the "
                                 "same problems.")
    result = cli("merge", damaged, tmp_path / "out", "--dtype", "bf16")
    assert result.exit_code == 1 and "Traceback" not in result.output and not (tmp_path / "out").exists()
    assert f"Error: the quantized checkpoint in '{damaged}' is inconsistent (1 problem)" in result.stderr


def test_dequantizing_without_a_config_is_refused_not_cast(tmp_path, cli):
    """A plain cast would write FP8 values unscaled and round the float32 scales to bfloat16: refused."""
    bare = rewrite(checkpoint(QWEN3), tmp_path / "hf", lambda tensors, config: None)
    (bare / "config.json").unlink()
    result = cli("merge", bare, tmp_path / "out", "--dtype", "bf16")
    assert result.exit_code == 1 and not (tmp_path / "out").exists()
    assert ("--dtype asks to dequantize, but there is no config.json to say how: 14 tensors are quantized "
            "('model.layers.0.mlp.down_proj.weight', ...) and only the config's quantization_config gives their block "
            "size") in result.stderr
    kept = cli("merge", bare, tmp_path / "kept")  # without --dtype: a generic merge, kept as it is
    assert kept.exit_code == 0, kept.output


def test_a_quantization_ckpttool_does_not_read_stops_the_merge_naming_it(tmp_path, cli):
    other = rewrite(checkpoint(QWEN3), tmp_path / "hf", _config(lambda q: q.update(quant_method="gptq")))
    result = cli("merge", other, tmp_path / "out")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (f"Error: '{other / 'config.json'}': quantization_config has quant_method 'gptq'; ckpttool reads 'fp8' "
            "(block-scaled) and 'mxfp4' checkpoints only") in result.stderr
