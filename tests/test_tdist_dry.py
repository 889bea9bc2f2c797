"""Dry runs of Megatron-Core ``torch_dist`` checkpoints leave the items unlocated, as DCP's do (issue 31: 92k items).

``merge --dry-run`` and ``audit --no-data`` no longer locate each item's data record; they screen each item for
Transformer Engine's tensors from its first bytes instead (:func:`ckpttool.io.torch_zip.read_first_pickle`): a
``data.pkl`` that pickles one plain tensor of the piece's dtype and shape is proven plain, and any other item is
located and scanned as the run that reads it does. So a dry run plans what the located run plans, byte for byte,
and refuses a TE item with the message the run that reads gives.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import shutil
import sys
import types
import zipfile
import zlib

import pytest
import torch

from ckpttool.commands import merge as merge_module
from ckpttool.io import torch_save
from ckpttool.io.torch_zip import FIRST, read_first_pickle
from ckpttool.layout.layout import RAW
from ckpttool.readers import dcp, read_layout
from conftest import FIXTURES, assert_failed_cleanly, tree_digest
from test_dcp_fast import replace_item, saved

pytestmark = pytest.mark.usefixtures("describe_inline")  # configs described here, not in a subprocess each
KEY = "decoder.layers.self_attention.linear_proj.weight"
TE_MODULE = "transformer_engine.pytorch.tensor.float8_tensor"
TE_FUNCTION = "_make_float8_tensor_in_reduce_ex"


@pytest.fixture
def located_count(monkeypatch):
    """How many items were located (their zip records read) by the DCP reader or the torch_dist screen."""
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs.get("item"))
        return real(*args, **kwargs)

    real = torch_save.locate
    monkeypatch.setattr(torch_save, "locate", counted)
    monkeypatch.setattr(dcp, "locate", counted)
    return calls


def _located_dry_runs(monkeypatch):
    """Dry runs that locate every item, as before deferral."""
    monkeypatch.setattr(merge_module, "locating_deferred", lambda deferred=True: contextlib.nullcontext())
    monkeypatch.setattr(importlib.import_module("ckpttool.audit"), "locating_deferred", lambda deferred=True: contextlib.nullcontext())


@pytest.mark.parametrize("name", ["megatron_tp2_padvocab", "megatron_qwen2moe_pp2_ep2"])
def test_a_dry_run_locates_no_plain_item_and_prints_what_the_located_run_prints(cli, monkeypatch, located_count,
                                                                                 name):
    src, config = FIXTURES / name / "torch_dist", FIXTURES / name / "config.json"
    commands = (("merge", src, "--dry-run", "--json", "--config", config),
                ("audit", src, "--no-data", "--json", "--config", config))
    deferred = [cli(*command) for command in commands]
    assert [r.exit_code for r in deferred] == [0, 0], [r.output for r in deferred]
    assert located_count == []
    _located_dry_runs(monkeypatch)
    located = [cli(*command) for command in commands]
    assert located_count  # every item, this time
    assert [r.stdout for r in deferred] == [r.stdout for r in located]  # byte for byte


def test_the_deferred_layout_holds_each_items_start_and_the_real_run_locates(located_count):
    src = FIXTURES / "megatron_tp2_padvocab" / "torch_dist"
    with dcp.locating_deferred():
        deferred = read_layout(src)
    assert located_count == []
    located = read_layout(src)
    assert len(located_count) == sum(len(t.pieces) for t in located.tensors.values())
    assert deferred.tensors.keys() == located.tensors.keys()
    for name, tensor in located.tensors.items():
        for real, dry in zip(tensor.pieces, deferred.tensors[name].pieces, strict=True):
            assert (dry.file, dry.key, dry.box, dry.dtype, dry.encoding) == (real.file, real.key, real.box, real.dtype, RAW)
            assert dry.file.startswith("iter_0000010/")
            assert dry.byte_offset < real.byte_offset and dry.byte_length == real.byte_length


def _te_item(monkeypatch, shape: tuple[int, ...], padding: int = 0) -> bytes:
    """A ``torch.save`` archive of a stand-in for TE 2.16's Float8Tensor (its pickle asks for TE's function), with
    ``padding`` characters more in its pickle; TE's module is gone from ``sys.modules`` afterwards."""
    module = types.ModuleType(TE_MODULE)

    def make(*args):
        raise AssertionError("TE's code ran")

    make.__module__, make.__qualname__, make.__name__ = TE_MODULE, TE_FUNCTION, TE_FUNCTION
    setattr(module, TE_FUNCTION, make)

    class Float8Tensor:
        def __reduce_ex__(self, protocol):
            return make, (torch.zeros(shape, dtype=torch.uint8), torch.tensor([0.01]), "x" * padding)

    parts = TE_MODULE.split(".")
    names = [".".join(parts[:n]) for n in range(1, len(parts) + 1)]  # the pickler imports each package on the way
    for name in names:
        monkeypatch.setitem(sys.modules, name, module if name == TE_MODULE else types.ModuleType(name))
    try:
        return saved(Float8Tensor())
    finally:
        for name in names:
            monkeypatch.delitem(sys.modules, name)


