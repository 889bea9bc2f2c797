"""Chunks copied file to file: a large chunk whose bytes lie in its pieces' files as the output holds them is
copied inside the kernel (``copy_file_range``, as ``cp`` does), never passing through a buffer of ckpttool.

A dim-0 split in the output's dtype is the common case: each piece meeting a chunk gives whole rows of it, one
run of bytes in the piece's file and one in the chunk. Such a chunk is not hashed as it is written (it is never
seen); its bytes are compared with their source when a file is checked again (see :mod:`ckpttool.execute.digest`).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from contextlib import AbstractContextManager

from ckpttool.io.dtypes import itemsize
from ckpttool.execute.buffers import Chunk, chunk_rows
from ckpttool.layout.layout import RAW, Piece, c_strides
from ckpttool.execute.reads import Reader
from ckpttool.layout.regions import map_region

__all__ = ["COPY_BYTES", "Span", "copied", "copy_chunk", "write_all"]

#: a chunk of at least this many bytes is copied file to file when it can be (see :func:`copied`)
COPY_BYTES = 2**20

#: a run of a chunk's bytes in a piece's file: the piece, where the run starts in its file, where it starts in
#: the chunk, and its length in bytes
Span = tuple[Piece, int, int, int]


def copied(chunk: Chunk) -> tuple[Span, ...] | None:
    """How a chunk of at least :data:`COPY_BYTES` is copied from its pieces' files: one :data:`Span` per copy
    meeting its rows, in no particular order; None when it is smaller, or some part of it must be built (a
    conversion, a transform, bytes spread over several runs on either side, rows no copy fills, a piece of no raw bytes)."""
    target = chunk.target
    if (chunk.nbytes < COPY_BYTES or target.dequant is not None or target.transform is not None or target.lora
            or target.dtype != target.source_dtype or not target.shape):
        return None
    rows, size = chunk_rows(chunk), itemsize(target.dtype)
    out_strides = c_strides(rows.sizes)
    spans: list[Span] = []
    covered = 0
    for copy in target.copies:
        part = copy.dst.intersect(rows)
        if part is None or not part.numel:
            continue
        piece = copy.piece
        if piece.encoding != RAW or piece.dtype != target.dtype:
            return None
        box = map_region(copy.src, copy.dst, part)
        assert box is not None
        src_first, src_extent = _extent(box.offsets, box.sizes, c_strides(piece.box.sizes))
        dst_first, dst_extent = _extent([o - r for o, r in zip(part.offsets, rows.offsets)], part.sizes, out_strides)
        if src_extent != part.numel or dst_extent != part.numel:  # not one run of bytes on both sides
            return None
        spans.append((piece, piece.byte_offset + src_first * size, dst_first * size, part.numel * size))
        covered += part.numel
    return tuple(spans) if covered == rows.numel else None


def _extent(offsets: Sequence[int], sizes: Sequence[int], strides: Sequence[int]) -> tuple[int, int]:
    """The first element of a box of a C-order tensor, and how many elements lie from its first to its last."""
    first = sum(o * st for o, st in zip(offsets, strides))
    return first, sum((n - 1) * st for n, st in zip(sizes, strides)) + 1


def copy_chunk(fd: int, at: int, spans: Sequence[Span], reader: Reader, lock: AbstractContextManager) -> None:
    """Copy a chunk's ``spans`` to offset ``at`` of ``fd`` file to file, inside the kernel; what it cannot copy so
    (another file system, a source that ends, an error) goes through the thread's read buffer, whose read names
    a truncated or unreadable source and whose write an output error.

    A write holds the file's lock in the kernel, and a thread waiting for it spins on the other CPU (a fifth of
    the CPU time of a 2 GiB merge on 2 threads): so the threads copy into one file under ``lock``, one at a time,
    each having its sources read ahead first (the disk reads while the other copies)."""
    for piece, start, _, nbytes in spans:
        reader.read_ahead(piece, start, nbytes)
    with lock:
        for piece, start, rel, nbytes in spans:
            _copy_span(fd, at + rel, piece, start, nbytes, reader)


def _copy_span(fd: int, at: int, piece: Piece, start: int, nbytes: int, reader: Reader) -> None:
    done = reader.copy_out(piece, start, fd, at, nbytes)
    while done < nbytes:
        view = reader.run_buffer(min(nbytes - done, max(reader.run_bytes, 2**20)))
        reader.read_into(view, piece, start + done)
        write_all(fd, view, at + done)
        done += len(view)


def write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    """Write all of ``data`` at ``offset`` of ``fd``."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
