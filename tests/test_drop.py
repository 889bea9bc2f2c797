"""Merge and audit agree on extra tensors: a buffer the model declares non-persistent, which some savers write anyway,
is dropped with a note; any other tensor the architecture lacks is an error naming it, unless ``--drop`` names it."""

from __future__ import annotations

import json
import shutil

import torch
from conftest import assert_failed_cleanly, fixture_dir, load_output
from safetensors.torch import load_file, save_file

import ckpttool

EXTRA = "model.layers.0.mlp.extra_proj.weight"


def with_extra(tmp_path):
    """The FSDP2 fixture merged to HF, plus one tensor no Llama has."""
    src = tmp_path / "hf"
    ckpttool.merge(fixture_dir("llama_fsdp2_dcp") / "checkpoint", src, audit=False)
    tensors = load_file(src / "model.safetensors")
    tensors[EXTRA] = torch.zeros(4, 4)
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (src / "ckpttool-audit.json").unlink(missing_ok=True)
    return src


def test_an_unknown_extra_tensor_is_an_error_naming_it(cli, tmp_path):
    result = cli("merge", with_extra(tmp_path), tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"'{EXTRA}': not a tensor of a llama model built from this config")


def test_drop_leaves_it_out_with_a_note(cli, tmp_path):
    src = with_extra(tmp_path)
    result = cli("merge", src, tmp_path / "out", "--drop", r"model\.layers\.\d+\.mlp\.extra_proj\.weight")
    assert result.exit_code == 0, result.output
    assert f"dropped {EXTRA}: matched by the drop pattern 'model\\.layers\\.\\d+\\.mlp" in result.output
    assert EXTRA not in load_output(tmp_path / "out")
    assert sorted(load_output(tmp_path / "out")) == sorted(load_output(fixture_dir("llama_fsdp2_dcp") / "reference"))


def test_a_drop_pattern_that_matches_nothing_is_an_error(cli, tmp_path):
    result = cli("merge", fixture_dir("llama_fsdp2_dcp") / "checkpoint", tmp_path / "out", "--drop", "model.typo")
    assert_failed_cleanly(result, tmp_path / "out", "--drop 'model.typo' matches no tensor of the source (names are "
                          "matched whole, after mapping to HuggingFace names)")


def test_a_drop_pattern_that_is_no_regular_expression_is_an_error(cli, tmp_path):
    result = cli("merge", fixture_dir("llama_fsdp2_dcp") / "checkpoint", tmp_path / "out", "--drop", "model.(")
    assert_failed_cleanly(result, tmp_path / "out", "--drop 'model.(' is not a name or a regular expression")


def test_a_non_persistent_buffer_is_dropped_by_merge_and_noted_by_audit(tmp_path):
    src = tmp_path / "moe"
    shutil.copytree(fixture_dir("colossalai_real_mixtral_ep2_bin") / "checkpoint", src)
    index = json.loads((src / "pytorch_model.bin.index.json").read_text())
    assert "model.rotary_emb.inv_freq" in index["weight_map"]
    report = ckpttool.audit(src, data=False)
    assert report.ok
    assert any(f.code == "source-note" and "dropped model.rotary_emb.inv_freq" in f.message for f in report.findings)
