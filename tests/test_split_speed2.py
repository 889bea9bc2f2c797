"""How ``split --to dcp`` reads its source (issue 31: split at disk speed, the same bytes).

- A split's reader tells the system to read no more of a source file than asked (``POSIX_FADV_RANDOM``): each
  rank's file takes a slice of every tensor, so the read-ahead past a slice read the slices of ranks written
  later, long before their turn; on a busy page cache they were dropped and read from the disk again (8 GiB,
  fsdp 4 x tp 2: 1.17 bytes read per byte written). A merge's reader keeps the read-ahead. The hint is only a
  hint: where it is refused, the split writes the same bytes.
- :meth:`Reader.read_rows` (a column shard's rows, straight into place) over several ``preadv`` calls, with and
  without a gap between the runs.
"""

from __future__ import annotations

import math
import os
import struct
from collections import Counter
from pathlib import Path

import pytest

from ckpttool.execute import reads
from ckpttool.execute.reads import Reader
from ckpttool.layout.layout import Box, Piece
from ckpttool.plan.plan import Target
from ckpttool.plan.tiling import Copy
from ckpttool.writers import dcp

#: name, shape, the dim two ranks cut (None: whole, on rank 0); float32 values 0, 1, 2... over all three
TENSORS = (("rows", (64, 8), 0), ("cols", (6, 10), 1), ("small", (5, 3), None))


def values(start: int, count: int) -> bytes:
    return struct.pack(f"<{count}f", *range(start, start + count))


@pytest.fixture(scope="module")
def source(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("source")
    total = sum(math.prod(shape) for _, shape, _ in TENSORS)
    (root / "src.bin").write_bytes(b"head" + values(0, total))
    return root


def lay_out() -> tuple[dcp.DcpFile, ...]:
    """Two ranks' files of :data:`TENSORS`, read from ``src.bin`` (after its 4-byte head)."""
    items: list[list] = [[], []]
    offset = 4
    for name, shape, dim in TENSORS:
        piece = Piece("src.bin", name, Box.whole(shape), "F32", byte_offset=offset)
        offset += math.prod(shape) * 4
        for rank in range(2 if dim is not None else 1):
            sizes, offsets = list(shape), [0] * len(shape)
            if dim is not None:
                sizes[dim] //= 2
                offsets[dim] = rank * sizes[dim]
            box = Box(tuple(offsets), tuple(sizes))
            target = Target(name, box.sizes, "F32", "F32", (Copy(piece, box, Box.whole(box.sizes)),), ("src.bin",))
            items[rank].append((name, shape, box, target))
    return dcp.lay_out(items)


def expected(item: dcp.Item) -> bytes:
    """The item's elements: the values of its box of the global tensor (see :func:`values`)."""
    start = 0
    for name, shape, _ in TENSORS:
        if name == item.fqn:
            break
        start += math.prod(shape)
    (r0, c0), (rows, cols) = item.box.offsets, item.box.sizes
    return b"".join(values(start + (r0 + r) * item.global_shape[1] + c0, cols) for r in range(rows))


def advice(monkeypatch, refuse: type[Exception] | None = None) -> list[tuple[int, int]]:
    """Record every ``posix_fadvise`` as ``(inode of the file, advice)``; with ``refuse``, refuse each with it."""
    calls: list[tuple[int, int]] = []
    real = os.posix_fadvise

    def recorded(fd: int, offset: int, length: int, what: int) -> None:
        calls.append((os.fstat(fd).st_ino, what))
        if refuse is not None:
            raise refuse(22, "Invalid argument")
        real(fd, offset, length, what)

    monkeypatch.setattr(os, "posix_fadvise", recorded)
    return calls


def assert_written(out: Path, files: tuple[dcp.DcpFile, ...]) -> None:
    for f in files:
        data = (out / f.name).read_bytes()
        assert len(data) == f.nbytes
        for item in f.items:
            assert data[item.data_offset:item.data_offset + item.archive.nbytes] == expected(item), item.fqn


needs_fadvise = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="no posix_fadvise on this system")


@needs_fadvise
def test_a_split_reads_its_source_without_readahead(source, tmp_path, monkeypatch):
    calls = advice(monkeypatch)
    files = lay_out()
    out = tmp_path / "out"
    out.mkdir()
    dcp.write_files(source, files, out, workers=2)
    random = [inode for inode, what in calls if what == os.POSIX_FADV_RANDOM]
    assert random == [(source / "src.bin").stat().st_ino]  # once, when the source is opened; never an output
    assert_written(out, files)


@needs_fadvise
def test_a_merge_reader_keeps_the_readahead(source, monkeypatch):
    calls = advice(monkeypatch)
    reader = Reader(source, Counter(), {"read": 64})
    piece = Piece("src.bin", "small", Box.whole((5, 3)), "F32", byte_offset=4)
    view = reader.run_buffer(8)
    reader.read_into(view, piece, 4)
    reader.close()
    assert bytes(view) == values(0, 2)
    assert calls == []


@pytest.mark.parametrize("refuse", [OSError, AttributeError], ids=["refused", "absent"])
def test_where_the_hint_is_refused_the_split_writes_the_same_bytes(source, tmp_path, monkeypatch, refuse):
    if refuse is AttributeError:
        monkeypatch.delattr(os, "posix_fadvise", raising=False)
    else:
        advice(monkeypatch, refuse=OSError)
    files = lay_out()
    out = tmp_path / "out"
    out.mkdir()
    dcp.write_files(source, files, out, workers=1)
    assert_written(out, files)


@pytest.mark.parametrize("run, stride", [(2, 6), (4, 4)], ids=["gaps", "no gap"])
@pytest.mark.parametrize("rows", [1, 2, 2 * reads._ROWS_PER_READ + 3], ids=str)
def test_read_rows_reads_every_run_in_place_over_several_reads(tmp_path, rows, run, stride):
    data = bytes(i % 251 for i in range(7 + rows * stride + 1))  # a byte after the last row: runs start at byte 1
    (tmp_path / "f.bin").write_bytes(data)
    piece = Piece("f.bin", "w", Box.whole((rows, stride)), "U8", byte_offset=7)
    reader = Reader(tmp_path, Counter(), {"read": rows * run})
    view = reader.run_buffer(rows * run)
    reader.read_rows(view, piece, 8, run, stride)  # from the second byte of each row
    reader.close()
    assert bytes(view) == b"".join(data[8 + r * stride:8 + r * stride + run] for r in range(rows))
