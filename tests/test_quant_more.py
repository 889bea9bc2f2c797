"""``merge --quantize int4|int4-asym|nvfp4 --scales-from RELEASE``: a model whose values lie on a release's grid
(the release dequantized by its producer's own oracle, or by ckpttool) re-packs with the release's scales to the
release's bytes, tensor for tensor (compressed-tensors INT4 symmetric and asymmetric, compressed-tensors NVFP4,
ModelOpt NVFP4 with its -0 codes); a value off the grid, a release of another model or format, refused with
their message, exit code and nothing written."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, build_in_row_chunks, load_output
from safetensors.torch import load_file, save_file

from ckpttool.commands.merge import merge as ckpttool_merge
from ckpttool.commands.merge import prepare
from ckpttool.commands.release import read_release
from ckpttool.families.quantize import quantize_block
from ckpttool.families.quantize_release import check_method

pytestmark = pytest.mark.usefixtures("describe_inline")

#: fixture -> the --quantize method of its format
RELEASES = {"quantized_qwen3_int4": "int4", "quantized_llama_int4_asym": "int4-asym",
            "quantized_qwen3_nvfp4": "nvfp4", "quantized_llama_nvfp4_modelopt": "nvfp4"}


def _bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""


def assert_same_tensors(out: Path, release: Path) -> None:
    got, want = load_output(out), load_output(release)
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert (got[name].dtype, tuple(got[name].shape)) == (t.dtype, tuple(t.shape)), name
        assert _bytes(got[name]) == _bytes(t), name


@pytest.mark.parametrize("fixture", sorted(RELEASES))
def test_the_oracle_dequantized_release_repacks_to_the_release_bytes(cli, tmp_path, fixture):
    """The producer's own dequantization (fixtures' reference/) re-packed with the release's scales: every tensor
    byte for byte the release's (ModelOpt's code-8 zeros, dequantized to +0, keep the release's code), and the
    release's quantization_config written as it is."""
    release = FIXTURES / fixture / "checkpoint"
    out = tmp_path / "out"
    result = cli("merge", FIXTURES / fixture / "reference", out, "--quantize", RELEASES[fixture],
                 "--scales-from", release)
    assert result.exit_code == 0, result.output
    assert_same_tensors(out, release)
    label = "nvfp4:" if RELEASES[fixture] == "nvfp4" else "int4:"
    assert f"{label:<10}14 weights quantized; worst round trip " in result.output  # each one exact
    assert "max |error| 0 (" in result.output and "relative RMS error 0\n" in result.output
    written = json.loads((out / "config.json").read_text())["quantization_config"]
    assert written == json.loads((release / "config.json").read_text())["quantization_config"]


@pytest.mark.parametrize("fixture", ["quantized_llama_int4_asym", "quantized_llama_nvfp4_modelopt"])
def test_ckpttools_own_dequantized_merge_repacks_to_the_release_bytes(cli, tmp_path, fixture):
    """merge --dtype bfloat16, then merge --quantize --scales-from: the round trip gives the release back."""
    release = FIXTURES / fixture / "checkpoint"
    plain, out = tmp_path / "bf16", tmp_path / "out"
    assert cli("merge", release, plain, "--dtype", "bfloat16", "-q").exit_code == 0
    result = cli("merge", plain, out, "--quantize", RELEASES[fixture], "--scales-from", release, "-q")
    assert result.exit_code == 0, result.output
    assert_same_tensors(out, release)


def test_row_chunks_starting_inside_a_zero_point_word_give_the_release_bytes():
    """Asymmetric INT4 built 3 rows at a time (zero points are packed 8 rows to a word): the same bytes."""
    fixture = FIXTURES / "quantized_llama_int4_asym"
    release = read_release(fixture / "checkpoint")
    scheme = replace(quantize_block("int4-asym", None, None), release=release)
    plan = prepare(fixture / "reference", quantize=scheme).plan
    want = load_file(fixture / "checkpoint" / "model.safetensors")
    targets = [t for t in plan.targets if t.name.startswith("model.layers.0.self_attn.k_proj.")]
    assert len(targets) == 4
    parts, _, _ = build_in_row_chunks(plan, targets, rows=3)
    for name, chunks in parts.items():
        assert torch.equal(torch.cat(chunks).reshape(want[name].shape), want[name]), name


