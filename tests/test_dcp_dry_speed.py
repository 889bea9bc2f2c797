"""Dry runs of DCP checkpoints defer locating each item's data record (issue 31: 92k items in seconds).

``merge --dry-run`` and ``audit --no-data`` prove a plan from ``.metadata`` and one ``stat`` per file; they do not
open the ``.distcp`` files (:func:`ckpttool.readers.dcp.locating_deferred`). The run that reads locates every item
and refuses a bad one with the message it always gave; the dry run's plan and predicted peak are the real run's.
The stand-ins of the metadata unpickler take C's fast paths yet still charge every pickle for the work it causes.
"""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path

import pytest
import torch

from ckpttool.commands import merge as merge_module
from ckpttool.errors import PickleBombError, UnsafePickleError
from ckpttool.io import torch_save
from ckpttool.io.safe_pickle import Record, load_metadata_pickle
from ckpttool.layout.layout import RAW
from ckpttool.readers import dcp, read_layout
from conftest import assert_failed_cleanly, tree_digest
from test_dcp_fast import replace_item, saved

pytestmark = pytest.mark.usefixtures("describe_inline")  # configs described here, not in a subprocess each
FQN = "model.norm.weight"


@pytest.fixture
def no_locating(monkeypatch):
    """Fail the test if any item is located (its ``.distcp`` file opened to read its zip records)."""
    def refuse(*args, **kwargs):
        raise AssertionError("an item was located in a dry run")
    monkeypatch.setattr(dcp, "locate", refuse)


def test_a_deferred_layout_is_the_located_one_at_item_starts(no_locating):
    root = Path(__file__).parent.parent / "fixtures" / "llama_tp2_dcp" / "checkpoint"
    with dcp.locating_deferred():
        deferred = read_layout(root)
    for tensor in deferred.tensors.values():
        for piece in tensor.pieces:
            assert piece.encoding == RAW
            assert piece.byte_length == piece.box.numel * {"F32": 4, "BF16": 2, "F16": 2}[piece.dtype]
    with dcp.locating_deferred(False), pytest.raises(AssertionError, match="located in a dry run"):
        assert not dcp.deferring()
        read_layout(root)
    with dcp.locating_deferred():
        assert dcp.deferring()
    assert not dcp.deferring()


def test_only_the_byte_offsets_differ_and_the_real_run_locates(monkeypatch):
    root = Path(__file__).parent.parent / "fixtures" / "llama_tp2_dcp" / "checkpoint"
    with dcp.locating_deferred():
        deferred = read_layout(root)
    located = read_layout(root)
    assert deferred.tensors.keys() == located.tensors.keys()
    for name, tensor in located.tensors.items():
        for real, dry in zip(tensor.pieces, deferred.tensors[name].pieces, strict=True):
            assert (dry.file, dry.key, dry.box, dry.dtype, dry.encoding) == (real.file, real.key, real.box, real.dtype, RAW)
            assert dry.byte_offset < real.byte_offset and dry.byte_length == real.byte_length  # the item's start
    # outside the block again: the real run locates
    assert read_layout(root).tensors[FQN].pieces == located.tensors[FQN].pieces


