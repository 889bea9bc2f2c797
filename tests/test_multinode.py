"""Two torchrun launchers on this machine as two nodes (``--nnodes 2``, c10d rendezvous on 127.0.0.1), one shared
file system: the merge and the split they write equal one process's byte for byte, and a node killed mid-run
stops the other with a message naming it, the destination left as it was."""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT, fixture_dir, tree_digest

import ckpttool

MIXTRAL = fixture_dir("mixtral_fsdp2_dcp")
WORKER = Path(__file__).with_name("multinode_worker.py")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(*args: str, die_rank: int | None = None) -> list[subprocess.CompletedProcess]:
    """One launcher per node, both started at once; each node's (returncode, stdout, stderr). With ``die_rank``,
    that rank SIGKILLs itself as it starts writing its share (tests/multinode_worker.py)."""
    env = {**os.environ, "CKPTTOOL_DIST_TIMEOUT": "60", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join([str(ROOT), str(WORKER.parent)])}
    if die_rank is not None:
        env["CKPTTOOL_TEST_DIE_RANK"] = str(die_rank)
    port = free_port()
    launched = [
        subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
             "--nproc_per_node", "1", "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}",
             "--monitor_interval", "0.1", str(WORKER), *args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=ROOT)
        for node in (0, 1)
    ]
    done = []
    for process in launched:
        try:
            out, err = process.communicate(timeout=240)
        except subprocess.TimeoutExpired:
            for p in launched:
                p.kill()
            raise
        done.append(subprocess.CompletedProcess(process.args, process.returncode, out, err))
    return done


def every_file(directory: Path) -> dict[str, bytes]:
    """The bytes of every file under ``directory``, its own path (the audit report names it) written OUT."""
    return {str(p.relative_to(directory)): p.read_bytes().replace(str(directory).encode(), b"OUT")
            for p in sorted(directory.rglob("*")) if p.is_file()}


def neighbours(dest: Path) -> list[str]:
    """What lies beside the destination: staging directories and lock files of ckpttool."""
    return sorted(p.name for p in dest.parent.iterdir() if p.name.startswith(f".{dest.name}."))


