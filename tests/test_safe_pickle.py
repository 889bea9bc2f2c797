"""DCP metadata is unpickled with an allow-list: real metadata loads, anything else is refused unexecuted."""

from __future__ import annotations

import builtins
import io
import os
import pickle
import re
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from ckpttool.errors import SourceError, UnsafePickleError
from ckpttool.io.safe_pickle import load_metadata_pickle

STATE = {
    "model.embed_tokens.weight": torch.arange(35, dtype=torch.float32).reshape(7, 5),
    "model.norm.weight": torch.arange(5, dtype=torch.bfloat16),
    "step": torch.arange(3, dtype=torch.int64),
}


@pytest.fixture(scope="module")
def dcp_checkpoint(tmp_path_factory) -> Path:
    """A real DCP checkpoint written in-process (no process group: DCP warns and saves as rank 0)."""
    root = tmp_path_factory.mktemp("dcp")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(STATE, checkpoint_id=str(root))
    return root


class OpenFile:
    """Unpickling this with plain ``pickle`` creates ``path``."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


class RunShell:
    """Unpickling this with plain ``pickle`` runs a shell command."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


# --------------------------------------------------------------------------------------------- real metadata


def test_real_dcp_metadata_loads_with_dtypes_sizes_and_chunks(dcp_checkpoint):
    md = load_metadata_pickle((dcp_checkpoint / ".metadata").read_bytes(), ".metadata")
    tensors = md.get("state_dict_metadata")
    assert sorted(tensors) == sorted(STATE)
    for fqn, tensor in STATE.items():
        tmd = tensors[fqn]
        assert tmd.kind == "TensorStorageMetadata"
        assert tmd.get("properties").get("dtype") == str(tensor.dtype).removeprefix("torch.")
        assert tmd.get("size") == tuple(tensor.shape)
        (chunk,) = tmd.get("chunks")
        assert tuple(chunk.get("offsets")) == (0,) * tensor.dim()
        assert tuple(chunk.get("sizes")) == tuple(tensor.shape)


def test_real_dcp_storage_entries_point_at_each_tensors_bytes(dcp_checkpoint):
    md = load_metadata_pickle((dcp_checkpoint / ".metadata").read_bytes(), ".metadata")
    storage = {index.get("fqn"): (tuple(index.get("offset")), info) for index, info in md.get("storage_data").items()}
    assert sorted(storage) == sorted(STATE)
    for fqn, tensor in STATE.items():
        offset, info = storage[fqn]
        assert offset == (0,) * tensor.dim()
        data = (dcp_checkpoint / info.get("relative_path")).read_bytes()
        start, length = info.get("offset"), info.get("length")
        assert start + length <= len(data)
        loaded = torch.load(io.BytesIO(data[start:start + length]), weights_only=True)
        assert torch.equal(loaded, tensor)


# --------------------------------------------------------------------------------------------- refused


def test_reduce_to_open_is_refused_and_nothing_is_written(tmp_path):
    marker = tmp_path / "MARKER"
    payload = pickle.dumps({"state_dict_metadata": {}, "storage_data": OpenFile(str(marker))})
    pickle.loads(payload)["storage_data"].close()  # the payload is live: plain pickle creates the marker
    assert marker.exists()
    marker.unlink()

    with pytest.raises(UnsafePickleError) as excinfo:
        load_metadata_pickle(payload, "ckpt/.metadata")
    assert str(excinfo.value) == (
        f"'ckpt/.metadata': refused to unpickle: it asks for '{builtins.open.__module__}.open', which is not on "
        "ckpttool's allow-list of metadata classes (nothing was executed)"
    )
    assert not marker.exists()


def test_reduce_to_os_system_is_refused_and_nothing_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    payload = pickle.dumps([RunShell("touch MARKER")])
    with pytest.raises(UnsafePickleError) as excinfo:
        load_metadata_pickle(payload, ".metadata")
    assert f"'{os.system.__module__}.system'" in str(excinfo.value)
    assert str(excinfo.value).startswith("'.metadata': refused to unpickle: it asks for ")
    assert not (tmp_path / "MARKER").exists()


@pytest.mark.parametrize(
    ("payload", "refused"),
    [
        (b"cos\nsystem\n(Vtouch MARKER\ntR.", "os.system"),
        (b"cbuiltins\nopen\n(VMARKER\nVw\ntR.", "builtins.open"),
        (b"cbuiltins\neval\n(V__import__('os').system('touch MARKER')\ntR.", "builtins.eval"),
        (b"csubprocess\ncheck_call\n((Vtouch\nVMARKER\nltR.", "subprocess.check_call"),
        # an allowed module with a name outside the table
        (b"ctorch.distributed.checkpoint.metadata\nos\n.", "torch.distributed.checkpoint.metadata.os"),
        # a dotted attribute path of an allowed class
        (b"cbuiltins\nset.__init__\n.", "builtins.set.__init__"),
    ],
)
def test_hand_written_globals_are_refused_by_name(tmp_path, monkeypatch, payload, refused):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UnsafePickleError) as excinfo:
        load_metadata_pickle(payload, "evil.metadata")
    assert str(excinfo.value) == (
        f"'evil.metadata': refused to unpickle: it asks for '{refused}', which is not on ckpttool's allow-list of "
        "metadata classes (nothing was executed)"
    )
    assert list(tmp_path.iterdir()) == []


def test_persistent_ids_are_refused():
    with pytest.raises(UnsafePickleError, match=re.escape(
        "'.metadata': refused to unpickle: unexpected persistent id (nothing was executed)"
    )):
        load_metadata_pickle(b"Pstorage\n.", ".metadata")


def test_torch_tensors_in_metadata_are_refused():
    payload = pickle.dumps({"x": torch.arange(3)})
    with pytest.raises(UnsafePickleError) as excinfo:
        load_metadata_pickle(payload, ".metadata")
    assert str(excinfo.value).startswith("'.metadata': refused to unpickle: it asks for 'torch.")


def test_unsafe_pickle_error_is_a_source_error():
    assert issubclass(UnsafePickleError, SourceError)


# --------------------------------------------------------------------------------------------- broken bytes


def test_truncated_metadata_is_a_source_error_at_every_cut(dcp_checkpoint):
    data = (dcp_checkpoint / ".metadata").read_bytes()
    for cut in range(len(data)):
        with pytest.raises(SourceError) as excinfo:
            load_metadata_pickle(data[:cut], ".metadata")
        assert type(excinfo.value) is SourceError, (cut, excinfo.value)
        message = str(excinfo.value)
        assert message.startswith("'.metadata': cannot read the metadata pickle ("), (cut, message)
        assert message.endswith("); is it truncated?"), (cut, message)


def test_garbage_bytes_are_a_source_error():
    with pytest.raises(SourceError) as excinfo:
        load_metadata_pickle(b"\x00\x01 this is not a pickle", "shard/.metadata")
    assert type(excinfo.value) is SourceError
    assert str(excinfo.value).startswith("'shard/.metadata': cannot read the metadata pickle (")
    assert str(excinfo.value).endswith("is it truncated?")