def test_the_dry_run_plan_and_peak_are_the_located_ones(cli, monkeypatch, no_locating):
    root = Path(__file__).parent.parent / "fixtures" / "mixtral_fsdp8_dcp_zero_chunk" / "checkpoint"
    dry = cli("merge", root, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output
    monkeypatch.undo()
    monkeypatch.setattr(merge_module, "locating_deferred", contextlib.nullcontext)  # a dry run that locates
    located = cli("merge", root, "--dry-run", "--json")
    assert json.loads(dry.stdout) == json.loads(located.stdout)


def test_audit_without_data_defers_and_with_data_locates(cli, monkeypatch):
    root = Path(__file__).parent.parent / "fixtures" / "llama_tp2_dcp" / "checkpoint"
    calls: list[str] = []
    real = dcp.locate
    monkeypatch.setattr(dcp, "locate", lambda *a, **k: calls.append(k["item"]) or real(*a, **k))
    no_data = cli("audit", root, "--no-data", "--json")
    assert no_data.exit_code == 0, no_data.output
    assert calls == []
    with_data = cli("audit", root, "--json")
    assert with_data.exit_code == 0, with_data.output
    assert FQN in calls
    codes = lambda r: sorted(f["code"] for f in json.loads(r.stdout)["findings"])  # noqa: E731
    assert [c for c in codes(no_data) if c != "data-not-checked"] == [c for c in codes(with_data) if c != "data-not-checked"]


def test_a_bad_item_passes_the_dry_run_and_the_real_run_refuses_it(copy_fixture, cli, tmp_path):
    checkpoint = copy_fixture("llama_tp2_dcp")
    rel = replace_item(checkpoint, FQN, lambda d: saved({"w": torch.ones(3)}))
    source = tree_digest(checkpoint.parent)
    dry = cli("merge", checkpoint, "--dry-run", "--json")
    assert dry.exit_code == 0, dry.output  # deferred: the item's pickle is read by the run that reads it
    out = tmp_path / "out"
    result = cli("merge", checkpoint, out)
    assert_failed_cleanly(result, out, f"'{rel}': '{FQN}' holds dict but the metadata records")
    assert tree_digest(checkpoint.parent) == source


def test_a_truncated_file_is_refused_by_the_dry_run_too(copy_fixture, cli):
    checkpoint = copy_fixture("llama_tp2_dcp")
    data = sorted(checkpoint.glob("*.distcp"))[-1]
    size = data.stat().st_size
    with open(data, "r+b") as f:
        f.truncate(size - 10)
    source = tree_digest(checkpoint.parent)
    for args in (("merge", checkpoint, "--dry-run"), ("audit", checkpoint, "--no-data")):
        result = cli(*args)
        assert result.exit_code == 1, result.output
        assert "Traceback" not in result.output
        assert f"'{data.name}': '" in result.stderr and f"but the file has {size - 10}; it is truncated" in result.stderr
    assert tree_digest(checkpoint.parent) == source


def test_a_forbidden_global_in_the_metadata_is_refused_by_the_dry_run(copy_fixture, cli, tmp_path):
    checkpoint = copy_fixture("llama_tp2_dcp")
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    (checkpoint / ".metadata").write_bytes(pickle.dumps({"state_dict_metadata": Payload()}, protocol=2))
    result = cli("merge", checkpoint, "--dry-run")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert "it asks for 'pathlib." in result.stderr and "not on ckpttool's allow-list" in result.stderr
    assert not marker.exists()


# ---- the metadata stand-ins' fast paths still charge what they are handed

_GLOBAL = b"ctorch.distributed.checkpoint.metadata\nMetadataIndex\n"


def _shared_state_pickle(objects: int, entries: int) -> bytes:
    """A pickle of ``objects`` MetadataIndex objects (NEWOBJ) all given one state dict of ``entries`` (memoized)."""
    state = b"}q\x01(" + b"".join(b"X" + len(k).to_bytes(4, "little") + k + b"K\x01"
                                  for k in (f"k{i}".encode() for i in range(entries))) + b"u"
    first = _GLOBAL + b"q\x00)\x81" + state + b"b"
    rest = b"h\x00)\x81h\x01b" * (objects - 1)
    return b"\x80\x02](" + first + rest + b"e."


def test_a_state_dict_shared_by_many_objects_is_a_pickle_bomb():
    small = load_metadata_pickle(_shared_state_pickle(3, 4), ".metadata")
    assert [type(r).__name__ for r in small] == ["MetadataIndex"] * 3 and small[2].get("k3") == 1
    data = _shared_state_pickle(20_000, 2_000)  # ~0.2 MB asking for 40M steps of work
    with pytest.raises(PickleBombError, match="more than .* steps of work"):
        load_metadata_pickle(data, ".metadata")


def test_a_size_handed_a_shared_list_over_and_over_is_a_pickle_bomb():
    ints = b"(" + b"K\x01" * 5_000 + b"l"  # one list of 5000 ints, memoized
    call = b"h\x00h\x01\x85R"  # torch.Size(the list)
    data = b"\x80\x02](ctorch\nSize\nq\x00" + ints + b"q\x01" + call * 20_000 + b"e."
    with pytest.raises(PickleBombError, match="steps of work"):
        load_metadata_pickle(data, ".metadata")


def test_a_state_naming_args_and_a_forbidden_class_keep_their_refusals():
    record = Record(7)
    record.__setstate__({"_args": "x", "lr": 0.1})
    assert record._args == (7,) and record.lr == 0.1
    with pytest.raises(UnsafePickleError, match="'os.system'"):
        load_metadata_pickle(b"\x80\x02cos\nsystem\nX\x04\x00\x00\x00echo\x85R.", ".metadata")
    assert torch_save.locate is dcp.locate
