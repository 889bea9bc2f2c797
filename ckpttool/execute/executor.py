"""The streaming executor: each output tensor is written in row chunks straight from positioned reads of its
pieces, never materialised whole, on several threads.

A target of shape ``(R, ...)`` is cut into chunks of whole rows of at most :data:`CHUNK_BYTES`
(:func:`~ckpttool.execute.buffers.chunks`; a computed, transformed or fused target into chunks of the rows its
arithmetic aligns). A chunk's values are assembled from positioned reads of its pieces
(:func:`~ckpttool.execute.assembly.build`) and the chunk is written with one ``pwrite`` at its offset in the output
file. Memory is a few chunks per thread, whatever the size of the tensors.

Each chunk's token is taken as it is written, and a file's digest made of them (:mod:`ckpttool.execute.digest`),
so it can be computed again from the file and its sources (:func:`file_digest`).

A checkpoint of many small tensors costs per tensor, not per byte, so the threads take chunks in batches
(:func:`_batches`, one task per few MiB instead of one per chunk), and a target that is one raw piece copied whole
in its own dtype (:func:`~ckpttool.execute.assembly.direct_offset`) skips torch: its bytes are read straight into
place in a run of such chunks, written with one ``pwrite`` (a run is at most the thread's read buffer, so the memory
is as predicted). A large chunk whose bytes lie in its pieces' files as the output holds them (a dim-0 split in the
output's dtype: each piece gives whole rows, one run of bytes) is copied file to file inside the kernel, as ``cp``
does (:mod:`ckpttool.execute.copies`). A large write has its write-back started at once (:func:`_start_writeback`).

Its public names are :func:`write_file` and :func:`file_digest`; the chunks and buffers it runs on are
:mod:`ckpttool.execute.buffers`'s, the assembly :mod:`ckpttool.execute.assembly`'s, the reads
:mod:`ckpttool.execute.reads`'s.
"""

from __future__ import annotations

import contextlib
import errno
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpttool.fast.deferred import torch
from ckpttool.execute.assembly import build, direct_offset, direct_rows
from ckpttool.execute.buffers import Chunk
from ckpttool.execute import copies as file_copies
from ckpttool.execute.copies import copied, copy_chunk, write_all
from ckpttool.execute.digest import COPIED, FromSource, crc_token, recheck, running
from ckpttool.execute.digest import WINDOW as DIGEST_WINDOW
from ckpttool.execute.reads import Reader
from ckpttool.fast.crc import crc32

__all__ = ["file_digest", "write_file"]

#: a thread's task: consecutive chunks up to this many bytes, or up to BATCH_CHUNKS chunks
BATCH_BYTES = 4 * 2**20
BATCH_CHUNKS = 256
#: a write of at least this many bytes has its write-back started at once (see :func:`_start_writeback`)
WRITEBACK_BYTES = 2**20


def file_digest(path: Path, prefix_len: int, spans: Sequence[int | FromSource]) -> str:
    """The digest :func:`write_file` returns, computed again from the file: ``spans`` says how, chunk by chunk:
    its size, or for a chunk copied file to file where from (see :func:`ckpttool.execute.digest.checks`), to
    compare it with its source. Read with ``read``, never mapped (a file cut short under a map could end the
    process)."""
    size = min(DIGEST_WINDOW, max((s if isinstance(s, int) else DIGEST_WINDOW for s in spans), default=0))
    buffers = (bytearray(size), bytearray(size if any(not isinstance(s, int) for s in spans) else 0))
    with open(path, "rb", buffering=0) as f:
        digest = running(f.read(prefix_len))
        for check in spans:
            digest.update(recheck(f, check, buffers))
    return digest.hexdigest()


def _batches(chunk_list: Sequence[Chunk]) -> list[Sequence[Chunk]]:
    """Consecutive chunks grouped into the tasks of the threads: up to :data:`BATCH_BYTES` or
    :data:`BATCH_CHUNKS` chunks each (a larger chunk is a task alone)."""
    batches: list[Sequence[Chunk]] = []
    start, nbytes = 0, 0
    for i, chunk in enumerate(chunk_list):
        if i > start and (nbytes + chunk.nbytes > BATCH_BYTES or i - start >= BATCH_CHUNKS):
            batches.append(chunk_list[start:i])
            start, nbytes = i, 0
        nbytes += chunk.nbytes
    if start < len(chunk_list):
        batches.append(chunk_list[start:])
    return batches