def test_a_value_off_the_grid_is_refused_naming_tensor_row_and_group(cli, tmp_path):
    source = tmp_path / "trained"
    shutil.copytree(FIXTURES / "quantized_qwen3_int4" / "reference", source)
    tensors = load_file(source / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    scale = load_file(FIXTURES / "quantized_qwen3_int4" / "checkpoint" / "model.safetensors")[
        name + "_scale"][5, 1]
    tensors[name][5, 40] += scale * 0.4  # between two grid points: no rounding puts it back
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    result = cli("merge", source, out, "--quantize", "int4", "--scales-from",
                 FIXTURES / "quantized_qwen3_int4" / "checkpoint")
    assert_failed_cleanly(result, out, f"'{name}': 1 values of rows 0..128 lie off the grid",
                          "row 5, group 1 (columns 32..64)", "re-pack without")
    assert tensors[name][5, 40] == load_file(source / "model.safetensors")[name][5, 40]  # the source untouched


def test_a_release_of_another_model_is_refused(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", FIXTURES / "quantized_llama_int4_asym" / "reference", out, "--quantize", "int4",
                 "--scales-from", FIXTURES / "quantized_qwen3_int4" / "checkpoint")
    assert_failed_cleanly(result, out, "--scales-from '", "model.layers.0.mlp.down_proj.weight' is [128, 128] BF16",
                          "Is it the release this model came from?")


def test_a_method_other_than_the_releases_is_refused(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", FIXTURES / "quantized_qwen3_nvfp4" / "reference", out, "--quantize", "int4",
                 "--scales-from", FIXTURES / "quantized_qwen3_nvfp4" / "checkpoint")
    assert_failed_cleanly(result, out, "the release is compressed-tensors nvfp4", "give --quantize nvfp4")
    with pytest.raises(ValueError, match="the release's groups are 32; give no group"):
        check_method("int4", 128, read_release(FIXTURES / "quantized_qwen3_int4" / "checkpoint"))


def test_a_release_that_is_not_packed_is_refused(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", FIXTURES / "quantized_qwen3_int4" / "reference", out, "--quantize", "int4",
                 "--scales-from", FIXTURES / "quantized_qwen3_int4" / "reference")
    assert_failed_cleanly(result, out, "its config declares no quantization_config",
                          "scales are taken from a packed release")


def test_scales_from_without_a_packing_method_is_a_usage_error(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", FIXTURES / "quantized_qwen3_int4" / "reference", out,
                 "--scales-from", FIXTURES / "quantized_qwen3_int4" / "checkpoint")
    assert result.exit_code == 2
    assert "give --quantize int4, int4-asym or nvfp4" in result.output
    assert not out.exists()


# ModelOpt FP8 per tensor (quant_method modelopt, quant_algo FP8): fixtures/quantized_llama_fp8_modelopt, made by
# nvidia-modelopt 0.47 (mtq.quantize FP8_DEFAULT_CFG + export_hf_checkpoint); its reference/ is ModelOpt's own
# FP8QTensor.dequantize(torch.bfloat16) of each weight (fp8.to(bf16) * scale.to(bf16), in bfloat16).
FP8 = FIXTURES / "quantized_llama_fp8_modelopt"


def test_modelopt_fp8_merges_as_is_byte_for_byte(cli, tmp_path):
    out = tmp_path / "out"
    assert cli("merge", FP8 / "checkpoint", out, "-q").exit_code == 0
    assert_same_tensors(out, FP8 / "checkpoint")
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["quant_algo"]) == ("modelopt", "FP8")


def test_modelopt_fp8_dequantizes_bit_exact_with_modelopts_formula_and_loads_strictly(cli, tmp_path):
    import transformers

    out, wide = tmp_path / "bf16", tmp_path / "f32"
    assert cli("merge", FP8 / "checkpoint", out, "--dtype", "bfloat16", "-q").exit_code == 0
    assert_same_tensors(out, FP8 / "reference")  # -0 and all: the bytes of FP8QTensor.dequantize
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    model, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    assert torch.isfinite(model(torch.arange(8).unsqueeze(0)).logits).all()
    assert cli("merge", FP8 / "checkpoint", wide, "--dtype", "float32", "-q").exit_code == 0
    stored, got = load_output(FP8 / "checkpoint"), load_output(wide)
    for name, t in stored.items():
        if t.dtype == torch.float8_e4m3fn:  # in float32, FP8QTensor.dequantize(torch.float32) is exact
            assert torch.equal(got[name], t.float() * stored[name + "_scale"]), name


def _damaged_fp8(tmp_path: Path, **scales: float) -> Path:
    damaged = tmp_path / "damaged"
    shutil.copytree(FP8 / "checkpoint", damaged)
    tensors = load_file(damaged / "model.safetensors")
    for name, value in scales.items():
        tensors[name.replace("__", ".") + ".weight_scale"] = torch.tensor(value)
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    return damaged


