"""What a user meets in the first hour of ``audit`` and ``diff``: a config transformers cannot load, stray
safetensors files, a tensor name no UTF-8 page can hold, where the HTML report went, and counts worded right.

Every case runs the command line and asserts its exit code and its exact lines.
"""

from __future__ import annotations

import json
import struct

import torch
from safetensors.torch import save_file

from conftest import fixture_dir
from test_audit import reference, write_hf
from ckpttool.console.words import counted

LLAMA = "llama_fsdp2_dcp"
INDEX = "model.safetensors.index.json"


def llama_hf(tmp_path, shards: int = 1, **config_changes):
    tensors, config = reference(LLAMA)
    return write_hf(tmp_path / "hf", tensors, {**config, **config_changes}, shards=shards)


# ------------------------------------------------------------------------------ a config transformers cannot load


def test_an_unknown_model_type_is_an_error_naming_config_json_and_the_key(cli, tmp_path):
    hf = llama_hf(tmp_path, model_type="not-a-real-model")
    result = cli("audit", hf, "--no-data")
    import transformers

    assert result.exit_code == 3, result.output
    assert result.stdout == (
        "error    config-invalid  config.json\n"
        f"         '{hf / 'config.json'}': model_type 'not-a-real-model' is not a model type transformers "
        f"{transformers.__version__} knows, and config.json has no auto_map to custom code: from_pretrained cannot load "
        "this directory. Set model_type to the architecture's (e.g. 'llama'), or upgrade transformers\n"
        "family: generic (transformers cannot load the config)\n"
        "audit: FAIL, 1 error, 0 warnings, 0 info (21 tensors, headers only)\n"
    )


def test_an_unknown_model_type_with_custom_code_is_no_error(cli, tmp_path):
    hf = llama_hf(tmp_path, model_type="not-a-real-model", auto_map={"AutoConfig": "mine.MyConfig"})
    result = cli("audit", hf, "--no-data", "--json")
    assert result.exit_code == 0, result.output
    assert [f["code"] for f in json.loads(result.stdout)["findings"]] == ["no-config"]


def test_a_vocab_size_that_is_a_string_is_an_error_naming_the_key(cli, tmp_path):
    hf = llama_hf(tmp_path, vocab_size="lots")
    result = cli("audit", hf, "--no-data")
    assert result.exit_code == 3, result.output
    assert result.stdout == (
        "error    config-invalid  config.json\n"
        f"         '{hf / 'config.json'}': transformers rejects this llama config: Validation error for field "
        "'vocab_size': TypeError: Field 'vocab_size' expected int, got str (value: 'lots'). Fix config.json: "
        "from_pretrained cannot load this checkpoint\n"
        "family: generic (transformers cannot load the config)\n"
        "audit: FAIL, 1 error, 0 warnings, 0 info (21 tensors, headers only)\n"
    )
    doc = json.loads(cli("audit", hf, "--no-data", "--json").stdout)
    assert [(f["code"], f["severity"], f["file"]) for f in doc["findings"]] == [("config-invalid", "error", "config.json")]


# ------------------------------------------------------------------------------------------ stray safetensors files


def test_a_file_the_index_does_not_name_is_a_warning_transformers_ignores_it(cli, tmp_path):
    hf = llama_hf(tmp_path, shards=2)
    save_file({"x": torch.zeros(2)}, str(hf / "extra.safetensors"))
    result = cli("audit", hf, "--no-data")
    assert result.exit_code == 0, result.output
    assert result.stdout == (
        "warning  file-unreferenced  extra.safetensors\n"
        f"         'extra.safetensors' is not named by '{INDEX}': transformers ignores it (from_pretrained reads only "
        "the files the index names)\n"
        "family: llama (names as transformers saves them)\n"
        "audit: PASS WITH WARNINGS, 0 errors, 1 warning, 0 info (21 tensors, headers only)\n"
    )


def test_a_file_beside_model_safetensors_without_an_index_is_a_warning(cli, tmp_path):
    hf = llama_hf(tmp_path)
    save_file({"x": torch.zeros(2)}, str(hf / "model-00002-of-00002.safetensors"))
    save_file({"x": torch.zeros(2)}, str(hf / "adapter_model.safetensors"))  # PEFT reads it: no finding
    result = cli("audit", hf, "--no-data")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith(
        "warning  file-unreferenced  model-00002-of-00002.safetensors\n"
        "         'model-00002-of-00002.safetensors' is not model.safetensors and no model.safetensors.index.json "
        "names it: transformers ignores it (from_pretrained reads only model.safetensors)\n"
        "family: llama"
    )


def test_model_safetensors_beside_an_index_is_an_error_transformers_loads_it(cli, tmp_path):
    """from_pretrained looks for model.safetensors before the index: the shards the audit read are not loaded."""
    hf = llama_hf(tmp_path, shards=2)
    save_file({"x": torch.zeros(2)}, str(hf / "model.safetensors"))
    save_file({"x": torch.zeros(2)}, str(hf / "extra.safetensors"))
    result = cli("audit", hf, "--no-data")
    assert result.exit_code == 3, result.output
    assert result.stdout == (
        "error    index-shadowed     model.safetensors\n"
        f"         'model.safetensors' is not named by '{INDEX}', but transformers loads it and ignores the index "
        "(from_pretrained reads model.safetensors first): the tensors audited here are not the ones it loads. Remove "
        "'model.safetensors' or the index\n"
        "warning  file-unreferenced  extra.safetensors\n"
        f"         'extra.safetensors' is not named by '{INDEX}': transformers ignores it (from_pretrained reads only "
        "the files the index names)\n"
        "family: llama (names as transformers saves them)\n"
        "audit: FAIL, 1 error, 1 warning, 0 info (21 tensors, headers only)\n"
    )