@pytest.fixture(scope="module")
def one_merge(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "merged"
    ckpttool.merge(MIXTRAL / "checkpoint", out, max_shard_size="100KB")
    return out


@pytest.fixture(scope="module")
def one_split(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("one") / "split"
    ckpttool.split(MIXTRAL / "reference", out, fsdp=2, ep=2)
    return out


def test_two_nodes_merge_what_one_process_merges(tmp_path, one_merge):
    nodes = two_nodes("merge", str(MIXTRAL / "checkpoint"), str(tmp_path / "two"), "--max-shard-size", "100KB")
    assert [n.returncode for n in nodes] == [0, 0], "".join(n.stdout + n.stderr for n in nodes)
    assert every_file(tmp_path / "two") == every_file(one_merge)  # the audit report too
    assert len(list((tmp_path / "two").glob("model-*.safetensors"))) == 4  # both nodes wrote a share
    assert sum(n.stdout.count("coverage: ok") for n in nodes) == 1  # only rank 0 speaks
    assert neighbours(tmp_path / "two") == []


def test_two_nodes_split_what_one_process_splits(tmp_path, one_split):
    nodes = two_nodes("split", str(MIXTRAL / "reference"), str(tmp_path / "two"), "--to", "dcp", "--fsdp", "2",
                      "--ep", "2")
    assert [n.returncode for n in nodes] == [0, 0], "".join(n.stdout + n.stderr for n in nodes)
    assert every_file(tmp_path / "two") == every_file(one_split)
    assert len(list((tmp_path / "two").glob("*.distcp"))) == 2  # one rank file written by each node


@pytest.mark.parametrize("command", ["merge", "split"])
def test_a_node_killed_mid_run_stops_the_other_and_the_destination_stays(tmp_path, one_merge, one_split, command):
    # the destination holds an earlier merge (or split) that --force would replace: after the failure it must
    # hold it still, byte for byte, with no staging directory or lock beside it
    dest = tmp_path / "out"
    shutil.copytree(one_merge if command == "merge" else one_split, dest)
    if command == "merge":
        args = ["merge", str(MIXTRAL / "checkpoint"), str(dest), "--max-shard-size", "100KB", "--force"]
    else:
        args = ["split", str(MIXTRAL / "reference"), str(dest), "--to", "dcp", "--fsdp", "2", "--ep", "2", "--force"]
    before = tree_digest(dest)
    nodes = two_nodes(*args, die_rank=1)
    assert [n.returncode for n in nodes] == [1, 1], "".join(n.stdout + n.stderr for n in nodes)
    # ckpttool's own line (after the erased progress bar); torchrun's agents add their tracebacks below it
    told = [m.group(1) for n in nodes for m in re.finditer(r"(?:^|\s)Error: (.*)", n.stderr, re.MULTILINE)]
    assert len(told) == 1, told  # the survivor, rank 0; the killed one says nothing
    message = told[0]
    # c10d numbers the nodes as they join (node_rank is ignored): rank 0 is on node 0, rank 1 on node 1
    assert message.startswith(f"rank 0 (node 0) lost contact with node 1 on {socket.gethostname()} (rank 1): ")
    assert message.endswith("did not answer within 60 s (CKPTTOOL_DIST_TIMEOUT); nothing was published")
    assert tree_digest(dest) == before
    assert neighbours(dest) == []  # rank 0 removed its staging directory and released the lock


def test_the_lost_processes_are_named_by_node_host_and_rank():
    from ckpttool.execute.distributed import Group

    group = Group()
    group.rank, group.world = 0, 4
    group.places = [("0", "a"), ("0", "a"), ("1", "b"), ("1", "b")]
    error = RuntimeError("[/x/gloo/transport/tcp/pair.cc:537] Read error [10.0.0.2]:23955: Connection reset by peer. "
                         "This is typically caused by a remote worker hanging")
    assert group.lost(error).startswith("rank 0 (node 0) lost contact with node 1 on b (ranks 2, 3): Read error "
                                         "[10.0.0.2]:23955: Connection reset by peer. That node stopped")
    group.places = [("0", "a")] * 4  # one node: all the others are named
    assert "lost contact with node 0 on a (ranks 1, 2, 3): " in group.lost(error)
    group.world, group.places = 2, [("0", ""), ("1", "")]  # a running job's group (the live gather): hosts unknown
    assert "lost contact with node 1 (rank 1): Read error" in group.lost(error)


def test_rank_0_lost_the_survivor_tells_and_the_next_run_takes_over(tmp_path, one_merge):
    dest = tmp_path / "out"
    shutil.copytree(one_merge, dest)
    before = tree_digest(dest)
    nodes = two_nodes("merge", str(MIXTRAL / "checkpoint"), str(dest), "--max-shard-size", "100KB", "--force",
                      die_rank=0)
    assert [n.returncode for n in nodes] == [1, 1], "".join(n.stdout + n.stderr for n in nodes)
    told = [m.group(1) for n in nodes for m in re.finditer(r"(?:^|\s)Error: (.*)", n.stderr, re.MULTILINE)]
    assert len(told) == 1 and told[0].startswith(  # rank 1 speaks: rank 0, who would, is gone
        f"rank 1 (node 1) lost contact with node 0 on {socket.gethostname()} (rank 0): "), told
    assert told[0].endswith("; nothing was published")
    assert tree_digest(dest) == before
    # the lost rank 0's staging directory and lock stay beside the destination, clearly named, never published
    left = neighbours(dest)
    assert len(left) == 2 and left[0] == ".out.ckpttool-lock" and left[1].startswith(".out.ckpttool-partial-"), left
    ckpttool.merge(MIXTRAL / "checkpoint", dest, max_shard_size="100KB", force=True)  # its flock died with it
    assert neighbours(dest) == []
    assert every_file(dest) == every_file(one_merge)