def test_a_nan_or_zero_modelopt_fp8_scale_is_named_by_the_audit_and_refused_by_a_dequantizing_merge(cli, tmp_path):
    up, q = "model.layers.0.mlp.up_proj", "model.layers.1.self_attn.q_proj"
    damaged = _damaged_fp8(tmp_path, **{up.replace(".", "__"): float("nan"), q.replace(".", "__"): 0.0})
    result = cli("audit", damaged, "--json")
    assert result.exit_code == 3
    found = {(f["code"], f["tensor"]): f["message"] for f in json.loads(result.stdout)["findings"]}
    assert found[("quant-scale-invalid", up + ".weight_scale")].startswith(f"'{up}.weight_scale': 1 NaN of its 1 scales")
    assert found[("quant-scale-invalid", q + ".weight_scale")].startswith(f"'{q}.weight_scale': 1 zero of its 1 scales")
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", damaged, out, "--dtype", "bfloat16"), out,
                          f"'{up}.weight': its weight_scale is nan, which would make every value of the tensor NaN")


def test_a_modelopt_fp8_scale_of_another_shape_is_a_header_finding(tmp_path):
    import ckpttool

    damaged = tmp_path / "damaged"
    shutil.copytree(FP8 / "checkpoint", damaged)
    tensors = load_file(damaged / "model.safetensors")
    name = "model.layers.0.self_attn.k_proj.weight_scale"
    tensors[name] = torch.ones(32)
    save_file(tensors, damaged / "model.safetensors", metadata={"format": "pt"})
    report = ckpttool.audit(damaged)
    found = [f for f in report.findings if f.code == "quant-scale-shape" and f.tensor == name]
    assert found and found[0].message.startswith(f"'{name}' is F32 [32]; a ModelOpt FP8 weight scale"), report.findings


def test_a_modelopt_algorithm_ckpttool_does_not_read_is_refused_naming_the_key(cli, tmp_path):
    source = tmp_path / "other"
    shutil.copytree(FP8 / "checkpoint", source)
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"]["quant_algo"] = "W4A8_AWQ"
    (source / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", source, out, "--dtype", "bfloat16"), out,
                          "quantization_config.quant_algo is 'W4A8_AWQ'; ckpttool reads ModelOpt 'NVFP4' and 'FP8'")


def test_a_release_missing_a_weight_of_the_model_or_its_config_is_refused(cli, tmp_path):
    release = FIXTURES / "quantized_qwen3_int4" / "checkpoint"
    out = tmp_path / "out"
    dropped = "model.layers.1.mlp.up_proj.weight"
    result = cli("merge", FIXTURES / "quantized_qwen3_int4" / "reference", out, "--quantize", "int4",
                 "--scales-from", release, "--drop", dropped)
    assert_failed_cleanly(result, out, "the release packs 1 weights the merged model", f"('{dropped}', ...)")
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(release / "model.safetensors", bare / "model.safetensors")
    result = cli("merge", FIXTURES / "quantized_qwen3_int4" / "reference", out, "--quantize", "int4",
                 "--scales-from", bare)
    assert_failed_cleanly(result, out, f"--scales-from '{bare}': no config.json there")
    with pytest.raises(ValueError, match="give quantize='int4', 'int4-asym' or 'nvfp4'"):
        ckpttool_merge(FIXTURES / "quantized_qwen3_int4" / "reference", out, scales_from=release)
    assert not out.exists()


def test_an_nvfp4_value_off_the_grid_is_refused(cli, tmp_path):
    fixture = FIXTURES / "quantized_llama_nvfp4_modelopt"
    source = tmp_path / "trained"
    shutil.copytree(fixture / "reference", source)
    tensors = load_file(source / "model.safetensors")
    name = "model.layers.0.self_attn.o_proj.weight"
    tensors[name][3, 20] = tensors[name][3, 16:32].abs().max() * 0.8  # no E2M1 value is 0.8 of a group's largest
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    result = cli("merge", source, out, "--quantize", "nvfp4", "--scales-from", fixture / "checkpoint")
    assert_failed_cleanly(result, out, f"'{name}': 1 values of rows 0..64 lie off the grid",
                          "row 3, group 1 (columns 16..32)")


def test_a_release_file_cut_short_is_named():
    from ckpttool.errors import SourceError
    from ckpttool.quant.on_grid import ReleaseTensor

    path = FIXTURES / "quantized_qwen3_int4" / "checkpoint" / "model.safetensors"
    size = path.stat().st_size
    tensor = ReleaseTensor("x.weight_scale", str(path), size - 8, "BF16", (4, 2))
    with pytest.raises(SourceError, match=r"the release's 'x.weight_scale' is cut short \(8 of 16 bytes at rows 0..4\)"):
        tensor.rows(0, 4)
