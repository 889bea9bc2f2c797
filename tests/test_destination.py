"""The destination: ``--force`` replaces only an earlier output, never a directory holding anything else, never
the home directory, ``/``, the current directory or its ancestors; the earlier output survives until the new one
is complete (an injected failure, Ctrl-C or a kill between the renames loses nothing); two runs never write one
destination; staging directories are matched by exact name; every byte is synced before the publish.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ckpttool
from ckpttool.writers.destination import check_destination, foreign_entries
from ckpttool.writers.staging import siblings
from ckpttool.errors import DestinationError, OutputError
from conftest import fixture_dir, tree_digest

SRC = fixture_dir("llama_tp2_dcp") / "checkpoint"


def earlier_output(out: Path) -> dict[str, str]:
    """A finished merge at ``out`` (three files of 60 KB at most), and the digest of every file in it."""
    ckpttool.merge(SRC, out, max_shard_size="60KB")
    return tree_digest(out)


def litter(out: Path) -> list[str]:
    """What ckpttool left beside ``out``: staging, moved-aside outputs, lock files."""
    return sorted(p.name for p in out.parent.iterdir() if p.name.startswith(f".{out.name}."))


# ------------------------------------------------------------------------------------------ what --force may replace


def test_force_replaces_an_earlier_output(cli, tmp_path):
    out = tmp_path / "hf"
    earlier_output(out)
    assert len(list(out.glob("model-*.safetensors"))) > 1
    result = cli("merge", SRC, out, "--force", "-q")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in out.iterdir()) == ["ckpttool-audit.json", "config.json", "model.safetensors"]
    assert litter(out) == []


def test_force_never_replaces_a_directory_with_foreign_entries(cli, tmp_path):
    out = tmp_path / "thesis"
    out.mkdir()
    (out / "thesis.tex").write_text("\\documentclass{article}")
    result = cli("merge", SRC, out, "--force")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (f"Error: destination '{out}' holds 1 entry that ckpttool did not write (thesis.tex); --force replaces only "
            "an earlier output of a merge. Nothing was touched") in result.stderr
    assert (out / "thesis.tex").read_text() == "\\documentclass{article}" and litter(out) == []


def test_foreign_entries_are_named_up_to_ten_with_their_count(cli, tmp_path):
    out = tmp_path / "mixed"
    digests = earlier_output(out)
    for i in range(10):
        (out / f"notes-{i:02d}.txt").write_text(str(i))
    (out / "runs").mkdir()
    (out / "vocab.json").symlink_to(out / "notes-00.txt")  # an output's name on a link is not ours either
    before = tree_digest(out)
    result = cli("merge", SRC, out, "--force")
    assert result.exit_code == 1
    shown = ", ".join(f"notes-{i:02d}.txt" for i in range(10))
    assert f"holds 12 entries that ckpttool did not write ({shown}, ... (2 more))" in result.stderr
    assert tree_digest(out) == before and set(digests) <= set(before) and (out / "runs").is_dir()


def test_what_counts_as_an_earlier_output(tmp_path):
    names = ["model.safetensors", "model-00001-of-00002.safetensors", "model.safetensors.index.json", "config.json",
             "generation_config.json", "tokenizer.json", "tokenizer.model", "ckpttool-audit.json",
             ".ckpttool-journal-0.json", ".ckpttool-journal-3.json.tmp"]
    for name in names:
        (tmp_path / name).write_text("x")
    assert foreign_entries(tmp_path) == []
    for name in ("model.bin", "adapter_model.safetensors", "model-1.safetensors", "README.md", ".git"):
        (tmp_path / name).write_text("x")
    assert foreign_entries(tmp_path) == [".git", "README.md", "adapter_model.safetensors", "model-1.safetensors", "model.bin"]


def test_the_home_directory_is_never_a_destination(cli, tmp_path, monkeypatch):
    home = tmp_path / "home"
    earlier_output(home)  # even one that holds only what a merge writes
    before = tree_digest(home)
    monkeypatch.setenv("HOME", str(home))
    result = cli("merge", SRC, home, "--force")
    assert result.exit_code == 1
    assert f"Error: destination '{home}' is your home directory; ckpttool never writes there" in result.stderr
    assert tree_digest(home) == before and litter(home) == []


@pytest.mark.parametrize("where, says", [(".", "the current directory"), ("..", "an ancestor of the current directory")])
def test_the_current_directory_and_its_ancestors_are_never_a_destination(cli, tmp_path, monkeypatch, where, says):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    before = tree_digest(tmp_path)
    result = cli("merge", SRC, where, "--force")
    assert result.exit_code == 1
    assert f"Error: destination '{where}' is {says}; ckpttool never writes there" in result.stderr
    assert tree_digest(tmp_path) == before and work.is_dir()


def test_the_root_directory_is_refused_before_anything_is_touched():
    # check_destination only looks: this is the check merge runs before it creates or moves anything
    with pytest.raises(DestinationError, match="destination '/' is the root directory; ckpttool never writes there"):
        check_destination(Path("/"), [], force=True)


def test_a_symlinked_destination_is_refused(cli, tmp_path):
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    result = cli("merge", SRC, tmp_path / "link", "--force")
    assert result.exit_code == 1
    assert f"destination '{tmp_path / 'link'}' is a symbolic link" in result.stderr


def test_the_api_names_its_own_argument(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DestinationError, match="exists and is not empty; pass force=True to replace it"):
        ckpttool.merge(SRC, out)
    with pytest.raises(DestinationError, match=r"\(keep.txt\); force=True replaces only an earlier output"):
        ckpttool.merge(SRC, out, force=True)
    assert (out / "keep.txt").read_text() == "mine"


def test_live_save_follows_the_same_rule(tmp_path):
    from ckpttool.live import save_hf
    from test_live import llama_config, reference_state

    out = tmp_path / "hf"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    with pytest.raises(DestinationError, match=r"holds 1 entry that ckpttool did not write \(keep.txt\)"):
        save_hf(reference_state(), out, config=llama_config(), force=True)
    assert [p.name for p in out.iterdir()] == ["keep.txt"] and litter(out) == []
    (out / "keep.txt").unlink()
    earlier_output(out)
    save_hf(reference_state(), out, config=llama_config(), force=True)  # an earlier output: replaced
    assert (out / "model.safetensors").is_file() and litter(out) == []


# ------------------------------------------------------------------------------ the earlier output survives failures


def test_an_error_while_writing_leaves_the_earlier_output(cli, tmp_path, monkeypatch):
    out = tmp_path / "hf"
    before = earlier_output(out)

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("ckpttool.writers.hf.stream_file", full_disk)
    result = cli("merge", SRC, out, "--force")
    assert result.exit_code == 1 and "No space left on device" in result.stderr
    assert tree_digest(out) == before and litter(out) == []


def test_ctrl_c_leaves_the_earlier_output(tmp_path):
    out = tmp_path / "hf"
    before = earlier_output(out)

    def interrupt(written: int, total: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ckpttool.merge(SRC, out, force=True, progress=interrupt)
    assert tree_digest(out) == before
    assert all(".ckpttool-partial-" in name for name in litter(out))  # only the journaled staging, for --resume


def test_a_failed_rename_puts_the_earlier_output_back(tmp_path, monkeypatch):
    out = tmp_path / "hf"
    before = earlier_output(out)
    real = os.rename

    def rename(src, dst):
        if ".ckpttool-partial-" in str(src):
            raise OSError(5, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OutputError, match=f"'{out}': cannot publish: Input/output error; the destination is as it was"):
        ckpttool.merge(SRC, out, force=True)
    assert tree_digest(out) == before and litter(out) == []


KILL_BETWEEN_RENAMES = r"""
import os, signal, sys
import ckpttool

