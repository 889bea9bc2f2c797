"""The streaming executor: each output tensor is written in row chunks straight from positioned reads of its
pieces, never materialised whole, on several threads.

A target of shape ``(R, ...)`` is cut into chunks of whole rows of at most :data:`CHUNK_BYTES`. For a chunk,
every copy of the plan that meets those rows gives a region of its piece; a region is read with one ``pread``
of the smallest byte range that holds it (a dim-0 piece gives whole rows: one run; a dim-1 piece gives the
chunk's rows of that piece: again one run), laid into the chunk as a strided view, and the chunk is written
with one ``pwrite`` at its offset in the output file. A chunk covered by one contiguous region is written from
the read buffer itself. Memory is a few chunks per thread, whatever the size of the tensors.

A computed target (:class:`~ckpttool.engine.plan.Dequantize`: dequantized, or FP8-quantized in whole block rows)
is not copied: the source and scale rows its codec (:mod:`ckpttool.quant.codecs`) names are gathered the same way,
and the codec writes the chunk's values, with its temporaries on the thread's buffers too.

Each chunk's sha256 is taken as it is written; a file's digest is the sha256 of its header's sha256 followed
by its chunks' sha256 in file order, so it can be computed again from the file alone (:func:`file_digest`).
"""

from __future__ import annotations

import errno
import hashlib
import math
import os
import threading
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from ..dtypes import itemsize, torch_dtype
from ..errors import SourceError
from ..paths import open_source, source_os_error
from ..quant.codecs import codec
from ..quant.encode import RoundTrip
from .buffers import Chunk, _inputs, _row_box, _rows, buffer_sizes, predict_peak_bytes
from .layout import RAW, Box, Piece, c_strides
from .plan import Copy, Target
from .reference import PieceLoader
from .regions import dim_map, map_region

__all__ = ["CHUNK_BYTES", "Chunk", "Reader", "buffer_sizes", "build", "chunks", "file_digest", "piece_uses",
           "predict_peak_bytes", "write_file"]

#: the most output bytes one chunk holds (a chunk is at least one row)
CHUNK_BYTES = 32 * 2**20


