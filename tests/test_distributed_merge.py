"""Several processes merging one checkpoint under torchrun (gloo): the same files, byte for byte, as one."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

import pytest

import ckpttool
from conftest import fixture_dir

FIXTURE = "mixtral_fsdp2_dcp"


def torchrun(*args: str, nproc: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "CKPTTOOL_DIST_TIMEOUT": "120", "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "ckpttool", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)


def digests(directory) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.name != "ckpttool-audit.json"}


def test_two_processes_write_what_one_writes(tmp_path):
    src = fixture_dir(FIXTURE) / "checkpoint"
    ckpttool.merge(src, tmp_path / "one", max_shard_size="100KB")
    done = torchrun("merge", str(src), str(tmp_path / "two"), "--max-shard-size", "100KB")
    assert done.returncode == 0, done.stdout + done.stderr
    assert digests(tmp_path / "two") == digests(tmp_path / "one")
    assert len(list((tmp_path / "two").glob("model-*.safetensors"))) > 2  # the files really were shared out
    assert done.stdout.count("coverage: ok") == 1  # only rank 0 speaks


def test_an_error_stops_every_process_with_one_message(tmp_path):
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "keep.txt").write_text("mine")
    done = torchrun("merge", str(fixture_dir(FIXTURE) / "checkpoint"), str(tmp_path / "taken"))
    assert done.returncode != 0
    assert done.stderr.count("exists and is not empty; pass --force to replace it") == 1
    assert (tmp_path / "taken" / "keep.txt").read_text() == "mine"


def two_ranks(rank: int, others):
    """A Group of two whose collectives return what ``others`` says the other process did."""
    from ckpttool.execute.distributed import Group

    group = Group()
    group.rank, group.world = rank, 2
    group._gather = lambda value: [value, others] if rank == 0 else [others, value]
    group._broadcast = lambda value: value if rank == 0 else others
    return group


def test_a_failure_on_another_rank_is_raised_here_with_its_message():
    from ckpttool.execute.distributed import ProcessGroupError

    with pytest.raises(ProcessGroupError, match=r"^rank 1 failed: 'x.safetensors': cannot write: No space left on device$"):
        two_ranks(0, (None, "'x.safetensors': cannot write: No space left on device")).on_all(lambda: 3)
    with pytest.raises(ProcessGroupError, match=r"^rank 0 failed: ValueError: bad$"):
        two_ranks(1, (None, "ValueError: bad")).on_rank0(lambda: 3)
    assert two_ranks(0, (4, None)).on_all(lambda: 3) == [3, 4]
    assert two_ranks(1, (5, None)).on_rank0(lambda: 3) == 5


def test_files_are_shared_out_by_bytes():
    from ckpttool.execute.distributed import share_out

    # largest first, each to the lighter rank: 70 -> 0, 40 -> 1, 30 -> 1, 20 -> 0 (tie: lower rank), 10 -> 1
    assert share_out([10, 70, 20, 30, 40], 2) == [1, 0, 0, 1, 1]
