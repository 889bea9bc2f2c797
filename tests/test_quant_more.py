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
                 "--scales-from", release, "-q")
    assert result.exit_code == 0, result.output
    assert_same_tensors(out, release)
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
