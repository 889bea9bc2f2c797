"""Regions of a checkpoint's pieces, read for the streaming executor (:mod:`ckpttool.execute.executor`).

A region of a piece of raw bytes is read with one ``pread`` of the smallest byte range that holds it, into a
buffer of the calling thread, and seen as a strided tensor; a piece stored as a ``torch.save`` archive is loaded
whole and kept until its last use. The executor's direct path (chunks copied whole from their file) reads byte
runs into the same buffer (:meth:`Reader.read_into`).
"""

from __future__ import annotations

import errno
import math
import mmap
import os
import threading
from collections import Counter
from pathlib import Path

from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import itemsize, torch_dtype
from ckpttool.errors import SourceError
from ckpttool.io.paths import open_inside, source_os_error
from ckpttool.quant.encode import RoundTrip
from ckpttool.layout.layout import RAW, Box, Piece, c_strides
from ckpttool.execute.reference import PieceLoader

__all__ = ["Reader"]

#: the most scratch tensors a thread keeps for reuse (see :meth:`Reader.scratch`)
SCRATCH_VIEWS = 64
#: rows one ``preadv`` of :meth:`Reader.read_rows` reads: two buffers per row (the run, the gap after it) within
#: the system's limit on buffers per call
_ROWS_PER_READ = max(1, min(os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 16, 1024) // 2)


class Reader:
    """Regions of pieces, read with ``pread`` into per-thread buffers; safe to share between threads.

    Pieces stored as ``torch.save`` archives (ones that could not be located as raw bytes) are loaded whole
    and kept until their last use (``uses``). ``sizes`` (see :func:`~ckpttool.execute.buffers.buffer_sizes`) sizes each thread's
    buffers once, so growing them never leaves freed buffers behind in the thread's heap.

    With ``readahead=False`` the system is told to read no more of a source file than each read asks
    (``POSIX_FADV_RANDOM``): for a reader whose outputs each take a slice of every tensor (a split: every rank's file
    takes its rows of each source tensor, one rank after another), the read-ahead past one slice reads the bytes of
    the next ranks' slices long before they are used, and on a busy page cache they are dropped and read again
    (a split of 8 GiB at fsdp 4 x tp 2 read 1.05-1.17 bytes from the disk per byte written; without it, 1.00). A read
    of a chunk is large enough (up to 32 MiB) to keep the disk busy on its own.
    """

    #: pieces are read from their files, so a chunk may be read or copied from them directly (``pread`` of whole
    #: rows, ``copy_file_range``); a reader that serves pieces from elsewhere (the live gather's buffers) says False
    reads_files = True

    def __init__(self, root: str | Path, uses: Counter[Piece], sizes: dict[str, int] | None = None, *,
                 readahead: bool = True) -> None:
        self.root = Path(root)
        self._readahead = readahead
        self._sizes = sizes or {}
        self._fds: dict[str, int] = {}
        self._lock = threading.Lock()
        self._local = threading.local()
        self._loader = PieceLoader(root, Counter({p: n for p, n in uses.items() if p.encoding != RAW}))
        self.round_trips: dict[str, RoundTrip] = {}  # per quantized target (see :mod:`ckpttool.quant.encode`)
        self._in_kernel = hasattr(os, "copy_file_range")  # until a file system refuses it

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

    @property
    def run_bytes(self) -> int:
        """The most bytes of direct chunks (see :func:`direct_offset`) one run may gather: the read buffer's predicted
        size (0 when none was given, or nothing is read from files: then every chunk is built)."""
        return self._sizes.get("read", 0)

    def read_into(self, view: memoryview, piece: Piece, offset: int) -> None:
        """Fill ``view`` with the bytes at ``offset`` of ``piece``'s file (a run of a direct chunk)."""
        try:
            got = os.preadv(self._fd(piece.file), [view], offset)
        except OSError as e:
            raise source_os_error(piece.file, e) from None
        if got != len(view):
            raise SourceError(
                f"'{piece.file}': '{piece.key}' needs {len(view)} bytes at offset {offset} but only {got} are there; "
                "the file is truncated"
            )

    def read_rows(self, view: memoryview, piece: Piece, offset: int, run: int, stride: int) -> None:
        """Fill ``view`` with runs of ``run`` bytes, one every ``stride`` bytes from ``offset`` of ``piece``'s file
        (the rows of a column shard, see :func:`~ckpttool.execute.assembly.direct_rows`): each ``preadv`` reads a
        span of the file, its runs into place and the bytes between them into a scratch buffer, so nothing is
        copied after it is read (nor is torch needed to pick the columns)."""
        gap = memoryview(self._buffer("gap", stride - run))[:stride - run]
        rows = len(view) // run
        fd = self._fd(piece.file)
        for first in range(0, rows, _ROWS_PER_READ):
            last = min(rows, first + _ROWS_PER_READ)
            vectors = [view[row * run:(row + 1) * run] for row in range(first, last)]
            if stride > run and len(vectors) > 1:  # a gap between each two runs (whole lists: this runs per row)
                vectors, runs = [gap] * (2 * len(vectors) - 1), vectors
                vectors[::2] = runs
            want, at = (last - first) * stride - (stride - run), offset + first * stride
            try:
                got = os.preadv(fd, vectors, at)
            except OSError as e:
                raise source_os_error(piece.file, e) from None
            if got != want:
                raise SourceError(
                    f"'{piece.file}': '{piece.key}' needs {want} bytes at offset {at} but only {got} are there; "
                    "the file is truncated"
                )

    def copy_out(self, piece: Piece, offset: int, out: int, at: int, nbytes: int) -> int:
        """Copy ``nbytes`` at ``offset`` of ``piece``'s file to offset ``at`` of the file ``out`` inside the kernel
        (``copy_file_range``) and return how many were copied: fewer when it stops (the source ends, an error) or
        cannot be used (then never again). The caller copies the rest through a buffer, which names any error."""
        done = 0
        if not self._in_kernel:
            return done
        source = self._fd(piece.file)
        while done < nbytes:
            try:
                n = os.copy_file_range(source, out, nbytes - done, offset + done, at + done)
            except OSError as e:
                if e.errno in (errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF):
                    self._in_kernel = False  # file systems (or a kernel) that cannot
                return done
            if n == 0:  # the source ends: a truncation, named by the read that follows
                return done
            done += n
        return done

    def read_ahead(self, piece: Piece, offset: int, nbytes: int) -> None:
        """Have the disk read ``nbytes`` at ``offset`` of ``piece``'s file into the page cache, without waiting (a
        hint, where the system takes it)."""
        try:
            os.posix_fadvise(self._fd(piece.file), offset, nbytes, os.POSIX_FADV_WILLNEED)
        except (OSError, AttributeError):  # no posix_fadvise (macOS), or a file that refuses it
            pass

    def run_buffer(self, nbytes: int) -> memoryview:
        """This thread's read buffer, for a run of direct chunks of ``nbytes``."""
        return memoryview(self._buffer("read", nbytes))[:nbytes]

    def scratch(self, name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        """A tensor of ``shape`` on this thread's buffer ``name``, reused from chunk to chunk (allocating a
        fresh one per chunk lets each thread's heap grow). The same tensor object for the same ``name``, shape and
        dtype until the buffer grows: thousands of identical small tensors (experts) cost a dict look-up each."""
        views = self._local.__dict__.setdefault("views", {})
        key = (name, shape, dtype)
        found = views.get(key)
        if found is not None:
            return found
        nbytes = math.prod(shape) * itemsize(dtype)
        flat = torch.frombuffer(self._buffer(name, nbytes), dtype=torch.uint8, count=nbytes) if nbytes else torch.empty(0, dtype=torch.uint8)
        if len(views) >= SCRATCH_VIEWS:  # many shapes: start again rather than hold a view of each
            views.clear()
        found = views[key] = flat.view(torch_dtype(dtype)).reshape(shape)
        return found

    def read_scratch(self, name: str, shape: tuple[int, ...], dtype: str, piece: Piece, offset: int) -> torch.Tensor:
        """:meth:`scratch` filled with the bytes at ``offset`` of ``piece``'s file (rows that lie there as the
        tensor holds them), with one ``pread``."""
        tensor = self.scratch(name, shape, dtype)
        nbytes = math.prod(shape) * itemsize(dtype)
        if nbytes:
            self.read_into(memoryview(self._local.buffers[name])[:nbytes], piece, offset)
        return tensor

    def _buffer(self, name: str, nbytes: int) -> bytearray | mmap.mmap:
        """This thread's buffer ``name``: allocated once, at the largest size it will need, as a private anonymous
        map, so only the pages a chunk uses are ever touched (a bytearray writes zeros over all of it: the 32 MiB
        read buffer of a thread that only copies file to file, and a few small tensors through the buffer)."""
        buffers = self._local.__dict__.setdefault("buffers", {})
        buffer = buffers.get(name)
        if buffer is None or len(buffer) < nbytes:
            size = max(nbytes, self._sizes.get(name, 0), 1)
            try:
                buffer = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            except (AttributeError, OSError):  # no anonymous maps here
                buffer = bytearray(size)
            buffers[name] = buffer
            views = self._local.__dict__.get("views", {})
            for key in [k for k in views if k[0] == name]:  # views of the buffer given up
                del views[key]
        return buffer

    def _fd(self, file: str) -> int:
        fd = self._fds.get(file)  # a file opened before: no lock (a dict's get is atomic, and fds are only added)
        if fd is not None:
            return fd
        with self._lock:
            fd = self._fds.get(file)
            if fd is None:
                with open_inside(self.root, file) as handle:  # a regular file inside the source, or a SourceError
                    fd = os.dup(handle.fileno())
                if not self._readahead:
                    _no_readahead(fd)
                self._fds[file] = fd
            return fd

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


def _no_readahead(fd: int) -> None:
    """Have the system read of ``fd``'s file only what is asked (see :class:`Reader`): a hint, where it is taken."""
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
    except (OSError, AttributeError):  # no posix_fadvise (macOS), or a file that refuses it
        pass
