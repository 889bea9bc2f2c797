"""Symlinks in a source: a snapshot of the Hugging Face hub cache (files linked to ``../../blobs/<sha>``) merges
and audits like a plain directory; a link out of the checkpoint (out of the cache's repository folder) is never
followed: weights are refused, ``config.json`` is an error naming it, tokenizer files are skipped with a note.

The hub cache is built here in tmp from the committed reference: ``models--org--tiny/blobs/<sha>`` holds each
file once, ``snapshots/<rev>/`` links to it with relative symlinks, as ``huggingface_hub`` lays it out.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from safetensors.torch import load_file, save_file

from conftest import assert_failed_cleanly, fixture_dir

REFERENCE = fixture_dir("llama_fsdp2_dcp") / "reference"
SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
EXTRAS = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def hub_snapshot(cache: Path, rev: str = "0123abcd") -> Path:
    """``cache/models--org--tiny/snapshots/<rev>``: the reference in two shards with an index, every file a
    relative symlink to its blob."""
    repo = cache / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snapshot = repo / "snapshots" / rev
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)

    def blob(name: str, data: bytes) -> None:
        sha = hashlib.sha256(data).hexdigest()
        (repo / "blobs" / sha).write_bytes(data)
        (snapshot / name).symlink_to(f"../../blobs/{sha}")

    tensors = load_file(REFERENCE / "model.safetensors")
    names = sorted(tensors)
    weight_map = {}
    for i, file in enumerate(SHARDS):
        part = cache / "part.safetensors"
        save_file({n: tensors[n] for n in names[i::2]}, str(part), metadata={"format": "pt"})
        blob(file, part.read_bytes())
        part.unlink()
        weight_map.update(dict.fromkeys(names[i::2], file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    blob("model.safetensors.index.json", json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}).encode())
    for name in EXTRAS:
        blob(name, (REFERENCE / name).read_bytes())
    return snapshot


def relink(path: Path, target: Path | str) -> None:
    path.unlink()
    path.symlink_to(target)


def outside_copy(path: Path, outside: Path) -> Path:
    """A copy of what ``path`` holds, in ``outside`` (a folder outside the checkpoint)."""
    outside.mkdir(exist_ok=True)
    copy = outside / path.name
    copy.write_bytes(path.read_bytes())
    return copy


# ------------------------------------------------------------------------------------------- the hub cache


def test_merge_of_a_hub_cache_snapshot_equals_the_reference_bit_for_bit(tmp_path, cli):
    snapshot = hub_snapshot(tmp_path / "hub")
    result = cli("merge", snapshot, tmp_path / "out")
    assert result.exit_code == 0, result.output
    out = tmp_path / "out"
    assert (out / "model.safetensors").read_bytes() == (REFERENCE / "model.safetensors").read_bytes()
    for name in EXTRAS[1:]:  # copied from the blobs (config.json is written again, sorted)
        assert (out / name).read_bytes() == (REFERENCE / name).read_bytes(), name
    assert not any(p.is_symlink() for p in out.iterdir())
    assert "audit: PASS" in result.stderr + result.stdout


def test_audit_of_a_hub_cache_snapshot_passes(tmp_path, cli):
    snapshot = hub_snapshot(tmp_path / "hub")
    result = cli("audit", snapshot, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["summary"]["verdict"] == "pass", doc["findings"]
    assert not doc["findings"]


def test_a_snapshot_reached_through_a_symlinked_cache_folder_merges(tmp_path, cli):
    snapshot = hub_snapshot(tmp_path / "hub")
    (tmp_path / "models").symlink_to(tmp_path / "hub")
    result = cli("merge", tmp_path / "models" / snapshot.relative_to(tmp_path / "hub"), tmp_path / "out")
    assert result.exit_code == 0, result.output


def test_a_snapshot_file_linking_out_of_the_cache_repository_is_refused(tmp_path, cli):
    snapshot = hub_snapshot(tmp_path / "hub")
    relink(snapshot / SHARDS[1], outside_copy(snapshot / SHARDS[1], tmp_path / "elsewhere"))
    result = cli("merge", snapshot, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"'model.safetensors.index.json' names '{SHARDS[1]}', which leads "
                          f"outside the checkpoint directory and its hub cache folder '{(tmp_path / 'hub' / 'models--org--tiny').resolve()}'")
    result = cli("audit", snapshot)
    assert result.exit_code == 3, result.output
    assert "index-outside" in result.stdout and f"names '{SHARDS[1]}', which leads outside" in result.stdout


def test_a_link_into_another_cache_repository_is_refused(tmp_path, cli):
    snapshot = hub_snapshot(tmp_path / "hub")
    other = hub_snapshot(tmp_path / "hub2")
    relink(snapshot / SHARDS[0], other / SHARDS[0])
    result = cli("merge", snapshot, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"names '{SHARDS[0]}', which leads outside the checkpoint directory")


def test_an_index_naming_a_blob_by_a_parent_path_is_refused(tmp_path, cli):
    snapshot = hub_snapshot(tmp_path / "hub")
    index = json.loads((snapshot / "model.safetensors.index.json").read_text())
    blob = os.readlink(snapshot / SHARDS[0])
    index["weight_map"] = {k: blob if v == SHARDS[0] else v for k, v in index["weight_map"].items()}
    relink(snapshot / "model.safetensors.index.json", outside_copy(snapshot / "model.safetensors.index.json", snapshot.parent))
    (snapshot.parent / "model.safetensors.index.json").write_text(json.dumps(index))  # inside the repository folder
    result = cli("merge", snapshot, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"'model.safetensors.index.json' names '{blob}', which leads outside")


def test_a_plain_directory_does_not_widen_to_a_folder_that_looks_like_a_cache(tmp_path, cli):
    """Only ``models--*/snapshots/<rev>`` beside ``blobs/`` is a cache snapshot; a ``snapshots`` folder elsewhere
    keeps links to its own checkpoint."""
    snapshot = hub_snapshot(tmp_path / "hub")
    fake = tmp_path / "plain" / "snapshots" / "x"
    fake.mkdir(parents=True)
    (tmp_path / "plain" / "blobs").mkdir()
    for p in snapshot.iterdir():
        (fake / p.name).symlink_to(p.resolve())
    (fake / "config.json").unlink()
    (fake / "config.json").write_bytes((snapshot / "config.json").read_bytes())
    result = cli("merge", fake, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"names '{SHARDS[0]}', which leads outside the checkpoint directory\n")


# ------------------------------------------------------------------------------------- tokenizer and config


def test_tokenizer_files_linking_out_are_skipped_with_a_note_never_copied(tmp_path, cli, caplog):
    snapshot = hub_snapshot(tmp_path / "hub")
    secret = outside_copy(snapshot / "generation_config.json", tmp_path / "elsewhere")
    relink(snapshot / "generation_config.json", secret)
    relink(snapshot / "tokenizer.json", "/etc/passwd")  # never read: only the link's target is named
    (snapshot / "vocab.json").symlink_to("/proc/self/environ")
    result = cli("merge", snapshot, tmp_path / "out", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["ckpttool-audit.json", "config.json", "model.safetensors",
                                                      "tokenizer_config.json"]
    assert doc["extras"] == ["config.json", "tokenizer_config.json", "ckpttool-audit.json"]
    for name, target in (("generation_config.json", str(secret)), ("tokenizer.json", "/etc/passwd"), ("vocab.json", "/proc/")):
        note = next(n for n in doc["notes"] if f"{name}' not copied" in n)
        assert f"it is a symlink to '{target}" in note and "outside the checkpoint" in note
        assert any(f"{name}' not copied" in r.getMessage() and r.levelname == "WARNING" for r in caplog.records)


def test_merge_prints_the_note_for_a_skipped_tokenizer(tmp_path, cli):
    snapshot = hub_snapshot(tmp_path / "hub")
    relink(snapshot / "tokenizer.json", "/etc/passwd")
    result = cli("merge", snapshot, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert (f"note: '{snapshot / 'tokenizer.json'}' not copied: it is a symlink to '/etc/passwd', outside the checkpoint; "
            "copy the file in its place to ship it") in result.stdout
    assert not (tmp_path / "out" / "tokenizer.json").exists()


def test_audit_warns_of_a_tokenizer_linking_out_and_does_not_read_it(tmp_path, cli):
    snapshot = hub_snapshot(tmp_path / "hub")
    relink(snapshot / "tokenizer.json", "/etc/passwd")
    result = cli("audit", snapshot, "--json")
    assert result.exit_code == 0, result.output
    findings = json.loads(result.stdout)["findings"]
    assert [(f["code"], f["file"], f["message"]) for f in findings] == [(
        "file-link-outside", "tokenizer.json",
        "'tokenizer.json' is a symlink to '/etc/passwd', outside the checkpoint: not read, and a merge does not copy it",
    )]  # no tokenizer-invalid: the file was not parsed


def test_a_config_linking_out_of_the_checkpoint_is_an_error_naming_it(tmp_path, cli):
    snapshot = hub_snapshot(tmp_path / "hub")
    relink(snapshot / "config.json", outside_copy(snapshot / "config.json", tmp_path / "elsewhere"))
    says = (f"'{snapshot / 'config.json'}' is a symlink to '{tmp_path / 'elsewhere' / 'config.json'}', outside "
            f"'{snapshot}'; ckpttool follows no link out of the checkpoint")
    assert_failed_cleanly(cli("merge", snapshot, tmp_path / "out"), tmp_path / "out", says)
    result = cli("audit", snapshot)
    assert result.exit_code == 1 and says in result.stderr and "Traceback" not in result.output


def test_a_config_named_explicitly_is_read_where_it_leads(tmp_path, cli):
    snapshot = hub_snapshot(tmp_path / "hub")
    config = outside_copy(snapshot / "config.json", tmp_path / "elsewhere")
    relink(snapshot / "config.json", config)
    result = cli("merge", snapshot, tmp_path / "out", "--config", config)
    assert result.exit_code == 0, result.output
