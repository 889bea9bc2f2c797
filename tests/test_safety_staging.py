"""Nothing is written or published through a link: the staging directory, the files a ``--resume`` keeps, the
lock file and every output file are trusted only when they are what ckpttool makes (a directory or a regular
file of this user with one link); a long destination name and Ctrl-C end cleanly.

Each test damages what an interrupted merge left (a journaled staging directory of ``llama_tp2_dcp`` in four
files) the way the security report did, runs the command line, and checks its exit code, its message and the
file system afterwards: the file outside unchanged byte for byte, nothing published.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import ckpttool
import ckpttool.cli
from ckpttool.errors import Interrupted
from ckpttool.execute.executor import write_file
from ckpttool.writers.destination import journal_name
from ckpttool.writers.journal import write_text
from conftest import fixture_dir, interrupt_after, load_output, tree_digest

SRC = fixture_dir("llama_tp2_dcp") / "checkpoint"
SHARD = "60KB"  # four output files, so an interrupted merge has finished some
PRECIOUS = b"a file outside the output, never to be written\n"


def interrupted(out: Path) -> tuple[Path, list[str]]:
    """Merge into ``out`` until Ctrl-C; the staging directory kept for --resume and the files its journal holds."""
    with pytest.raises(KeyboardInterrupt):
        ckpttool.merge(SRC, out, max_shard_size=SHARD, progress=interrupt_after(260_000))
    [staging] = staging_dirs(out)
    finished = sorted(json.loads((staging / journal_name(0)).read_text())["files"])
    assert len(finished) >= 2
    return staging, finished


def staging_dirs(out: Path) -> list[Path]:
    return sorted(out.parent.glob(f".{out.name}.ckpttool-partial-*"))


def outside(tmp_path: Path, data: bytes = PRECIOUS) -> Path:
    path = tmp_path / "elsewhere" / "precious.bin"
    path.parent.mkdir(exist_ok=True)
    path.write_bytes(data)
    return path


def resume(cli, out: Path):
    return cli("merge", SRC, out, "--max-shard-size", SHARD, "--resume")


def assert_refused(result, out: Path, *needles: str) -> None:
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    for needle in needles:
        assert needle in result.stderr, f"{needle!r} not in:\n{result.stderr}"
    assert not out.exists(), "something was published"
    assert not (out.parent / f".{out.name}.ckpttool-lock").exists()


def assert_is_the_reference(out: Path) -> None:
    got, want = load_output(out), load_output(fixture_dir("llama_tp2_dcp") / "reference")
    assert sorted(got) == sorted(want)
    assert all(got[k].equal(want[k]) for k in want)


# ------------------------------------------------------------------------------------- links in the staging dir


@pytest.mark.parametrize("which", ["weights", "leftover"])
def test_resume_never_writes_through_a_symlink_in_the_staging_directory(cli, tmp_path, which):
    out = tmp_path / "hf"
    staging, finished = interrupted(out)
    victim = outside(tmp_path)
    name = {"weights": finished[0], "leftover": "model-00004-of-00004.safetensors"}[which]
    entry = staging / name
    entry.unlink(missing_ok=True)
    entry.symlink_to(victim)
    before = tree_digest(staging.parent / "elsewhere")

    result = resume(cli, out)
    assert_refused(result, out, f"'{entry}': it is a symbolic link to '{victim}'",
                   "Nothing was touched", "run without --resume")
    assert victim.read_bytes() == PRECIOUS
    assert tree_digest(staging.parent / "elsewhere") == before
    assert entry.is_symlink(), "the refused staging directory was changed"


def test_a_journal_that_is_a_symlink_is_not_trusted(cli, tmp_path):
    out = tmp_path / "hf"
    staging, _ = interrupted(out)
    journal = (staging / journal_name(0)).read_bytes()
    victim = outside(tmp_path, journal)
    (staging / journal_name(0)).unlink()
    (staging / journal_name(0)).symlink_to(victim)

    result = resume(cli, out)  # no journal to trust: nothing to resume, the merge starts over
    assert result.exit_code == 0, result.output
    assert "resumed:" not in result.stdout
    assert victim.read_bytes() == journal and staging_dirs(out) == []
    assert_is_the_reference(out)


def test_resume_never_publishes_a_hard_linked_file(cli, tmp_path):
    out = tmp_path / "hf"
    staging, finished = interrupted(out)
    entry = staging / finished[0]
    victim = outside(tmp_path, entry.read_bytes())  # same bytes: the digest check alone would keep it
    entry.unlink()
    os.link(victim, entry)

    result = resume(cli, out)
    assert_refused(result, out, f"'{entry}': it is a file with 2 hard links")
    assert victim.stat().st_nlink == 2 and os.path.samefile(victim, entry)  # untouched, still shared


def test_resume_refuses_a_directory_symlink_in_the_staging_directory(cli, tmp_path):
    out = tmp_path / "hf"
    staging, _ = interrupted(out)
    victim = outside(tmp_path)
    (staging / "subdir").symlink_to(victim.parent, target_is_directory=True)

    result = resume(cli, out)
    assert_refused(result, out, f"'{staging / 'subdir'}': it is a symbolic link to '{victim.parent}'")
    assert victim.read_bytes() == PRECIOUS and sorted(os.listdir(victim.parent)) == ["precious.bin"]


def test_a_plain_run_removes_a_damaged_staging_directory_without_following_its_links(cli, tmp_path):
    out = tmp_path / "hf"
    staging, finished = interrupted(out)
    victim = outside(tmp_path)
    (staging / finished[0]).unlink()
    (staging / finished[0]).symlink_to(victim)
    (staging / "subdir").symlink_to(victim.parent, target_is_directory=True)

    result = cli("merge", SRC, out, "--max-shard-size", SHARD)
    assert result.exit_code == 0, result.output
    assert victim.read_bytes() == PRECIOUS and sorted(os.listdir(victim.parent)) == ["precious.bin"]
    assert staging_dirs(out) == []
    assert_is_the_reference(out)


# ----------------------------------------------------------------------------- staging dirs ckpttool did not make


def test_resume_refuses_a_staging_directory_of_another_user(cli, tmp_path, monkeypatch):
    out = tmp_path / "hf"
    staging, _ = interrupted(out)
    before = tree_digest(staging)
    me = os.geteuid()
    monkeypatch.setattr(os, "geteuid", lambda: me + 1)  # as if another user had made it

    result = resume(cli, out)
    assert_refused(result, out, f"cannot resume into '{staging}': it is owned by another user (uid {me})",
                   "Nothing was touched")
    assert tree_digest(staging) == before


def test_resume_refuses_a_staging_directory_that_is_a_symlink(cli, tmp_path):
    out = tmp_path / "hf"
    staging, _ = interrupted(out)
    elsewhere = tmp_path / "elsewhere"
    staging.rename(elsewhere)
    staging.symlink_to(elsewhere, target_is_directory=True)
    before = tree_digest(elsewhere)

    result = resume(cli, out)
    assert_refused(result, out, f"cannot resume into '{staging}': it is a symbolic link to '{elsewhere}'")
    assert tree_digest(elsewhere) == before and staging.is_symlink()


# ------------------------------------------------------------------------------------------- output files


def test_output_files_are_created_new_never_through_a_link(tmp_path):
    victim = outside(tmp_path)
    link = tmp_path / "model.safetensors"
    link.symlink_to(victim)
    with pytest.raises(FileExistsError):
        write_file(link, b"header", [], reader=None)
    write_text(link, "{}")  # a small output file replaces the name, not what it points to
    assert not link.is_symlink() and link.read_text() == "{}"
    assert victim.read_bytes() == PRECIOUS


# --------------------------------------------------------------------------------------------------- the lock


@pytest.mark.parametrize("how", ["hard link", "symlink"])
def test_a_link_named_like_the_lock_is_refused_never_written(cli, tmp_path, how):
    out = tmp_path / "hf"
    victim = outside(tmp_path)
    lock = tmp_path / ".hf.ckpttool-lock"
    os.link(victim, lock) if how == "hard link" else lock.symlink_to(victim)
    reason = "is a file with 2 hard links" if how == "hard link" else f"is a symbolic link to '{victim}'"

    result = cli("merge", SRC, out)
    assert result.exit_code == 1, result.output
    assert f"Error: cannot lock '{out}': '{lock}' {reason}, not a lock file of ckpttool; nothing was" in result.stderr
    assert victim.read_bytes() == PRECIOUS
    assert os.path.lexists(lock) and not out.exists() and staging_dirs(out) == []


def test_a_stale_lock_file_of_a_killed_run_is_taken_over(cli, tmp_path):
    out = tmp_path / "hf"
    lock = tmp_path / ".hf.ckpttool-lock"
    lock.write_text("999999\n")  # its holder was killed: no flock on it any more
    result = cli("merge", SRC, out)
    assert result.exit_code == 0, result.output
    assert_is_the_reference(out)
    assert not lock.exists()


# ------------------------------------------------------------------------------------------- long names


@pytest.mark.parametrize("length", [240, 300])
def test_a_destination_name_too_long_for_the_staging_name_is_a_clean_error(cli, tmp_path, length):
    out = tmp_path / ("m" * length)
    result = cli("merge", SRC, out)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    assert f"Error: destination '{out}': its name is too long" in result.stderr
    assert "Give a name of at most 228 bytes" in result.stderr
    assert os.listdir(tmp_path) == []


def test_a_long_name_that_fits_merges(cli, tmp_path):
    out = tmp_path / ("m" * 228)
    result = cli("merge", SRC, out)
    assert result.exit_code == 0, result.output
    assert_is_the_reference(out)


# ---------------------------------------------------------------------------------------------------- Ctrl-C


def test_ctrl_c_with_nothing_to_resume_says_so_and_exits_130(cli, tmp_path, monkeypatch):
    def interrupted_at_once(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(ckpttool.cli, "merge", interrupted_at_once)
    out = tmp_path / "hf"
    result = cli("merge", SRC, out)
    assert result.exit_code == 130
    assert result.stderr.strip() == "Error: interrupted; nothing was published"
    assert os.listdir(tmp_path) == []


def test_ctrl_c_before_a_file_is_finished_keeps_nothing(cli, tmp_path, monkeypatch):
    def interrupted_writing(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("ckpttool.writers.hf.stream_file", interrupted_writing)
    out = tmp_path / "hf"
    result = cli("merge", SRC, out, "--max-shard-size", SHARD)
    assert result.exit_code == 130
    assert "Error: interrupted; nothing was published\n" in result.stderr and "--resume" not in result.stderr
    assert os.listdir(tmp_path) == []


def test_ctrl_c_after_finished_files_names_the_staging_directory_kept(cli, tmp_path, monkeypatch):
    import ckpttool.writers.hf as hf

    real, calls = hf.stream_file, []

    def interrupted_at_the_third(*args, **kwargs):
        calls.append(args[0])
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "stream_file", interrupted_at_the_third)
    out = tmp_path / "hf"
    result = cli("merge", SRC, out, "--max-shard-size", SHARD)
    [staging] = staging_dirs(out)
    assert result.exit_code == 130
    assert (f"Error: interrupted; nothing was published. The files finished so far are kept in '{staging}': run the "
            "same merge with --resume to continue") in result.stderr
    assert not out.exists()
    assert sorted(json.loads((staging / journal_name(0)).read_text())["files"]) == sorted(p.name for p in calls[:2])

    monkeypatch.setattr(hf, "stream_file", real)
    result = resume(cli, out)
    assert result.exit_code == 0, result.output
    assert "resumed:  kept 2 of 4 files" in result.stdout
    assert_is_the_reference(out)


def test_the_api_says_what_it_kept(tmp_path):
    out = tmp_path / "hf"
    with pytest.raises(Interrupted) as excinfo:
        ckpttool.merge(SRC, out, max_shard_size=SHARD, progress=interrupt_after(260_000))
    assert excinfo.value.kept == str(staging_dirs(out)[0])