def write_file(
    path: Path,
    prefix: bytes,
    chunk_list: Sequence[Chunk],
    reader: Reader,
    workers: int = 1,
    on_bytes: Callable[[int], None] = lambda n: None,
    on_chunk: Callable[[Chunk, int], None] | None = None,
) -> str:
    """Write one safetensors file (header ``prefix``, then every chunk at its offset) and return its digest.

    The file is allocated at its full size first, so a full disk shows before any tensor is read. ``on_chunk``
    is given each chunk's CRC-32 as it is written, on the thread that wrote it (a DCP item's CRC-32): the one CRC
    taken of the chunk, which its digest token reuses.
    ``path`` must not exist: the file is created new and never through a link (``O_EXCL | O_NOFOLLOW``), so a
    name in the staging directory linked to a file elsewhere can never make the write land there.
    """
    size = len(prefix) + sum(c.nbytes for c in chunk_list)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # a file system without it
                    raise
        write_all(fd, prefix, 0)

        def run(batch: Sequence[Chunk]) -> Iterator[bytes]:
            """Write the batch a run at a time (a chunk copied file to file or built alone, or direct chunks read
            into place), and yield each chunk's CRC-32 once its run is written."""
            i = 0
            while i < len(batch):
                nbytes = batch[i].nbytes
                spans = copied(batch[i]) if nbytes >= file_copies.COPY_BYTES and reader.reads_files else None
                if spans is not None and on_chunk is None:
                    at = len(prefix) + batch[i].offset
                    copy_chunk(fd, at, spans, reader, copying)
                    _start_writeback(fd, at, nbytes)
                    yield COPIED
                    i += 1
                    continue
                # a run lives in the read buffer: it takes no more than predicted
                starts = [direct_offset(batch[i]) if nbytes <= reader.run_bytes else None]
                while starts[0] is not None and i + len(starts) < len(batch):
                    after = batch[i + len(starts)]
                    start = direct_offset(after) if nbytes + after.nbytes <= reader.run_bytes else None
                    if start is None or after.offset != batch[i].offset + nbytes:
                        break
                    starts.append(start)
                    nbytes += after.nbytes
                strided = (direct_rows(batch[i]) if starts[0] is None and nbytes <= reader.run_bytes and reader.reads_files
                           else None)
                if strided is not None:  # a column shard: its rows read straight into place
                    views = [reader.run_buffer(nbytes)]
                    reader.read_rows(views[0], *strided)
                    write_all(fd, views[0], len(prefix) + batch[i].offset)
                elif starts[0] is None:
                    views = [memoryview(build(batch[i], reader).reshape(-1).view(torch.uint8).numpy())]
                    write_all(fd, views[0], len(prefix) + batch[i].offset)
                else:
                    whole, views, at = reader.run_buffer(nbytes), [], 0
                    for chunk, start in zip(batch[i:i + len(starts)], starts):
                        views.append(whole[at:at + chunk.nbytes])
                        reader.read_into(views[-1], chunk.target.copies[0].piece, start)
                        at += chunk.nbytes
                    write_all(fd, whole, len(prefix) + batch[i].offset)
                if nbytes >= WRITEBACK_BYTES:
                    _start_writeback(fd, len(prefix) + batch[i].offset, nbytes)
                for chunk, view in zip(batch[i:i + len(starts)], views):
                    # the token file_digest makes: a chunk that could be copied (here built for on_chunk) is checked
                    # against its source
                    copyable = reader.reads_files and chunk.nbytes >= file_copies.COPY_BYTES and copied(chunk) is not None
                    crc = crc32(view) if on_chunk is not None or not copyable else 0
                    if on_chunk is not None:
                        on_chunk(chunk, crc)
                    yield COPIED if copyable else crc_token(crc)
                i += len(starts)

        digest = running(prefix)
        copying = threading.Lock() if workers > 1 else contextlib.nullcontext()
        batches = _batches(chunk_list)
        with ThreadPoolExecutor(max_workers=workers) if workers > 1 else contextlib.nullcontext() as pool:
            # one thread writes as it goes (progress after each run); threads take whole batches
            done = pool.map(lambda batch: list(run(batch)), batches) if pool is not None else map(run, batches)
            for batch, digests in zip(batches, done):
                for chunk, chunk_digest in zip(batch, digests):
                    digest.update(chunk_digest)
                    on_bytes(chunk.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest()


def _start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Start writing ``nbytes`` at ``offset`` to disk now, without waiting (Linux starts the write-back of dirty
    pages on ``POSIX_FADV_DONTNEED``, and keeps them cached until it is done): the disk writes while the next
    chunks are read, and the ``fsync`` at the end waits for little (0.5 s less at 2 GiB). A hint: where it is
    not supported, the ``fsync`` does it all."""
    try:
        os.posix_fadvise(fd, offset, nbytes, os.POSIX_FADV_DONTNEED)
    except (OSError, AttributeError):  # no posix_fadvise (macOS), or a file system that refuses it
        pass
