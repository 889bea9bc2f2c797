"""Locating DCP items from their zip records (``ckpttool.io.torch_zip``) gives what the safe path gives.

The fast path reads an item's zip records directly and its ``data.pkl`` once per distinct pickle; anything it does
not recognise goes through ``zipfile`` and the safe unpickler as before, logged with the reason, the file and the
item. Tampered items are refused (the real run) or fall back; the allow-lists still refuse what they refused.
"""

from __future__ import annotations

import io
import logging
import pickle
import zipfile
from pathlib import Path

import pytest
import torch

from ckpttool.errors import PickleBombError, UnsafePickleError
from ckpttool.io import torch_pickle, torch_save
from ckpttool.io.pickle_bounds import bound_graph
from ckpttool.io.safe_pickle import load_metadata_pickle
from ckpttool.io.torch_save import locate, scan
from ckpttool.layout.layout import RAW, TORCH_SAVE
from ckpttool.readers import dcp
from conftest import FIXTURES, assert_failed_cleanly, tree_digest

ROOTS = sorted({p.parent for pattern in ("*dcp*/**/.metadata", "torchtitan_*/**/.metadata")
                for p in FIXTURES.glob(pattern)})
LOG = "ckpttool.io.torch_save"


def pieces(layout) -> dict[str, list[tuple]]:
    return {name: [(p.file, p.box.offsets, p.box.sizes, p.dtype, p.encoding, p.byte_offset, p.byte_length)
                   for p in t.pieces] for name, t in layout.tensors.items()}


