"""Locating a tensor's raw bytes inside a ``torch.save`` archive without loading it or running its pickle."""

from __future__ import annotations

import io
import math
import os

import torch

from ckpttool.io.dtypes import itemsize
from ckpttool.io.torch_save import locate


def saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def element_bytes(data: bytes, found, prefix: int = 0) -> bytes:
    n = math.prod(found.shape) * itemsize(found.dtype)
    return data[prefix + found.byte_offset(): prefix + found.byte_offset() + n]


def test_a_plain_tensor_inside_a_larger_file():
    tensor = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    archive = b"\x00" * 100 + saved(tensor) + b"\xff" * 50  # as one item of a .distcp file
    found = locate(io.BytesIO(archive), 100, len(archive) - 150)
    assert (found.dtype, found.shape) == ("F32", (4, 6))
    assert element_bytes(archive, found, 100) == tensor.numpy().tobytes()


def test_a_view_with_a_storage_offset():
    base = torch.arange(40, dtype=torch.int64)
    view = base[10:22].view(3, 4)
    archive = saved(view)  # torch.save writes the whole storage; the view starts at element 10
    found = locate(io.BytesIO(archive), 0, len(archive))
    assert (found.dtype, found.shape) == ("I64", (3, 4))
    assert element_bytes(archive, found) == view.contiguous().numpy().tobytes()


def test_bfloat16():
    tensor = torch.randn(5, 3).to(torch.bfloat16)
    archive = saved(tensor)
    found = locate(io.BytesIO(archive), 0, len(archive))
    assert element_bytes(archive, found) == tensor.view(torch.int16).numpy().tobytes()


def test_what_cannot_be_located_falls_back():
    for obj in (torch.arange(12.0).reshape(3, 4).t(), {"a": torch.ones(2)}, [torch.ones(2)], 3):
        archive = saved(obj)
        assert locate(io.BytesIO(archive), 0, len(archive)) is None, obj
    assert locate(io.BytesIO(b"not a zip at all"), 0, 16) is None


def test_a_malicious_pickle_is_not_run(tmp_path):
    marker = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    archive = saved(Payload())
    assert locate(io.BytesIO(archive), 0, len(archive)) is None
    assert not marker.exists()


def test_scan_a_training_checkpoint_with_allowed_args(tmp_path):
    import argparse

    from ckpttool.io.safe_pickle import Record
    from ckpttool.io.torch_save import scan

    flat = torch.arange(30, dtype=torch.float32)
    state = {
        "args": argparse.Namespace(tensor_model_parallel_size=2, padded_vocab_size=1280),
        "iteration": 7,
        "model": {"w": torch.nn.Parameter(flat[:12].view(3, 4)), "b": flat[12:18], "t": flat[:12].view(3, 4).t()},
        "shapes": [torch.Size([3, 4])],
    }
    path = tmp_path / "model_optim_rng.pt"
    torch.save(state, path)
    allow = {("argparse", "Namespace"): Record}
    with open(path, "rb") as f:
        found = scan(f, label=path.name, allow=allow)
    data = path.read_bytes()
    assert found["iteration"] == 7 and found["shapes"] == [(3, 4)]
    assert found["args"].tensor_model_parallel_size == 2
    w, b, t = found["model"]["w"], found["model"]["b"], found["model"]["t"]
    assert w.storage == b.storage == t.storage  # views of one buffer
    assert data[w.byte_offset(): w.byte_offset() + 48] == flat[:12].numpy().tobytes()
    assert data[b.byte_offset(): b.byte_offset() + 24] == flat[12:18].numpy().tobytes()
    assert t.byte_offset() is None and not t.contiguous


def test_scan_refuses_what_it_does_not_allow(tmp_path):
    import argparse

    import pytest

    from ckpttool.errors import SourceError, UnsafePickleError
    from ckpttool.io.torch_save import scan

    path = tmp_path / "ckpt.pt"
    torch.save({"args": argparse.Namespace(x=1), "w": torch.ones(2)}, path)
    with open(path, "rb") as f, pytest.raises(UnsafePickleError, match=r"'ckpt.pt': refused to unpickle: it asks for 'argparse.Namespace'"):
        scan(f, label="ckpt.pt")
    path.write_bytes(path.read_bytes()[:100])
    with open(path, "rb") as f, pytest.raises(SourceError, match=r"'ckpt.pt': cannot read it as a torch.save archive"):
        scan(f, label="ckpt.pt")


def test_a_tensor_not_stored_in_place_is_named(tmp_path):
    import pytest

    from ckpttool.errors import SourceError
    from ckpttool.io.torch_save import scan

    buffer = io.BytesIO()
    torch.save({"w": torch.arange(12.0).reshape(3, 4).t()}, buffer)
    buffer.seek(0)
    found = scan(buffer, label="rank0.pt")["w"]
    with pytest.raises(SourceError, match=r"'rank0.pt': 'w' is not stored contiguously in place; ckpttool cannot read it"):
        found.required_offset("rank0.pt", "w")
