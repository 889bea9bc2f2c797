"""Crash safety: a merge killed at any byte never leaves a partial checkpoint at the destination; the next run
cleans up or, with ``--resume``, continues from the files already finished; ``--verify`` reads back.

The kill test runs the merge in a child process (forked from one that imported torch and ckpttool once: conftest's
``forked_python``) whose ``os.pwrite`` sends SIGKILL to itself once a chosen number of output bytes has been written: 20 points drawn at random (fixed seed) over the whole output.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
import torch

import ckpttool
import ckpttool.execute.executor
from ckpttool.errors import OutputError
from ckpttool.writers.destination import journal_name
from conftest import fixture_dir, interrupt_after, load_output

FIXTURE = "llama_tp2_dcp"
SHARD = "60KB"  # several output files, so a resume has something to keep
KILL_POINTS = 20

CHILD = r"""
import os, signal, sys
import ckpttool

limit, written = int(sys.argv[3]), 0
real_pwrite = os.pwrite

def pwrite(fd, data, offset):
    global written
    room = limit - written
    if room <= 0:
        os.kill(os.getpid(), signal.SIGKILL)
    n = real_pwrite(fd, bytes(memoryview(data)[:room]), offset)
    written += n
    return n

os.pwrite = pwrite
ckpttool.merge(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[4])
"""


def reference() -> dict[str, torch.Tensor]:
    return load_output(fixture_dir(FIXTURE) / "reference")


def assert_is_the_reference(out: Path) -> None:
    got, want = load_output(out), reference()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def staging_dirs(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.ckpttool-partial-*"))


def output_bytes(tmp_path: Path) -> int:
    probe = tmp_path / "probe"
    ckpttool.merge(fixture_dir(FIXTURE) / "checkpoint", probe, max_shard_size=SHARD)
    return sum(f.stat().st_size for f in probe.glob("*.safetensors"))


def test_sigkill_at_random_points_never_publishes_a_partial_checkpoint(forked_python, tmp_path):
    total = output_bytes(tmp_path)
    points = sorted(random.Random(20261122).sample(range(1, total), KILL_POINTS))
    src = fixture_dir(FIXTURE) / "checkpoint"
    for i, point in enumerate(points):
        out = tmp_path / f"out{i}"
        # a process of its own, forked from one that imported torch and ckpttool once (conftest's forked_python)
        child = forked_python(CHILD, src, out, point, SHARD, timeout=120)
        assert child.returncode == -signal.SIGKILL, child.stderr
        assert not out.exists(), f"killed at byte {point}: the destination exists"
        [staging] = staging_dirs(out)  # recognisable by its name
        journal = json.loads((staging / journal_name(0)).read_text())
        finished = len(journal["files"])
        resume = i % 2 == 0
        result = ckpttool.merge(src, out, max_shard_size=SHARD, resume=resume)
        assert result.kept_files == (finished if resume else 0)
        assert staging_dirs(out) == [], "the rerun left a staging directory"
        assert not (out / journal_name(0)).exists()
        assert_is_the_reference(out)


def test_resume_rechecks_and_rewrites_a_damaged_file(tmp_path):
    src, out = fixture_dir(FIXTURE) / "checkpoint", tmp_path / "hf"
    with pytest.raises(KeyboardInterrupt):
        ckpttool.merge(src, out, max_shard_size=SHARD, progress=interrupt_after(260_000))
    [staging] = staging_dirs(out)  # Ctrl-C keeps the journaled staging directory for --resume
    finished = sorted(json.loads((staging / journal_name(0)).read_text())["files"])
    assert len(finished) >= 2
    damaged = staging / finished[0]
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    result = ckpttool.merge(src, out, max_shard_size=SHARD, resume=True)
    assert result.kept_files == len(finished) - 1  # the damaged one failed its digest check and was rewritten
    assert_is_the_reference(out)


def test_resume_publishes_nothing_the_journal_does_not_hold(tmp_path):
    src, out = fixture_dir(FIXTURE) / "checkpoint", tmp_path / "hf"
    with pytest.raises(KeyboardInterrupt):
        ckpttool.merge(src, out, max_shard_size=SHARD, progress=interrupt_after(260_000))
    [staging] = staging_dirs(out)
    (staging / "ckpttool-audit.json").write_text('{"stale": true}')  # as if killed just before the publish
    (staging / "model-00004-of-00004.safetensors").write_bytes(b"half")
    ckpttool.merge(src, out, max_shard_size=SHARD, resume=True, audit=False)
    assert not (out / "ckpttool-audit.json").exists()
    assert_is_the_reference(out)


def test_journal_of_another_plan_is_not_used(tmp_path):
    src, out = fixture_dir(FIXTURE) / "checkpoint", tmp_path / "hf"
    with pytest.raises(KeyboardInterrupt):
        ckpttool.merge(src, out, max_shard_size=SHARD, progress=interrupt_after(260_000))
    result = ckpttool.merge(src, out, max_shard_size="100KB", resume=True)  # another split: another plan
    assert result.kept_files == 0
    assert sorted(p.name for p in out.glob("*.safetensors")) == [f.name for f in result.files]
    assert_is_the_reference(out)


def test_cli_resume_reports_the_kept_files(cli, tmp_path):
    src, out = fixture_dir(FIXTURE) / "checkpoint", tmp_path / "hf"
    with pytest.raises(KeyboardInterrupt):
        ckpttool.merge(src, out, max_shard_size=SHARD, progress=interrupt_after(260_000))
    kept = len(json.loads((staging_dirs(out)[0] / journal_name(0)).read_text())["files"])
    result = cli("merge", src, out, "--max-shard-size", SHARD, "--resume")
    assert result.exit_code == 0, result.output
    assert f"resumed:  kept {kept} of 4 files of the interrupted merge (each checked again)" in result.stdout


def test_a_run_without_resume_starts_over(tmp_path):
    src, out = fixture_dir(FIXTURE) / "checkpoint", tmp_path / "hf"
    with pytest.raises(KeyboardInterrupt):
        ckpttool.merge(src, out, max_shard_size=SHARD, progress=interrupt_after(260_000))
    assert ckpttool.merge(src, out, max_shard_size=SHARD).kept_files == 0
    assert staging_dirs(out) == []


# ------------------------------------------------------------------------------------------------ verify


def corrupting_writes(monkeypatch) -> None:
    """Each output file loses a bit after it is written, as a failing disk would do."""
    real = ckpttool.execute.executor.write_file

    def write_then_corrupt(path, *args, **kwargs):
        digest = real(path, *args, **kwargs)
        with open(path, "r+b") as f:
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 1]))
        return digest

    monkeypatch.setattr("ckpttool.writers.hf.stream_file", write_then_corrupt)


def test_verify_reads_back_and_catches_corruption(cli, tmp_path, monkeypatch):
    corrupting_writes(monkeypatch)
    out = tmp_path / "hf"
    result = cli("merge", fixture_dir(FIXTURE) / "checkpoint", out, "--verify")
    assert result.exit_code == 1
    assert "Error: 'model.safetensors': read back from disk, its digest is " in result.stderr
    assert "was written; the disk or file system corrupted it. Nothing was published" in result.stderr
    assert not out.exists() and staging_dirs(out) == []


def test_verify_passes_on_a_sound_disk(tmp_path):
    result = ckpttool.merge(fixture_dir(FIXTURE) / "checkpoint", tmp_path / "hf", max_shard_size=SHARD, verify=True)
    assert len(result.files) == 4
    assert_is_the_reference(tmp_path / "hf")


def test_read_back_failure_is_an_output_error(tmp_path, monkeypatch):
    def unreadable(path, prefix_len, spans):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr("ckpttool.writers.hf.file_digest", unreadable)
    with pytest.raises(OutputError, match="'model.safetensors': cannot read it back: Permission denied; nothing was published"):
        ckpttool.merge(fixture_dir(FIXTURE) / "checkpoint", tmp_path / "hf", verify=True)


def test_source_file_gone_before_the_write_is_named(copy_fixture, tmp_path, monkeypatch):
    import importlib

    merge_module = importlib.import_module("ckpttool.commands.merge")  # ckpttool.merge is also the function's name
    src = copy_fixture(FIXTURE)
    real = merge_module.plan_id

    def delete_then_plan(plan, files):
        (src / "__1_0.distcp").unlink()
        return real(plan, files)

    monkeypatch.setattr(merge_module, "plan_id", delete_then_plan)
    with pytest.raises(ckpttool.SourceError, match=r"'__1_0.distcp': cannot read: No such file or directory"):
        ckpttool.merge(src, tmp_path / "hf")
    assert not (tmp_path / "hf").exists() and staging_dirs(tmp_path / "hf") == []