def chunks(target: Target, offset: int, chunk_bytes: int = CHUNK_BYTES, rows: int | None = None) -> list[Chunk]:
    """The chunks of ``target`` (written at ``offset``), in file order: ``rows`` rows each, or as many as
    ``chunk_bytes`` holds."""
    shape = target.shape or (1,)
    row = math.prod(shape[1:]) * itemsize(target.dtype)
    per = rows or (max(1, chunk_bytes // _compute_row_bytes(target, row)) if row else max(1, shape[0]))
    if target.dequant is not None:  # a computed target: chunks of whole rows of blocks where it needs them
        per = codec(target.dequant.method, target.dequant.params).align(per)
    return [
        Chunk(target, a, min(a + per, shape[0]), offset + a * row, (min(a + per, shape[0]) - a) * row)
        for a in range(0, shape[0], per)
    ]


def _compute_row_bytes(target: Target, row: int) -> int:
    """Bytes one row of ``target`` takes at its largest: an encoder's float32 copy of its source rows."""
    if target.dequant is None or not target.dequant.stored:
        return row
    a, b = codec(target.dequant.method, target.dequant.params).stored_rows(0, 1)
    return max(row, (b - a) * math.prod(target.dequant.stored[1:]) * 4)


def file_digest(path: Path, prefix_len: int, spans: Sequence[int]) -> str:
    """The digest :func:`write_file` returns, computed again from the file: ``spans`` are the chunk sizes."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(hashlib.sha256(f.read(prefix_len)).digest())
        for n in spans:
            digest.update(hashlib.sha256(f.read(n)).digest())
    return digest.hexdigest()


class Reader:
    """Regions of pieces, read with ``pread`` into per-thread buffers; safe to share between threads.

    Pieces stored as ``torch.save`` archives (ones that could not be located as raw bytes) are loaded whole
    and kept until their last use (``uses``). ``sizes`` (see :func:`buffer_sizes`) sizes each thread's
    buffers once, so growing them never leaves freed buffers behind in the thread's heap.
    """

    def __init__(self, root: str | Path, uses: Counter[Piece], sizes: dict[str, int] | None = None) -> None:
        self.root = Path(root)
        self._sizes = sizes or {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._loader = PieceLoader(root, Counter({p: n for p, n in uses.items() if p.encoding != RAW}))
        self.round_trips: dict[str, RoundTrip] = {}  # per quantized target (see :mod:`ckpttool.quant.encode`)

    def record(self, name: str, measured: RoundTrip) -> None:
        with self._lock:
            self.round_trips[name] = self.round_trips[name] + measured if name in self.round_trips else measured

    def region(self, piece: Piece, box: Box, sizes: tuple[int, ...], dims: tuple[int | None, ...]) -> torch.Tensor:
        """``box`` of ``piece`` (local coordinates) as a tensor of shape ``sizes``: dim ``d`` is the piece's dim
        ``dims[d]`` (None: an added dim of size 1). A view of this thread's buffer, valid until its next read."""
        if piece.encoding != RAW:
            with self._lock:
                tensor = self._loader.load(piece)
            return tensor[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))].reshape(sizes)
        shape = piece.box.sizes
        strides = c_strides(shape)
        first = sum(o * st for o, st in zip(box.offsets, strides))
        last = sum((o + s - 1) * st for o, s, st in zip(box.offsets, box.sizes, strides))
        size = itemsize(piece.dtype)
        nbytes = (last - first + 1) * size
        buffer = self._buffer("read", nbytes)
        try:
            got = os.preadv(self._fd(piece.file), [memoryview(buffer)[:nbytes]], piece.byte_offset + first * size)
        except OSError as e:
            raise source_os_error(piece.file, e) from None
        if got != nbytes:
            raise SourceError(
                f"'{piece.file}': '{piece.key}' needs {nbytes} bytes at offset {piece.byte_offset + first * size} but "
                f"only {got} are there; the file is truncated"
            )
        flat = torch.frombuffer(buffer, dtype=torch.uint8, count=nbytes).view(torch_dtype(piece.dtype))
        # a dim of size 1 takes the stride C order gives it: any stride indexes it, but torch views the bytes of
        # a tensor (``.view(torch.uint8)``) only when its last stride is 1, so a one-element tensor needs it too
        filler = c_strides(sizes)
        return torch.as_strided(flat, sizes, [strides[s] if s is not None else filler[d] for d, s in enumerate(dims)])

    def scratch(self, name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """A tensor of ``shape`` on this thread's buffer ``name``, reused from chunk to chunk (allocating a
        fresh one per chunk lets each thread's heap grow)."""
        nbytes = math.prod(shape) * itemsize(dtype)
        flat = torch.frombuffer(self._buffer(name, nbytes), dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        return flat.view(torch_dtype(dtype)).reshape(shape)

    def _buffer(self, name: str, nbytes: int) -> bytearray:
        buffers = self._local.__dict__.setdefault("buffers", {})
        buffer = buffers.get(name)
        if buffer is None or len(buffer) < nbytes:  # once, at the largest size this thread will need
            buffer = buffers[name] = bytearray(max(nbytes, self._sizes.get(name, 0), 1))
        return buffer

    def _fd(self, file: str) -> int:
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                with open_source(self.root / file, file) as handle:  # a regular file, or a SourceError
                    fd = os.dup(handle.fileno())
                self._fds[file] = fd
            return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def piece_uses(chunk_list: Sequence[Chunk]) -> Counter[Piece]:
    """How many chunks read each piece (a piece of ``torch.save`` bytes is kept loaded until its last one)."""
    uses: Counter[Piece] = Counter()
    for chunk in chunk_list:
        for copies, rows in _inputs(chunk):
            uses.update(c.piece for c in copies if c.dst.intersect(rows) is not None)
    return uses


def build(chunk: Chunk, reader: Reader) -> torch.Tensor:
    """The chunk's elements in the output dtype, C order (a view of the read buffer when one region fills it)."""
    target = chunk.target
    if target.dequant is not None:
        return _dequantize(chunk, reader)
    out = _gather(target.copies, _rows(chunk), target.source_dtype, reader, "chunk")
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
        return region if view and region.is_contiguous() else reader.scratch(buffer, rows.sizes, dtype).copy_(region)
    out = reader.scratch(buffer, rows.sizes, dtype)
    if sum(part.numel for _, part in parts) != rows.numel:  # rows no copy fills are zeros (a split's vocab padding)
        out.zero_()
    for copy, part in parts:
        region = reader.region(copy.piece, map_region(copy.src, copy.dst, part), part.sizes, dim_map(copy.src, copy.dst))
        out[tuple(slice(o - r, o - r + s) for o, r, s in zip(part.offsets, rows.offsets, part.sizes))] = region
    return out


def _dequantize(chunk: Chunk, reader: Reader) -> torch.Tensor:
    """A computed target's rows: the scale rows a decoder names (copied out of the read buffer first), the stored
    rows, and the codec's arithmetic into the ``cast`` buffer; an encoder's round trip is recorded."""
    target, dq, scale = chunk.target, chunk.target.dequant, chunk.target.scale
    assert dq is not None
    compute = codec(dq.method, dq.params)
    scales = None
    if scale is not None:  # a decoder's scales
        lo, hi = compute.scale_rows(chunk.start, chunk.stop)  # type: ignore[union-attr]
        scales = _gather(scale.copies, _row_box(scale.shape, lo, hi), scale.source_dtype, reader, "scale", view=False)
    stored = _gather(target.copies, _row_box(dq.stored, *compute.stored_rows(chunk.start, chunk.stop)),
                     target.source_dtype, reader, "chunk")
    out = reader.scratch("cast", _rows(chunk).sizes, target.dtype)
    measured = compute.decode(stored, scales, chunk.start, out, reader.scratch)  # type: ignore[arg-type]
    if measured is not None:
        reader.record(target.name, measured)
    return out


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
    """
    size = len(prefix) + sum(c.nbytes for c in chunk_list)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno not in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):  # a file system without it
                    raise
        _write_all(fd, prefix, 0)

        def run(chunk: Chunk) -> bytes:
            data = build(chunk, reader)
            view = memoryview(data.reshape(-1).view(torch.uint8).numpy())
            _write_all(fd, view, len(prefix) + chunk.offset)
            if on_chunk is not None:
                on_chunk(chunk, view)
            return hashlib.sha256(view).digest()

        digest = hashlib.sha256(hashlib.sha256(prefix).digest())
        if workers > 1:
            with ThreadPoolExecutor(max_workers=workers) as pool:
                for chunk, chunk_digest in zip(chunk_list, pool.map(run, chunk_list)):
                    digest.update(chunk_digest)
                    on_bytes(chunk.nbytes)
        else:
            for chunk in chunk_list:
                digest.update(run(chunk))
                on_bytes(chunk.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest()


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n
