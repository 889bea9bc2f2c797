"""The CLI: exit codes, messages naming file, tensor and region, nothing left at the destination."""

from __future__ import annotations

import json
import pickle


from conftest import assert_failed_cleanly, fixture_dir, tree_digest


def test_merge_prints_summary_and_exits_0(cli, tmp_path):
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out)
    assert result.exit_code == 0, result.output
    assert "coverage: ok, 21 tensors each covered exactly once" in result.stdout
    assert "model.safetensors  21 tensors" in result.stdout
    assert (out / "model.safetensors").is_file()


def test_json_prints_one_document(cli, tmp_path):
    result = cli("merge", fixture_dir("mixtral_hf_tp2_ep2") / "checkpoint", tmp_path / "hf", "--json")
    assert result.exit_code == 0
    doc = json.loads(result.stdout)
    assert doc["status"] == "ok" and doc["format"] == "hf-distributed"
    assert doc["tensors"] == 41
    assert doc["files"] == [{"name": "model.safetensors", "bytes": doc["total_bytes"], "tensors": 41}]
    assert result.stderr == ""


def test_json_error_is_one_document_too(cli, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("merge", empty, tmp_path / "hf", "--json")
    assert result.exit_code == 1
    doc = json.loads(result.stdout)
    assert doc["status"] == "error" and "no checkpoint format recognised" in doc["error"]


def test_dry_run_reads_no_tensor_data_and_writes_nothing(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    for f in src.glob("*.distcp"):  # same sizes, garbage bytes: only reading data could notice
        f.write_bytes(b"\xff" * f.stat().st_size)
    out = tmp_path / "hf"
    result = cli("merge", src, out, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "coverage: ok" in result.stdout and "would write" in result.stdout
    assert "model.embed_tokens.weight  F32 [1001x32]  <- model.embed_tokens.weight (2 pieces)" in result.stdout
    assert not out.exists()
    failed = cli("merge", src, out)
    assert_failed_cleanly(failed, out, "'__0_0.distcp': cannot load")


def test_deleted_rank_file_names_the_region_and_the_file(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    (src / "__1_0.distcp").unlink()
    before = tree_digest(src.parent)
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    assert_failed_cleanly(
        result, out,
        "'model.embed_tokens.weight': rows 501..1001 covered by no piece (shape [1001, 32]; found 1 piece in '__0_0.distcp')",
        "The metadata places them in '__1_0.distcp', which is missing",
    )
    assert tree_digest(src.parent) == before


def test_dropped_chunk_in_metadata_is_a_coverage_error(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_fsdp2_dcp")
    # test-only: our own fixture, trusted, so plain pickle may rewrite it
    metadata = pickle.loads((src / ".metadata").read_bytes())
    chunks = metadata.state_dict_metadata["model.embed_tokens.weight"].chunks
    dropped = max(chunks, key=lambda c: c.offsets[0])
    chunks.remove(dropped)
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    start = dropped.offsets[0]
    assert_failed_cleanly(
        result, out,
        f"'model.embed_tokens.weight': rows {start}..{start + dropped.sizes[0]} covered by no piece",
        "found 3 pieces in",
        "Is a rank's file missing, or the checkpoint incomplete?",
    )


def test_deleted_transformers_rank_file_is_a_coverage_error(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_hf_tp2")
    (src / "shard-00001-model-00001-of-00001.safetensors").unlink()
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    assert_failed_cleanly(
        result, out,
        "'lm_head.weight': rows 0..501 covered by no piece (shape [1001, 32]; found 1 piece in "
        "'shard-00002-model-00001-of-00001.safetensors')",
        "These files of the checkpoint are missing: 'shard-00001-model-*.safetensors'",
    )


def test_deleted_expert_parallel_rank_names_the_experts(cli, copy_fixture, tmp_path):
    src = copy_fixture("mixtral_hf_tp2_ep2")
    (src / "shard-00002-model-00001-of-00001.safetensors").unlink()
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'model.layers.0.block_sparse_moe.experts.2.w1.weight': the whole tensor covered by no piece")


def test_transformers_distributed_needs_a_config(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_hf_tp2")
    (src / "config.json").unlink()
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "record no global shapes", "pass --config")


def test_config_of_another_model_is_refused_with_every_problem(cli, tmp_path):
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out,
                 "--config", fixture_dir("mixtral_fsdp2_dcp") / "reference")
    assert_failed_cleanly(
        result, out,
        "does not match its mixtral config",
        "'model.layers.0.mlp.gate_proj.weight': not a tensor of a mixtral model built from this config",
        "'model.layers.0.block_sparse_moe.experts.0.w1.weight': expected by the config but not in the checkpoint",
    )


def test_wrong_vocab_size_in_config_is_explained(cli, tmp_path):
    config = json.loads((fixture_dir("llama_tp2_dcp") / "config.json").read_text())
    config["vocab_size"] = 2002
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--config", tmp_path / "config.json")
    assert_failed_cleanly(
        result, out,
        "'model.embed_tokens.weight': shape [1001, 32], but the config gives [2002, 32] "
        "(1001 rows is one of 2 TP pieces of the 2002-row vocab; the other piece is missing; or, as lm_head.weight and "
        "model.embed_tokens.weight agree on 1001 rows, the config's vocab_size is wrong)",
    )


def test_missing_config_path_is_an_error(cli, tmp_path):
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--config", tmp_path / "nope.json")
    assert_failed_cleanly(result, out, f"config '{tmp_path / 'nope.json'}' not found")


def test_empty_directory_lists_what_was_looked_for(cli, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "notes.txt").write_text("unrelated")
    out = tmp_path / "hf"
    result = cli("merge", empty, out)
    assert_failed_cleanly(
        result, out,
        f"'{empty}': no checkpoint format recognised. Looked for:",
        ".metadata with *.distcp files (PyTorch Distributed Checkpoint) (dcp)",
        "shard-*-model-*-of-*.safetensors (transformers distributed_checkpoint=True) (hf-distributed)",
        "*.ckpttool.json sidecars beside per-rank safetensors (ckpttool sidecar) (sidecar)",
        "model.safetensors or model.safetensors.index.json (HuggingFace) (hf)",
        "Pass --format NAME to name one.",
    )


def test_missing_source_is_an_error(cli, tmp_path):
    out = tmp_path / "hf"
    result = cli("merge", tmp_path / "nowhere", out)
    assert_failed_cleanly(result, out, f"'{tmp_path / 'nowhere'}': no such file or directory")


def test_existing_destination_needs_force(cli, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out)
    assert result.exit_code == 1
    assert f"destination '{out}' exists and is not empty; pass --force to replace it" in result.stderr
    assert (out / "keep.txt").read_text() == "mine"
    forced = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--force", "-q")
    assert forced.exit_code == 1  # --force replaces only an earlier output (tests/test_destination.py)
    assert "that ckpttool did not write (keep.txt)" in forced.stderr
    assert (out / "keep.txt").read_text() == "mine" and not (out / "model.safetensors").exists()


def test_empty_destination_directory_is_used(cli, tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    assert cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "-q").exit_code == 0
    assert (out / "model.safetensors").is_file()


def test_destination_inside_the_source_is_refused(cli, copy_fixture):
    src = copy_fixture("llama_tp2_dcp")
    before = tree_digest(src)
    out = src / "merged"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, f"destination '{out}' lies inside the source '{src}'")
    assert tree_digest(src) == before


def test_destination_containing_the_source_is_never_replaced(cli, copy_fixture):
    src = copy_fixture("llama_tp2_dcp")
    parent = src.parent
    result = cli("merge", src, parent, "--force")
    assert result.exit_code == 1
    assert f"destination '{parent}' contains the source '{src}'" in result.stderr
    assert (src / ".metadata").is_file()


def test_destination_that_is_a_file_is_refused(cli, tmp_path):
    out = tmp_path / "file"
    out.write_text("x")
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--force")
    assert result.exit_code == 1
    assert f"destination '{out}' exists and is not a directory" in result.stderr
    assert out.read_text() == "x"


def test_unwritable_destination_parent_is_refused(cli, tmp_path):
    out = tmp_path / "missing-parent" / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out)
    assert result.exit_code == 1
    assert f"its parent directory '{out.parent}' does not exist" in result.stderr


def test_stale_staging_directory_of_a_killed_run_is_cleaned(cli, tmp_path):
    out = tmp_path / "hf"
    stale = tmp_path / ".hf.ckpttool-partial-deadbeef"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"partial")
    assert cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "-q").exit_code == 0
    assert not stale.exists()


def test_bad_max_shard_size_is_a_usage_error(cli, tmp_path):
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", tmp_path / "hf", "--max-shard-size", "lots")
    assert result.exit_code == 2
    assert "Invalid value for '--max-shard-size': invalid size 'lots'" in result.output


def test_unknown_dtype_is_a_usage_error_listing_the_choices(cli, tmp_path):
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out, "--dtype", "float7")
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert ("Invalid value for '--dtype': 'float7' is not one of 'bfloat16', 'float16', 'float32', 'bf16', 'fp16', "
            "'fp32'.") in result.stderr
    assert not out.exists()


