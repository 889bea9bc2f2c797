"""The streaming executor: each output tensor is written in row chunks straight from positioned reads of its
pieces, never materialised whole, on several threads.

A target of shape ``(R, ...)`` is cut into chunks of whole rows of at most :data:`CHUNK_BYTES`. For a chunk,
every copy of the plan that meets those rows gives a region of its piece; a region is read with one ``pread``
of the smallest byte range that holds it (a dim-0 piece gives whole rows: one run; a dim-1 piece gives the
chunk's rows of that piece: again one run), laid into the chunk as a strided view, and the chunk is written
with one ``pwrite`` at its offset in the output file. A chunk covered by one contiguous region is written from
the read buffer itself. Memory is a few chunks per thread, whatever the size of the tensors.

A computed target (:class:`~ckpttool.plan.plan.Dequantize`: dequantized, or FP8-quantized in whole block rows)
is not copied: the source and scale rows its codec (:mod:`ckpttool.quant.codecs`) names are gathered the same way,
and the codec writes the chunk's values, with its temporaries on the thread's buffers too. A transformed target
(:mod:`ckpttool.plan.transforms`: a row permutation within heads, an interleave, a transpose) is cut into chunks of
target rows its transform aligns (whole blocks of a dim-0 permutation; the whole tensor only when dim 0 is
transposed): a chunk gathers the pre rows the transform names, as any rows are gathered, and the transform writes
the chunk from them (a view and one copy) on the thread's buffers; such a chunk is never copied file to file.

Each chunk's token is taken as it is written, and a file's digest made of them (:mod:`ckpttool.execute.digest`),
so it can be computed again from the file and its sources (:func:`file_digest`).

Regions are read by a :class:`~ckpttool.execute.reads.Reader` and laid into a chunk with numpy's copy on the
worker's own thread (:func:`_place`). A checkpoint of many small tensors costs per tensor, not per byte, so the
threads take chunks in batches (:func:`_batches`, one task per few MiB instead of one per chunk), and a target
that is one raw piece copied whole in its own dtype (:func:`direct_offset`) skips torch: its bytes are read straight
into place in a run of such chunks, written with one ``pwrite`` (a run is at most the thread's read buffer, so
the memory is as predicted). A large chunk whose bytes lie in its pieces' files as the output holds them (a
dim-0 split in the output's dtype: each piece gives whole rows, one run of bytes) is copied file to file inside
the kernel, as ``cp`` does (:mod:`ckpttool.execute.copies`). A large write has its write-back started at once
(:func:`_start_writeback`).
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import threading
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import itemsize
from ckpttool.errors import SourceError
from ckpttool.quant.codecs import codec
from ckpttool.quant.decode import BadScale
from ckpttool.execute.buffers import (Chunk, buffer_sizes, chunk_inputs, chunk_rows, chunk_targets, predict_peak_bytes,
                                      row_box, transformed_rows)
from ckpttool.execute import copies as file_copies
from ckpttool.execute.copies import copied, copy_chunk, write_all
from ckpttool.execute.digest import COPIED, FromSource, crc_token, recheck, running
from ckpttool.execute.digest import WINDOW as DIGEST_WINDOW
from ckpttool.layout.layout import RAW, Box, Piece, Shape
from ckpttool.plan.plan import Copy, Target
from ckpttool.execute.reads import Reader
from ckpttool.layout.regions import dim_map, map_region
from ckpttool.plan.lora import ROW_ALIGN, fuse_rows

__all__ = ["CHUNK_BYTES", "Chunk", "Reader", "buffer_sizes", "build", "chunks", "file_digest", "piece_uses",
           "predict_peak_bytes", "write_file"]

#: the most output bytes one chunk holds (a chunk is at least one row)
CHUNK_BYTES = 32 * 2**20
#: a thread's task: consecutive chunks up to this many bytes, or up to BATCH_CHUNKS chunks
BATCH_BYTES = 4 * 2**20
BATCH_CHUNKS = 256
#: a write of at least this many bytes has its write-back started at once (see :func:`_start_writeback`)
WRITEBACK_BYTES = 2**20


def chunks(target: Target, offset: int, chunk_bytes: int = CHUNK_BYTES, rows: int | None = None) -> list[Chunk]:
    """The chunks of ``target`` (written at ``offset``), in file order: ``rows`` rows each, or as many as
    ``chunk_bytes`` holds."""
    shape = target.shape or (1,)
    row = math.prod(shape[1:]) * itemsize(target.dtype)
    if rows is None and target.dequant is None and not target.lora and 0 < shape[0] * row <= chunk_bytes:  # most tensors: one chunk
        return [Chunk(target, 0, shape[0], offset, shape[0] * row)]
    per = rows or (max(1, chunk_bytes // _compute_row_bytes(target, row)) if row else max(1, shape[0]))
    if target.dequant is not None:  # a computed target: chunks of whole rows of blocks where it needs them
        per = codec(target.dequant.method, target.dequant.params).align(per)
    if target.transform is not None and target.dequant is not None:  # quantized after it (rows of its encoder's)
        per = target.shape[0] if target.transform.moves_rows() else -(-per // (g := _granule(target))) * g
    elif target.transform is not None:  # whole blocks of a row permutation; everything when dim 0 is transposed
        per = max(1, target.transform.align(target.shape, per))  # (0 for a target of no rows: a step of 1)
    if target.lora and not all(d.stacked for d in target.lora):  # whole blocks of ROW_ALIGN rows: the matrix
        per = -(-per // ROW_ALIGN) * ROW_ALIGN  # kernel's row blocks, as in PEFT's whole product (experts stacked on
        # disk are rows of their own: each expert's product is one batch of PEFT's einsum)
    return [
        Chunk(target, a, min(a + per, shape[0]), offset + a * row, (min(a + per, shape[0]) - a) * row)
        for a in range(0, shape[0], per)
    ]


def _granule(target: Target) -> int:
    """The fewest rows of a target quantized after its transform that a chunk may hold: whole rows of its encoder
    (FP8 block rows) whose stored rows are whole blocks of the transform (a permutation's period)."""
    assert target.dequant is not None and target.transform is not None
    compute = codec(target.dequant.method, target.dequant.params)
    period, step = max(1, target.transform.align(target.dequant.stored, 1)), max(1, compute.align(1))
    rows = step
    while rows < target.shape[0]:
        first, last = compute.stored_rows(0, rows)
        if (last - first) % period == 0:
            break
        rows += step
    return rows


def _compute_row_bytes(target: Target, row: int) -> int:
    """Bytes one row of ``target`` takes at its largest: an encoder's float32 copy of its source rows, or a fused
    target's float32 product, delta and sum (:mod:`ckpttool.plan.lora`)."""
    if target.lora:
        return max(row, 8 * math.prod(target.shape[1:]))
    if target.dequant is None or not target.dequant.stored:
        return row
    a, b = codec(target.dequant.method, target.dequant.params).stored_rows(0, 1)
    return max(row, (b - a) * math.prod(target.dequant.stored[1:]) * 4)


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


def piece_uses(chunk_list: Sequence[Chunk]) -> Counter[Piece]:
    """How many chunks read each piece of ``torch.save`` bytes (kept loaded until its last one); pieces of raw
    bytes, read in place, are not counted."""
    uses: Counter[Piece] = Counter()
    if all(c.piece.encoding == RAW for t in chunk_targets(chunk_list) for c in _every_copy(t)):
        return uses  # the common case, told in one pass over the targets: every piece is raw bytes
    archived: dict[int, bool] = {}  # by the target's id: hashing a target hashes all its copies
    for chunk in chunk_list:
        target = chunk.target
        found = archived.get(id(target))
        if found is None:
            every = _every_copy(target)
            found = archived[id(target)] = any(c.piece.encoding != RAW for c in every)
        if found:
            for copies, rows in chunk_inputs(chunk):
                uses.update(c.piece for c in copies if c.piece.encoding != RAW and c.dst.intersect(rows) is not None)
    return uses


def _every_copy(target: Target) -> tuple[Copy, ...]:
    if target.scale is None and not target.aux:
        return target.copies
    return (*target.copies, *(target.scale.copies if target.scale is not None else ()),
            *(c for aux in target.aux for c in aux.copies))


def build(chunk: Chunk, reader: Reader, *, check_scales: bool = True) -> torch.Tensor:
    """The chunk's elements in the output dtype, C order (a view of the read buffer when one region fills it).

    Raises:
        SourceError: with ``check_scales`` (what is written: a merge, a split), a dequantized chunk whose scale
            rows hold a NaN or infinite scale, which would make its block NaN or infinite; the audit passes False
            to count such values in its findings instead.
    """
    target = chunk.target
    if target.dequant is not None:
        return _dequantize(chunk, reader, check_scales)
    if target.transform is not None:  # the pre rows it names, gathered as any rows are, then its map
        pre = _gather(target.copies, transformed_rows(chunk), target.source_dtype, reader, "chunk")
        out = target.transform.apply(pre, target.shape, chunk.start, chunk.stop, target.source_dtype, reader.scratch)
    else:
        out = _gather(target.copies, chunk_rows(chunk), target.source_dtype, reader, "chunk", view=not target.lora)
    if target.lora:  # W + scale * B @ A on these rows (the thread's own copy), as PEFT's merge adds it, before any cast
        out = fuse_rows(out, target.lora, chunk.start, chunk.stop, reader.scratch)
    if target.dtype != target.source_dtype:
        out = reader.scratch("cast", tuple(out.shape), target.dtype).copy_(out)
    return out


def _gather(copies: Sequence[Copy], rows: Box, dtype: str, reader: Reader, buffer: str, view: bool = True) -> torch.Tensor:
    """``rows`` of the tensor ``copies`` fill, on the thread's buffer ``buffer`` (or, with ``view``, a view of the
    read buffer when one region fills them)."""
    parts = []
    for copy in copies:
        part = copy.dst.intersect(rows)
        if part is not None and part.numel:
            parts.append((copy, part))
    if len(parts) == 1 and parts[0][1] == rows:
        copy, part = parts[0]
        region = reader.region(copy.piece, map_region(copy.src, copy.dst, part), part.sizes, dim_map(copy.src, copy.dst))
        if view and region.is_contiguous():
            return region
        return _place(reader.scratch(buffer, rows.sizes, dtype), region)
    out = reader.scratch(buffer, rows.sizes, dtype)
    if sum(part.numel for _, part in parts) != rows.numel:  # rows no copy fills are zeros (a split's vocab padding)
        out.zero_()
    for copy, part in parts:
        region = reader.region(copy.piece, map_region(copy.src, copy.dst, part), part.sizes, dim_map(copy.src, copy.dst))
        _place(out[tuple(slice(o - r, o - r + s) for o, r, s in zip(part.offsets, rows.offsets, part.sizes))], region)
    return out


def _place(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into ``dst`` (the same shape) and return ``dst``: as bytes, on this thread, when the dtypes agree.

    torch splits a copy over its intra-op threads; beside the executor's own threads, or on a loaded machine, that
    made the row-run copies of a dim-1 split several times slower than memory (1.2 against 8 GiB/s on 2 CPUs).
    numpy copies on the calling thread, without the GIL. A conversion, or a copy numpy cannot view as bytes, goes
    to torch.
    """
    if dst.dtype != src.dtype:
        return dst.copy_(src)
    try:
        target, source = dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # a zero-dim tensor, or a last dim that is not contiguous
        return dst.copy_(src)
    target[...] = source
    return dst


def _dequantize(chunk: Chunk, reader: Reader, check_scales: bool = True) -> torch.Tensor:
    """A computed target's rows: the scale rows a decoder names (copied out of the read buffer first, and with
    ``check_scales`` checked: :func:`_refuse_bad_scale`), the stored rows, and the codec's arithmetic into the
    ``cast`` buffer; an encoder's round trip is recorded."""
    target, dq, scale = chunk.target, chunk.target.dequant, chunk.target.scale
    assert dq is not None
    compute = codec(dq.method, dq.params)
    scales = None
    if scale is not None:  # a decoder's scales
        lo, hi = compute.scale_rows(chunk.start, chunk.stop)  # type: ignore[union-attr]
        rows = row_box(scale.shape, lo, hi)
        scales = _read_rows(scale.copies, rows, scale.source_dtype, reader, "scale")
        if scales is None:
            scales = _gather(scale.copies, rows, scale.source_dtype, reader, "scale", view=False)
        if check_scales:
            _refuse_bad_scale(chunk, rows, compute.bad_scale(scales, chunk.start, dq.stored))  # type: ignore[union-attr]
    a, b = compute.stored_rows(chunk.start, chunk.stop)
    if target.transform is not None:  # quantized after its transform: the pre rows, then the map, then the encoder
        pre = _gather(target.copies, transformed_rows(chunk, (a, b)), target.source_dtype, reader, "chunk")
        stored = target.transform.apply(pre, dq.stored, a, b, target.source_dtype, reader.scratch)
    else:
        rows = row_box(dq.stored, a, b)
        stored = _read_rows(target.copies, rows, target.source_dtype, reader, "chunk")
        if stored is None:
            stored = _gather(target.copies, rows, target.source_dtype, reader, "chunk")
    out = reader.scratch("cast", chunk_rows(chunk).sizes, target.dtype)
    if target.aux:  # a packed weight's small inputs, whole: checked before any value is computed from them
        aux = tuple(_gather(a.copies, row_box(a.shape, 0, a.shape[0] if a.shape else 0), a.source_dtype, reader,
                            f"aux{i}", view=False) for i, a in enumerate(target.aux))
        problem = compute.check_aux(aux, target.shape) if check_scales else None  # type: ignore[union-attr]
        if problem is not None:
            raise SourceError(f"'{target.name}': {problem}")
        compute.decode(stored, scales, chunk.start, out, reader.scratch, aux=aux)  # type: ignore[call-arg]
        return out
    measured = compute.decode(stored, scales, chunk.start, out, reader.scratch)  # type: ignore[arg-type]
    if measured is not None:
        reader.record(target.name, measured)
    return out


def _refuse_bad_scale(chunk: Chunk, rows: Box, bad: BadScale | None) -> None:
    """Stop before a chunk is written whose block a NaN or infinite scale (``bad``, found in the scale ``rows``
    the chunk reads) would make NaN or infinite: a whole projection lost, with nothing else to show it (the merge's
    own audit reads headers only). Checked as the scale rows stream by: they are few."""
    scale = chunk.target.scale
    if bad is not None and scale is not None:
        files = [c.piece.file for c in scale.copies  # the piece that holds the bad scale (of a sharded one, too)
                 if all(o <= i < o + n for i, o, n in zip(bad.index, c.dst.offsets, c.dst.sizes))]
        raise SourceError(bad.message(chunk.target.name, scale.name, files[0] if files else None,
                                      (rows.offsets[0], rows.offsets[0] + rows.sizes[0])))


def _read_rows(copies: Sequence[Copy], rows: Box, dtype: str, reader: Reader, buffer: str) -> torch.Tensor | None:
    """``rows`` (whole rows) of the tensor ``copies`` fill, read with one ``pread`` into the thread's buffer
    ``buffer``, when one raw piece of the tensor's very shape holds it as it is (:func:`_whole_piece`; a quantized
    weight and its scales, most often): what :func:`_gather` gives, without its regions. None otherwise."""
    shape = copies[0].dst.sizes if len(copies) == 1 else ()
    piece = _whole_piece(copies, shape, dtype) if rows.sizes and reader.reads_files else None
    if (piece is None or piece.box.sizes != shape or rows.sizes[1:] != shape[1:] or any(rows.offsets[1:])
            or rows.offsets[0] + rows.sizes[0] > shape[0]):
        return None
    row = math.prod(shape[1:]) * itemsize(dtype)
    return reader.read_scratch(buffer, rows.sizes, dtype, piece, piece.byte_offset + rows.offsets[0] * row)


def direct_offset(chunk: Chunk) -> int | None:
    """Where a chunk's bytes start in its piece's file when they lie there as the output holds them (the
    target is one raw piece copied whole, in its own dtype); None when the chunk must be built."""
    target = chunk.target
    whole = (target.dequant is None and target.transform is None and target.dtype == target.source_dtype
             and not target.lora)
    piece = _whole_piece(target.copies, target.shape, target.dtype) if whole else None
    if piece is None:
        return None
    rows = chunk.stop - chunk.start
    return piece.byte_offset + (chunk.start * (chunk.nbytes // rows) if rows else 0)


def _whole_piece(copies: Sequence[Copy], shape: Shape, dtype: str) -> Piece | None:
    """The piece of raw bytes in ``dtype`` that ``copies`` copy whole, as it lies in its file, into all of a
    tensor of ``shape`` (one copy, from and to offset 0; its box may differ from ``shape`` by dims of size 1);
    None for anything else."""
    if len(copies) != 1:
        return None
    copy = copies[0]
    piece = copy.piece
    if (piece.encoding != RAW or piece.dtype != dtype or copy.dst.sizes != shape or any(copy.dst.offsets)
            or copy.src.sizes != piece.box.sizes or any(copy.src.offsets)):
        return None
    return piece


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
    on_chunk: Callable[[Chunk, memoryview], None] | None = None,
) -> str:
    """Write one safetensors file (header ``prefix``, then every chunk at its offset) and return its digest.

    The file is allocated at its full size first, so a full disk shows before any tensor is read. ``on_chunk``
    sees each chunk's bytes as they are written, on the thread that wrote them (a DCP item's CRC-32).
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
                if starts[0] is None:
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
                    if on_chunk is not None:
                        on_chunk(chunk, view)
                    # the token file_digest makes: a chunk that could be copied (here built for on_chunk) is checked
                    # against its source
                    copyable = reader.reads_files and chunk.nbytes >= file_copies.COPY_BYTES and copied(chunk) is not None
                    yield COPIED if copyable else crc_token(view)
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