def saved(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def rezip(data: bytes, extra: dict[str, bytes] | None = None, short: int = 0) -> bytes:
    """``data`` (a torch.save archive) written again by Python's zipfile, with ``extra`` records, its data record
    ``short`` bytes short."""
    source, out = zipfile.ZipFile(io.BytesIO(data)), io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as archive:
        for info in source.infolist():
            content = source.read(info)
            archive.writestr(info.filename, content[: len(content) - short] if "/data/" in info.filename else content)
        for name, content in (extra or {}).items():
            archive.writestr(name, content)
    return out.getvalue()


def replace_item(checkpoint: Path, fqn: str, make) -> str:
    """Append ``make(old item bytes)`` to the item's file in ``checkpoint`` (a copy) and point its first chunk's
    storage entry at it (torch's own metadata classes, pickled again); returns the item's file."""
    metadata = pickle.loads((checkpoint / ".metadata").read_bytes())  # the test's own copy of a fixture
    index = next(i for i in metadata.storage_data if i.fqn == fqn and not any(i.offset))
    info = metadata.storage_data[index]
    path = checkpoint / info.relative_path
    with open(path, "r+b") as f:
        f.seek(info.offset)
        new = make(f.read(info.length))
        f.seek(0, io.SEEK_END)
        start = f.tell()
        f.write(new)
    metadata.storage_data[index] = type(info)(info.relative_path, start, len(new))
    (checkpoint / ".metadata").write_bytes(pickle.dumps(metadata))
    return info.relative_path


@pytest.fixture
def safe_only(monkeypatch):
    """Every item through zipfile and the safe unpickler, as before the fast path."""
    monkeypatch.setattr(torch_save, "read_archive", lambda *args: "the fast path is off")


def test_the_fixtures_are_found():
    assert len(ROOTS) >= 30 and any("torchtitan" in str(r) for r in ROOTS)


@pytest.mark.parametrize("root", ROOTS, ids=lambda r: str(r.relative_to(FIXTURES)))
def test_the_fast_path_gives_the_safe_layout(root, monkeypatch, caplog):
    with caplog.at_level(logging.DEBUG, logger=LOG):
        fast = pieces(dcp.read(root, None))
    assert not [r for r in caplog.records if "reading it through zipfile" in r.getMessage()]  # all taken fast
    monkeypatch.setattr(torch_save, "read_archive", lambda *args: "the fast path is off")
    assert fast == pieces(dcp.read(root, None))
    assert any(p[4] == RAW for ps in fast.values() for p in ps)


@pytest.mark.parametrize("obj", [torch.arange(24, dtype=torch.float32).reshape(4, 6),
                                 torch.arange(40, dtype=torch.int64)[10:22].view(3, 4),
                                 torch.ones(0, 5, dtype=torch.bfloat16), torch.tensor(3.0)])
def test_archives_as_torch_and_as_zipfile_write_them(obj):
    for data in (saved(obj), rezip(saved(obj))):
        item = b"\x07" * 33 + data + b"\x09" * 5  # inside a larger .distcp file
        fast = torch_save._locate_fast(io.BytesIO(item), 33, len(data))
        assert fast == scan(io.BytesIO(item), 33, len(data), label="f")
        assert fast.byte_offset() is not None


def test_two_shapes_of_one_dtype_keep_their_own_pickles():
    for shape in ((2, 3), (3, 2), (6,), (2, 3)):
        data = saved(torch.zeros(shape))
        assert locate(io.BytesIO(data), 0, len(data)).shape == shape


@pytest.mark.parametrize("tamper, reason, located", [
    (lambda d: rezip(d, {"archive/extra": b"x"}), "an unexpected record 'archive/extra'", True),
    (lambda d: rezip(d, {"archive/data/1": b"xxxx"}), "its data records ['0', '1'] are not one record", True),
    (lambda d: rezip(d, short=4), "its data records ['0'] are not one record 'data/0' of 24 bytes", False),
    (lambda d: saved({"w": torch.ones(2, 3)}), "its data.pkl is not one plain tensor", False),
    (lambda d: d[:-1] + b"!", "no plain end of central directory record at its end", True),
], ids=["extra record", "extra data record", "short data record", "not a tensor", "bad end record"])
def test_a_tampered_item_falls_back_with_its_reason(tamper, reason, located, caplog):
    data = tamper(saved(torch.arange(6, dtype=torch.float32).reshape(2, 3)))
    with caplog.at_level(logging.DEBUG, logger=LOG):
        found = locate(io.BytesIO(data), 0, len(data), label="__0_0.distcp", item="model.norm.weight")
    message = f"'__0_0.distcp': item 'model.norm.weight' at bytes 0..{len(data)}: {reason}"
    assert any(r.getMessage().startswith(message) for r in caplog.records), caplog.text
    assert (found is not None) == located
    if located:
        assert found == scan(io.BytesIO(data), 0, len(data), label="f")


def test_a_forbidden_global_in_an_item_is_still_refused_unrun(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    data = saved(Payload())
    assert locate(io.BytesIO(data), 0, len(data)) is None
    with pytest.raises(UnsafePickleError, match="it asks for 'pathlib.*Path'"):
        scan(io.BytesIO(data), label="__0_0.distcp")
    assert not marker.exists()
    assert not any(b"touch" in key for key in torch_pickle._PLAIN)  # a refused pickle is never remembered


def test_a_forbidden_global_in_the_metadata_is_still_refused(tmp_path):
    marker = tmp_path / "ran"

    class Payload:
        def __reduce__(self):
            return (Path.touch, (marker,))

    data = pickle.dumps({"state_dict_metadata": Payload()}, protocol=2)
    with pytest.raises(UnsafePickleError, match="not on ckpttool's allow-list"):
        load_metadata_pickle(data, ".metadata")
    assert not marker.exists()


def test_the_graph_bound_still_refuses_cycles_depth_and_shared_walks():
    cycle: list = []
    cycle.append([cycle])
    deep: list = []
    for _ in range(200):
        deep = [deep]
    shared: list = ["leaf"]
    for _ in range(64):
        shared = [shared, shared]
    for graph, needle in ((cycle, "contain themselves"), (deep, "nested more than"), (shared, "more than 4e18")):
        with pytest.raises(PickleBombError, match=needle):
            bound_graph(graph, "x")
    bound_graph({"a": [1, 2, (3, "b")], "c": {"d": None}}, "x")


def test_the_reader_locates_a_rewritten_item_and_refuses_a_tampered_one(copy_fixture, caplog):
    checkpoint = copy_fixture("llama_tp2_dcp")
    before = pieces(dcp.read(checkpoint, None))
    fqn = "model.norm.weight"
    rel = replace_item(checkpoint, fqn, lambda d: rezip(d, {"archive/extra": b"x"}))
    with caplog.at_level(logging.DEBUG, logger=LOG):
        after = pieces(dcp.read(checkpoint, None))
    assert f"'{rel}': item '{fqn}'" in caplog.text and "an unexpected record 'archive/extra'" in caplog.text
    assert after[fqn][0][4] == RAW and after[fqn][0][5] != before[fqn][0][5]
    assert {k: v for k, v in after.items() if k != fqn} == {k: v for k, v in before.items() if k != fqn}
    replace_item(checkpoint, fqn, lambda d: saved({"w": torch.ones(3)}))
    assert pieces(dcp.read(checkpoint, None))[fqn][0][4] == TORCH_SAVE


@pytest.mark.usefixtures("describe_inline")  # the config is described here, not in a subprocess
def test_a_merge_refuses_an_item_that_is_not_a_tensor(copy_fixture, cli, tmp_path):
    checkpoint = copy_fixture("llama_tp2_dcp")
    rel = replace_item(checkpoint, "model.norm.weight", lambda d: saved({"w": torch.ones(3)}))
    source = tree_digest(checkpoint.parent)
    out = tmp_path / "out"
    result = cli("merge", checkpoint, out)
    assert result.exit_code == 1
    assert_failed_cleanly(result, out, f"'{rel}': 'model.norm.weight' holds dict but the metadata records")
    assert tree_digest(checkpoint.parent) == source