real = os.rename

def rename(src, dst):
    if ".ckpttool-partial-" in str(src):  # the earlier output is aside; die before the new one is in place
        os.kill(os.getpid(), signal.SIGKILL)
    return real(src, dst)

os.rename = rename
ckpttool.merge(sys.argv[1], sys.argv[2], force=True)
"""


def kill_between_renames(out: Path) -> None:
    child = subprocess.run([sys.executable, "-c", KILL_BETWEEN_RENAMES, str(SRC), str(out)], capture_output=True,
                           text=True, timeout=120)
    assert child.returncode == -9, child.stderr
    assert not out.exists() and len(siblings(out, ".ckpttool-old-")) == 1


def test_a_kill_between_the_renames_is_repaired_by_the_next_run(cli, tmp_path):
    out = tmp_path / "hf"
    before = earlier_output(out)
    kill_between_renames(out)
    aside = siblings(out, ".ckpttool-old-")[0]
    result = cli("merge", SRC, out)  # without --force: the earlier output comes back, and is not replaced
    assert result.exit_code == 1
    assert f"restored the earlier output '{out}' from '{aside.name}', where an interrupted run had moved it aside" in result.stderr
    assert "exists and is not empty; pass --force to replace it" in result.stderr
    assert tree_digest(out) == before and litter(out) == []


def test_a_kill_between_the_renames_then_force_publishes_the_new_output(cli, tmp_path):
    out = tmp_path / "hf"
    earlier_output(out)
    kill_between_renames(out)
    result = cli("merge", SRC, out, "--force", "-q")
    assert result.exit_code == 0, result.output
    assert "restored the earlier output" in result.stderr
    assert (out / "model.safetensors").is_file() and not list(out.glob("model-*")) and litter(out) == []


# ---------------------------------------------------------------------------------------------- one run at a time


PAUSED = r"""
import sys, time
from pathlib import Path
import ckpttool