# ------------------------------------------------------------------------------------------------ the HTML report


def surrogate_checkpoint(tmp_path):
    """A model.safetensors whose one tensor name holds a lone surrogate (``\\udc80`` in the JSON header, as a
    name decoded with ``surrogateescape`` is written), the header bytes written by hand."""
    src = tmp_path / "surrogate"
    src.mkdir()
    header = json.dumps({"__metadata__": {"format": "pt"},
                         "bad\udc80name": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}).encode()
    assert b"\\udc80" in header
    header += b" " * (-len(header) % 8)
    (src / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + struct.pack("<4f", 1, 2, 3, 4))
    return src


def test_a_lone_surrogate_in_a_tensor_name_is_escaped_in_the_html_report(cli, tmp_path):
    src = surrogate_checkpoint(tmp_path)
    page = tmp_path / "report.html"
    plain = cli("audit", src, "--strict")
    result = cli("audit", src, "--strict", "--html", page)
    assert "Traceback" not in result.output
    assert result.exit_code == plain.exit_code == 3  # the audit's: config-missing, a warning made an error
    assert result.stdout == plain.stdout
    assert result.stderr.endswith(f"HTML report written to {page}\n")
    html = page.read_text(encoding="utf-8")
    assert "<code>bad\\udc80name</code>" in html
    assert "1 error, 0 warnings, 0 info</p>" in html


def test_the_html_report_says_where_it_was_written_on_stderr(cli, tmp_path):
    hf = llama_hf(tmp_path)
    page = tmp_path / "report.html"
    result = cli("audit", hf, "--no-data", "--html", page)
    assert result.exit_code == 0, result.output
    assert result.stderr == f"HTML report written to {page}\n"
    assert result.stdout.endswith("audit: PASS, 0 errors, 0 warnings, 0 info (21 tensors, headers only)\n")
    assert page.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_with_json_stdout_is_one_document_and_the_path_goes_to_stderr(cli, tmp_path):
    hf = llama_hf(tmp_path)
    page = tmp_path / "report.html"
    result = cli("audit", hf, "--no-data", "--json", "--html", page)
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["summary"]["verdict"] == "pass"
    assert result.stderr == f"HTML report written to {page}\n"


# --------------------------------------------------------------------------------------------- counts in words


def test_counts_take_the_singular_for_one():
    assert [counted(n, "error") for n in (0, 1, 2)] == ["0 errors", "1 error", "2 errors"]
    assert counted(1, "info", "info") == "1 info" and counted(3, "info", "info") == "3 info"


def test_one_tensor_one_file_one_worker_in_a_dry_run(cli, tmp_path):
    src = tmp_path / "one"
    src.mkdir()
    save_file({"w": torch.ones(2)}, str(src / "model.safetensors"))
    result = cli("merge", src, "--dry-run", "--workers", "1")
    assert result.exit_code == 0, result.output
    assert "coverage: ok, 1 tensor each covered exactly once\n" in result.stdout
    assert "(would write 8 B in 1 file)\n" in result.stdout
    assert "  model.safetensors  1 tensor  8 B\n" in result.stdout
    assert " with 1 worker (largest tensor 8 B)\n" in result.stdout
    assert "  w  F32 [2]  <- w (1 piece)\n" in result.stdout


def test_diff_says_what_differs_with_counts_that_add_up(cli):
    a, b = fixture_dir(LLAMA) / "reference", fixture_dir("mixtral_fsdp2_dcp") / "reference"
    result = cli("diff", a, b, "-q")
    assert result.exit_code == 3, result.output
    assert result.stdout.endswith(
        "different: 6 tensors only in A, 26 only in B, 15 in both and equal, 0 in both and different "
        "(A has 21 tensors, B 41)\n")  # 6 + 15 + 0 = 21, 26 + 15 + 0 = 41
    doc = json.loads(cli("diff", a, b, "--json").stdout)
    assert doc["counts"] == {"only_a": 6, "only_b": 26, "equal": 15, "different": 0}
    assert doc["tensors"] == sum(doc["counts"].values())


def test_diff_of_a_changed_shape_counts_it_in_both_and_different(cli, tmp_path):
    tensors, config = reference(LLAMA)
    tensors["model.norm.weight"] = torch.ones(64)
    changed = write_hf(tmp_path / "changed", tensors, config)
    (changed / "config.json").unlink()  # no architecture to refuse the shape: the diff compares what is stored
    result = cli("diff", fixture_dir(LLAMA) / "reference", changed, "-q")
    assert result.exit_code == 3, result.output
    assert result.stdout == (
        "  model.norm.weight: shapes differ: A F32 [32], B F32 [64]\n"
        "different: 0 tensors only in A, 0 only in B, 20 in both and equal, 1 in both and different "
        "(A has 21 tensors, B 21)\n"
    )


def test_diff_of_equal_checkpoints(cli):
    result = cli("diff", fixture_dir(LLAMA) / "reference", fixture_dir("llama_tp2_dcp") / "checkpoint", "-q")
    assert result.exit_code == 0, result.output
    assert result.stdout == "equal: 21 tensors identical\n"
