"""The fast paths of ``split --to dcp`` (issue 31) give the bytes the general path gives, and step aside when
their precondition fails.

- :mod:`ckpttool.fast.crc`: libdeflate's CRC-32 where the system has it (for large writable buffers), zlib's
  otherwise: equal values on every kind of buffer, and a DCP written with either is the same, byte for byte, and
  reads back in torch.
"""

from __future__ import annotations

import math
import os
import zlib
from pathlib import Path

import numpy
import pytest
import torch

from ckpttool.fast import crc
from ckpttool.layout.layout import Box, Piece
from ckpttool.plan.tiling import Copy
from ckpttool.plan.plan import Target
from ckpttool.writers import dcp
from conftest import dcp_model_tensors

needs_libdeflate = pytest.mark.skipif(crc.backend() != "libdeflate", reason="libdeflate is not installed here")


def files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


DATA = os.urandom(3 * crc.SMALL + 5)
BUFFERS = {
    "bytes": DATA,
    "bytearray": bytearray(DATA),
    "memoryview at an odd offset": memoryview(bytearray(DATA))[3:],
    "small (below SMALL)": DATA[:100],
    "empty": b"",
    "2-d uint16 view": memoryview(numpy.frombuffer(bytearray(DATA[:-5]), dtype=numpy.uint16).reshape(3, -1)),
    "read-only view": memoryview(DATA)[3:],
}


@pytest.mark.parametrize("data", BUFFERS.values(), ids=BUFFERS.keys())
def test_crc32_is_zlibs_on_every_kind_of_buffer(data):
    want = zlib.crc32(bytes(memoryview(data).tobytes()))
    assert crc.crc32(data) == want
    assert crc.crc32(data, 0x1234) == zlib.crc32(memoryview(data).tobytes(), 0x1234)  # a running CRC goes on


@needs_libdeflate
def test_libdeflate_takes_large_writable_buffers_and_zlib_the_rest(monkeypatch):
    calls = []
    real = crc._function()

    def counted(value, address, length):
        calls.append(length)
        return real(value, address, length)

    monkeypatch.setattr(crc, "_libdeflate", counted)
    for name, data in BUFFERS.items():
        crc.crc32(data)
    # bytes and read-only views go to zlib (ctypes takes writable buffers only), small ones too
    assert calls == [len(DATA), len(DATA) - 3, len(DATA) - 5]  # the bytearray, the offset view, the 2-d view


def test_a_buffer_zlib_refuses_is_refused_alike():
    strided = memoryview(numpy.frombuffer(DATA[:-5], dtype=numpy.uint8).reshape(3, -1)[:, ::2])
    with pytest.raises(BufferError):
        zlib.crc32(strided)
    with pytest.raises(BufferError):
        crc.crc32(strided)


def test_crc32_runs_on_across_calls():
    assert crc.crc32(DATA[crc.SMALL:], crc.crc32(DATA[:crc.SMALL])) == zlib.crc32(DATA)


def test_without_libdeflate_zlib_computes_it(monkeypatch):
    assert crc._load(("libckpttool-no-such-library.so",)) is None
    monkeypatch.setenv("CKPTTOOL_CRC", "zlib")
    assert crc._load() is None
    monkeypatch.setattr(crc, "_libdeflate", None)
    assert crc.backend() == "zlib"
    assert crc.crc32(DATA) == zlib.crc32(DATA)


def write_dcp(root: Path, out: Path, workers: int = 1) -> tuple[dcp.DcpFile, ...]:
    """A two-rank DCP of three float32 tensors read from ``root/src.bin`` (torch.arange data, made by
    :func:`source`): ``rows`` cut on dim 0 (each rank's box one run of the source's bytes, 1 MiB and more),
    ``cols`` cut on dim 1 (built row by row), ``small`` whole on rank 0."""
    out.mkdir()
    items: list[list] = [[], []]
    offset = 0
    for name, shape, dim in TENSORS:
        piece = Piece("src.bin", name, Box.whole(shape), "F32", byte_offset=offset)
        offset += math.prod(shape) * 4
        ranks = 2 if dim is not None else 1
        for rank in range(ranks):
            sizes = list(shape)
            offsets = [0] * len(shape)
            if dim is not None:
                sizes[dim] //= 2
                offsets[dim] = rank * sizes[dim]
            box = Box(tuple(offsets), tuple(sizes))
            target = Target(name, box.sizes, "F32", "F32", (Copy(piece, box, Box.whole(box.sizes)),), ("src.bin",))
            items[rank].append((name, shape, box, target))
    files = dcp.lay_out(items)
    dcp.write_files(root, files, out, workers=workers)
    dcp.write_metadata(files, out)
    return files


TENSORS = (("rows", (2048, 256), 0), ("cols", (64, 96), 1), ("small", (5, 3), None))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    root = tmp_path_factory.mktemp("source")
    tensors, start = {}, 0
    for name, shape, _ in TENSORS:
        tensors[name] = torch.arange(start, start + math.prod(shape), dtype=torch.float32).reshape(shape)
        start += math.prod(shape)
    (root / "src.bin").write_bytes(b"".join(t.numpy().tobytes() for t in tensors.values()))
    return root, tensors


def assert_reads_back(out: Path, tensors: dict[str, torch.Tensor], scratch: Path) -> None:
    loaded = dcp_model_tensors(out, scratch)
    assert sorted(loaded) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(loaded[name], tensor), name


@needs_libdeflate
def test_a_dcp_is_the_same_bytes_with_either_crc(source, tmp_path, monkeypatch):
    root, tensors = source
    monkeypatch.setattr(crc, "SMALL", 0)  # every chunk through libdeflate
    write_dcp(root, tmp_path / "fast")
    monkeypatch.setattr(crc, "_libdeflate", None)
    write_dcp(root, tmp_path / "zlib")
    assert files(tmp_path / "fast") == files(tmp_path / "zlib")
    assert_reads_back(tmp_path / "fast", tensors, tmp_path)