def progress(written, total):
    Path(sys.argv[3]).touch()
    while not Path(sys.argv[4]).exists():
        time.sleep(0.05)

ckpttool.merge(sys.argv[1], sys.argv[2], progress=progress)
"""


def test_a_second_run_into_the_same_destination_is_refused(cli, tmp_path):
    out, started, go = tmp_path / "hf", tmp_path / "started", tmp_path / "go"
    first = subprocess.Popen([sys.executable, "-c", PAUSED, str(SRC), str(out), str(started), str(go)],
                             stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not started.exists():
            assert first.poll() is None and time.monotonic() < deadline, "the first merge never started writing"
            time.sleep(0.05)
        [staging] = siblings(out, ".ckpttool-partial-")
        result = cli("merge", SRC, out, "--force")
        assert result.exit_code == 1
        assert (f"Error: destination '{out}' is being written by another ckpttool run (process {first.pid}, lock "
                f"'{out.parent / '.hf.ckpttool-lock'}'); wait for it to finish or stop it") in result.stderr
        assert staging.is_dir(), "the second run touched the first one's staging directory"
    finally:
        go.touch()
        _, err = first.communicate(timeout=120)
    assert first.returncode == 0, err
    assert (out / "model.safetensors").is_file() and litter(out) == []


@pytest.mark.parametrize("name", ["m[v2]", "m*", "m?"])
def test_staging_directories_are_found_by_exact_name(tmp_path, name):
    other = tmp_path / ".mx.ckpttool-partial-0123abcd"  # another output's staging, which a glob 'm*' would match
    other.mkdir()
    (other / "model.safetensors").write_bytes(b"theirs")
    out = tmp_path / name

    def interrupt_after_first_file(written: int, total: int, seen=[0]) -> None:
        seen[0] += written
        if seen[0] > 130_000:  # past the first two files
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ckpttool.merge(SRC, out, max_shard_size="60KB", progress=interrupt_after_first_file)
    assert len(siblings(out, ".ckpttool-partial-")) == 1
    result = ckpttool.merge(SRC, out, max_shard_size="60KB", resume=True)
    assert result.kept_files >= 1  # the interrupted run's files were found again
    assert (other / "model.safetensors").read_bytes() == b"theirs"
    assert litter(out) == []


# ------------------------------------------------------------------------------------------------------ durability


def _record(monkeypatch) -> list[tuple[str, ...]]:
    """Every fsync (by path), rename, page-cache drop and file opened for reading, in order."""
    events: list[tuple[str, ...]] = []
    real_fsync, real_rename, real_fadvise, real_open = os.fsync, os.rename, os.posix_fadvise, open

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def rename(src, dst) -> None:
        events.append(("rename", str(Path(src).resolve()), str(Path(dst).resolve())))
        real_rename(src, dst)

    def fadvise(fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_DONTNEED:
            events.append(("drop", os.readlink(f"/proc/self/fd/{fd}")))
        real_fadvise(fd, offset, length, advice)

    def open_(file, mode="r", *args, **kwargs):
        if "r" in mode and "+" not in mode:
            events.append(("read", str(Path(file).resolve())))
        return real_open(file, mode, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    monkeypatch.setattr("ckpttool.execute.executor.open", open_, raising=False)
    return events


def test_every_file_and_the_staging_directory_are_synced_before_the_rename(tmp_path, monkeypatch):
    out = tmp_path / "hf"
    events = _record(monkeypatch)
    ckpttool.merge(SRC, out, max_shard_size="60KB")
    [publish] = [i for i, e in enumerate(events) if e[0] == "rename" and e[2] == str(out.resolve())]
    staging = Path(events[publish][1])
    synced = {e[1] for e in events[:publish] if e[0] == "fsync"}
    files = sorted(p.name for p in out.iterdir())
    assert len(files) >= 5  # weights, index, config, audit
    for name in files:
        assert str(staging / name) in synced, f"{name} was not synced before the rename"
    assert str(staging) in synced, "the staging directory was not synced before the rename"
    assert ("fsync", str(tmp_path.resolve())) in events[publish:], "the rename was not made durable"


def test_verify_reads_each_file_back_after_dropping_it_from_the_page_cache(tmp_path, monkeypatch):
    out = tmp_path / "hf"
    events = _record(monkeypatch)
    ckpttool.merge(SRC, out, max_shard_size="60KB", verify=True)
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(names) > 1
    for name in names:
        path = next(e[1] for e in events if e[0] == "fsync" and e[1].endswith("/" + name))
        synced = events.index(("fsync", path))
        dropped = events.index(("drop", path))
        read = events.index(("read", path))
        assert synced < dropped < read, f"{name}: not synced, dropped from the cache, then read from disk"
