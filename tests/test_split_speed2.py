"""How ``split --to dcp`` reads its source (issue 31: split at disk speed, the same bytes).

- A split's reader tells the system to read no more of a source file than asked (``POSIX_FADV_RANDOM``): each
  rank's file takes a slice of every tensor, so the read-ahead past a slice read the slices of ranks written
  later, long before their turn; on a busy page cache they were dropped and read from the disk again (8 GiB,
  fsdp 4 x tp 2: 1.05-1.17 bytes read per byte written). A merge's reader keeps the read-ahead. The hint is only a
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
from ckpttool.writers import dcp
import test_split_speed
from test_split_speed import TENSORS, write_dcp

source = test_split_speed.source  # the fixture: src.bin, float32 values 0, 1, 2... over TENSORS


def values(start: int, count: int) -> bytes:
    """float32 ``start, start + 1, ...``: the values of ``source``'s tensors, one after another."""
    return struct.pack(f"<{count}f", *range(start, start + count))


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
    root, _ = source
    calls = advice(monkeypatch)
    files = write_dcp(root, tmp_path / "out", workers=2)
    random = [inode for inode, what in calls if what == os.POSIX_FADV_RANDOM]
    assert random == [(root / "src.bin").stat().st_ino]  # once, when the source is opened; never an output
    assert_written(tmp_path / "out", files)


@needs_fadvise
def test_a_merge_reader_keeps_the_readahead(source, monkeypatch):
    calls = advice(monkeypatch)
    reader = Reader(source[0], Counter(), {"read": 64})
    piece = Piece("src.bin", "rows", Box.whole((2048, 256)), "F32")
    view = reader.run_buffer(8)
    reader.read_into(view, piece, 0)
    reader.close()
    assert bytes(view) == values(0, 2)
    assert calls == []


@pytest.mark.parametrize("refuse", [OSError, AttributeError], ids=["refused", "absent"])
def test_where_the_hint_is_refused_the_split_writes_the_same_bytes(source, tmp_path, monkeypatch, refuse):
    if refuse is AttributeError:
        monkeypatch.delattr(os, "posix_fadvise", raising=False)
    else:
        advice(monkeypatch, refuse=OSError)
    files = write_dcp(source[0], tmp_path / "out")
    assert_written(tmp_path / "out", files)


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
