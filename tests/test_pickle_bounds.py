"""A pickle cannot make ckpttool work without bound: shared objects walked as a tree, lists handed to a million
calls, cycles and deep nesting are refused in seconds, naming the file, on every pickle-reading path."""

from __future__ import annotations

import io
import pickle
import shutil
import signal
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from ckpttool.errors import PickleBombError, SourceError
from ckpttool.io.pickle_bounds import MAX_DEPTH, bound_graph
from ckpttool.io.safe_pickle import load_metadata_pickle
from ckpttool.io.torch_save import locate, scan
from conftest import FIXTURES, fixture_dir


class TookTooLong(BaseException):
    """Raised by :func:`within` (a BaseException: the CLI's handlers must not turn it into an exit code)."""


@contextmanager
def within(seconds: int):
    """Fail the test when the block runs longer than ``seconds`` (it would otherwise hang for hours)."""

    def fire(*_):
        raise TookTooLong(f"still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def dag(levels: int = 60) -> list:
    """60 levels, each referring twice to the one below: 400 bytes pickled, 2**61 nodes as a tree."""
    node: list = ["leaf"]
    for _ in range(levels):
        node = [node, node]
    return node


def saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def copy_tree(src: Path, tmp: Path) -> Path:
    dest = tmp / src.name
    shutil.copytree(src, dest)
    return dest


def megatron_legacy(tmp: Path) -> tuple[Path, str]:
    root = copy_tree(FIXTURES / "megatron_tp2_pp2" / "legacy", tmp)
    (root / "iter_0000010" / "mp_rank_00_000" / "model_optim_rng.pt").write_bytes(saved({"args": None, "junk": dag()}))
    return root, "'iter_0000010/mp_rank_00_000/model_optim_rng.pt'"


def verl_rank(tmp: Path) -> tuple[Path, str]:
    root = copy_tree(fixture_dir("verl_llama_fsdp4") / "checkpoint", tmp)
    (root / "model_world_size_4_rank_0.pt").write_bytes(saved({"junk": dag()}))
    return root, "'model_world_size_4_rank_0.pt'"


def colossalai_bin(tmp: Path) -> tuple[Path, str]:
    root = copy_tree(fixture_dir("colossalai_llama_pp2_bin") / "checkpoint", tmp)
    (root / "pytorch_model-stage-00001-shard-00001.bin").write_bytes(saved({"junk": dag()}))
    return root, "'pytorch_model-stage-00001-shard-00001.bin'"


def dcp_metadata(tmp: Path) -> tuple[Path, str]:
    root = copy_tree(fixture_dir("llama_tp2_dcp") / "checkpoint", tmp)
    (root / ".metadata").write_bytes(pickle.dumps(dag()))
    return root, "'.metadata'"


def dcp_item(tmp: Path) -> tuple[Path, str]:
    """A ``.distcp`` item holding the DAG where a tensor should be (it must not reach ``torch.load`` either)."""
    from test_errors import edit_metadata, storage_of

    root = copy_tree(fixture_dir("llama_tp2_dcp") / "checkpoint", tmp)
    bomb = saved({"junk": dag(), "pad": "x" * 70_000})  # as large as the real piece: only the bound refuses it
    path = root / "__0_0.distcp"
    offset = path.stat().st_size
    path.write_bytes(path.read_bytes() + bomb)

    def point_at_bomb(md):
        for _, info in storage_of(md, "model.embed_tokens.weight"):
            if info.relative_path == "__0_0.distcp":
                info.offset, info.length = offset, len(bomb)
    edit_metadata(root, point_at_bomb)
    return root, "'__0_0.distcp'"


SOURCES = {"megatron-legacy": megatron_legacy, "verl": verl_rank, "colossalai": colossalai_bin, "dcp": dcp_metadata,
           "dcp item": dcp_item}


@pytest.mark.parametrize("command", ["merge", "audit"])
@pytest.mark.parametrize("source", sorted(SOURCES))
def test_a_pickled_dag_is_refused_in_seconds(cli, tmp_path, source, command):
    root, named = SOURCES[source](tmp_path)
    args = (command, root, tmp_path / "out") if command == "merge" else (command, root)
    start = time.monotonic()
    with within(60):
        result = cli(*args)
    assert time.monotonic() - start < 30
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    says = f"Error: {named}: refused: its pickled objects refer to shared parts so often"
    assert says in result.stderr, result.stderr
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------- the library


def test_the_structure_check_names_the_tree_size():
    with pytest.raises(PickleBombError, match=r"'f.pt': refused: .* would visit 3458764513820540927 objects "
                                              r"\(61 containers holding 121 references; the limit is 1001456\)"):
        bound_graph(dag(), "f.pt")


def test_sharing_that_a_real_checkpoint_has_passes():
    shared = torch.Size([4, 4])
    bound_graph({f"t{i}": {"shape": shared, "dtype": "F32"} for i in range(10_000)}, "f.pt")
    bound_graph(dag(16), "f.pt")  # 131071 nodes as a tree: under the base allowance
    bound_graph({"params": list(range(3_000_000))}, "f.pt")  # big, but no sharing


def test_a_cycle_is_refused():
    loop: list = []
    loop.append(loop)
    with pytest.raises(PickleBombError, match="'f.pt': refused: its pickled objects contain themselves"):
        scan(io.BytesIO(saved({"x": loop})), label="f.pt")


def test_deep_nesting_is_refused():
    deep: list = []
    for _ in range(MAX_DEPTH + 5):
        deep = [deep]
    with pytest.raises(PickleBombError, match=f"nested more than {MAX_DEPTH} levels deep"):
        load_metadata_pickle(pickle.dumps(deep), ".metadata")


def hand_over(callable_global: bytes, times: int, length: int) -> bytes:
    """A pickle that builds one list of ``length`` ints and hands it to ``callable_global`` ``times`` times."""
    out = bytearray(b"\x80\x02]q\x00(" + b"K\x01" * length + b"e")  # list memo 0, APPENDS
    out += b"]q\x01("  # the results, memo 1
    for _ in range(times):
        out += b"c" + callable_global + b"\nh\x00\x85R"  # GLOBAL, BINGET 0, TUPLE1, REDUCE
    out += b"e."
    return bytes(out)


def test_a_list_handed_to_a_million_calls_is_refused_while_unpickling():
    data = hand_over(b"torch\nSize", times=200_000, length=100_000)  # 2e10 steps unbounded; 3 MB
    with within(60), pytest.raises(PickleBombError, match="'.metadata': refused to unpickle: it makes ckpttool do "
                                                          "more than .* steps of work"):
        load_metadata_pickle(data, ".metadata")


def test_a_bomb_in_a_distcp_item_is_not_handed_to_torch_load():
    archive = saved({"junk": dag()})
    with pytest.raises(PickleBombError):
        locate(io.BytesIO(archive), 0, len(archive))


def test_a_pickle_bomb_is_a_source_error():
    assert issubclass(PickleBombError, SourceError)