@pytest.mark.parametrize("padding", [0, 2 * FIRST], ids=["a-short-pickle", "a-pickle-past-the-head"])
def test_a_te_item_is_refused_by_the_dry_run_with_the_reading_runs_message(cli, tmp_path, monkeypatch, padding):
    src = tmp_path / "torch_dist"
    shutil.copytree(FIXTURES / "megatron_fp8_tp2" / "torch_dist", src)
    iteration = src / "iter_0000010"
    file = replace_item(iteration, KEY, lambda old: _te_item(monkeypatch, torch_save.scan(
        io.BytesIO(old), label="old").shape, padding))
    before = tree_digest(src)
    config = FIXTURES / "megatron_fp8_tp2" / "config.json"
    want = (f"'iter_0000010/{file}': '{KEY}' is a Transformer Engine quantized tensor (its pickle asks for "
            f"'{TE_MODULE}.{TE_FUNCTION}'): torch_dist saved TE's own class")
    out = tmp_path / "out"
    dry = cli("merge", src, "--dry-run", "--json", "--config", config)
    audit = cli("audit", src, "--no-data", "--config", config)
    real = cli("merge", src, out, "--config", config)
    assert_failed_cleanly(real, out, want, "ckpttool runs none of TE's code (nothing was executed)")
    for result in (dry, audit):
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert result.stderr == real.stderr
    printed = json.loads(dry.stdout)  # --json: the error as its one document
    assert printed["status"] == "error" and printed["error"].startswith(want) and printed["error"] in real.stderr
    assert tree_digest(src) == before


def _reordered(archive: bytes, first: str) -> bytes:
    """``archive`` written again by Python's zipfile (sizes in each local header) with the record ending in ``first``
    first."""
    source, out = zipfile.ZipFile(io.BytesIO(archive)), io.BytesIO()
    infos = sorted(source.infolist(), key=lambda info: not info.filename.endswith(first))
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as written:
        for info in infos:
            written.writestr(info.filename, source.read(info))
    return out.getvalue()


def test_a_plain_item_its_head_cannot_vouch_for_is_located_and_planned_as_before(cli, tmp_path, monkeypatch,
                                                                                 located_count):
    src = tmp_path / "torch_dist"
    shutil.copytree(FIXTURES / "megatron_fp8_tp2" / "torch_dist", src)
    replace_item(src / "iter_0000010", KEY, lambda old: _reordered(old, "/version"))
    config = FIXTURES / "megatron_fp8_tp2" / "config.json"
    dry = cli("merge", src, "--dry-run", "--json", "--config", config)
    assert dry.exit_code == 0, dry.output
    assert located_count == [KEY]  # that item alone
    _located_dry_runs(monkeypatch)
    assert cli("merge", src, "--dry-run", "--json", "--config", config).stdout == dry.stdout


def test_the_first_pickle_of_an_archive_from_its_head_alone():
    archive = saved(torch.arange(6, dtype=torch.bfloat16).reshape(2, 3))
    pickled = zipfile.ZipFile(io.BytesIO(archive)).read("archive/data.pkl")
    padded = b"\0" * 100 + archive  # an item in the middle of its file
    assert read_first_pickle(io.BytesIO(padded), 100, len(archive)) == pickled  # torch's: sizes in a data descriptor
    rezipped = _reordered(archive, "/data.pkl")
    assert read_first_pickle(io.BytesIO(rezipped), 0, len(rezipped)) == pickled  # zipfile's: sizes in the header
    assert read_first_pickle(io.BytesIO(archive), 0, 20) == "too short to be a zip archive"
    assert read_first_pickle(io.BytesIO(archive), 0, 40) == "its first record is not data.pkl"  # its name cut
    assert read_first_pickle(io.BytesIO(archive), 0, 200) == "no data descriptor of its data.pkl within its first 200 bytes"
    assert read_first_pickle(io.BytesIO(rezipped), 0, 100) == "its data.pkl is not within its first 100 bytes"
    at = archive.index(pickled)
    broken = archive[:at] + bytes([archive[at] ^ 1]) + archive[at + 1:]
    assert zlib.crc32(broken[at: at + len(pickled)]) != zlib.crc32(pickled)
    assert read_first_pickle(io.BytesIO(broken), 0, len(broken)) == (
        f"no data descriptor of its data.pkl within its first {FIRST} bytes")  # none whose CRC-32 fits
    reordered = _reordered(archive, "/version")
    assert read_first_pickle(io.BytesIO(reordered), 0, len(reordered)) == "its first record is not data.pkl"
    assert read_first_pickle(io.BytesIO(b"\0" * 2000), 0, 2000) == "its first record is not data.pkl"