def test_unknown_option_is_a_usage_error(cli, tmp_path):
    result = cli("merge", "a", "b", "--frobnicate")
    assert result.exit_code == 2


def test_malicious_metadata_pickle_is_refused_unexecuted(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    marker = tmp_path / "PWNED"

    class Evil:
        def __reduce__(self):
            return (open, (str(marker), "w"))

    (src / ".metadata").write_bytes(pickle.dumps(Evil()))
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'.metadata': refused to unpickle: it asks for 'io.open'", "nothing was executed")
    assert not marker.exists()


def test_metadata_path_escaping_the_checkpoint_is_refused(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    metadata = pickle.loads((src / ".metadata").read_bytes())
    for info in metadata.storage_data.values():
        info.relative_path = "../../outside.distcp"
    (src / ".metadata").write_bytes(pickle.dumps(metadata))
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'.metadata' names '../../outside.distcp', which leads outside the checkpoint directory")


def test_unexpected_exception_has_no_traceback(cli, tmp_path, monkeypatch):
    import ckpttool.cli

    def boom(*args, **kwargs):
        raise RuntimeError("kaboom")

    monkeypatch.setattr(ckpttool.cli, "merge", boom)
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir("llama_tp2_dcp") / "checkpoint", out)
    assert_failed_cleanly(result, out, "Error: internal error in ckpttool (RuntimeError: kaboom); rerun with "
                                       "CKPTTOOL_DEBUG=1 and report it")


def test_hf_index_naming_a_file_outside_is_refused(cli, tmp_path):
    src = tmp_path / "hf-in"
    src.mkdir()
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../secret.safetensors"}}))
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'model.safetensors.index.json' names '../secret.safetensors', which leads outside")


def test_hf_index_naming_a_missing_file(cli, tmp_path):
    src = tmp_path / "hf-in"
    src.mkdir()
    (src / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00002.safetensors"}}))
    out = tmp_path / "hf"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'model.safetensors.index.json' puts 'w' in 'model-00001-of-00002.safetensors', which does not exist")


def test_help_lists_every_option(cli):
    result = cli("merge", "--help")
    assert result.exit_code == 0
    for option in ("--format", "--config", "--dtype", "--max-shard-size", "--dry-run", "--force", "--json", "--quiet", "--verbose"):
        assert option in result.output


def test_debug_environment_variable_shows_the_traceback(cli, tmp_path, monkeypatch):
    monkeypatch.setenv("CKPTTOOL_DEBUG", "1")
    empty = tmp_path / "empty"
    empty.mkdir()
    result = cli("merge", empty, tmp_path / "hf")
    assert result.exit_code == 1
    assert "Traceback" in result.stderr and "FormatNotDetectedError" in result.stderr
    assert "Error: " in result.stderr


def test_a_reader_option_that_does_not_apply(cli, copy_fixture, tmp_path):
    src = copy_fixture("llama_tp2_dcp")
    result = cli("merge", src, tmp_path / "hf", "--weights", "module")
    assert result.exit_code == 1
    assert "--weights module does not apply to the dcp format" in result.stderr
    assert not (tmp_path / "hf").exists()
