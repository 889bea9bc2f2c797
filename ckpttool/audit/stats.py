"""Tensor data, streamed: layout-independent fingerprints and statistics in constant memory.

A fingerprint is the sha256 of the dtype, the shape and the elements in C order of the *logical* tensor, so
the same weights saved under any sharding (FSDP over 4 ranks, TP=2, one HF file) give the same fingerprint.
Tensors are never held whole: they arrive in the streaming executor's row chunks (:mod:`ckpttool.execute.executor`),
which an accumulator folds in order; statistics convert at most :data:`BLOCK_ELEMENTS` elements at once.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import torch_dtype
from ckpttool.execute.buffers import Chunk, buffer_sizes, chunks, piece_uses
from ckpttool.execute.reads import Reader
from ckpttool.execute.assembly import direct_offset, build
from ckpttool.plan.plan import Plan, Target
from ckpttool.findings import TensorStats

#: elements converted to float at once
BLOCK_ELEMENTS = 1 << 22

R = TypeVar("R", covariant=True)


class Accumulator(Protocol[R]):
    """Takes a target's chunks in C order (:meth:`add`), then gives its result. One that also has
    ``add_bytes(view: memoryview)`` is given the bytes of chunks read straight from their file instead (a
    fingerprint needs no tensor)."""

    def add(self, chunk: torch.Tensor) -> None: ...

    def result(self) -> R: ...


def fold(plan: Plan, start: Callable[[Target], Accumulator[R]], on_bytes: Callable[[int], None] = lambda n: None) -> list[R]:
    """For each target of ``plan``, in order: ``start(target)``, fed every chunk of the target in C order."""
    chunk_lists = [chunks(t, 0) for t in plan.targets]
    every = [c for chunk_list in chunk_lists for c in chunk_list]
    reader = Reader(plan.root, piece_uses(every), buffer_sizes(every))
    results = []
    try:
        for target, chunk_list in zip(plan.targets, chunk_lists):
            accumulator = start(target)
            add_bytes = getattr(accumulator, "add_bytes", None)
            for chunk in chunk_list:
                view = _read_direct(chunk, reader)
                if view is None:
                    accumulator.add(build(chunk, reader, check_scales=False))  # invalid scales are findings here
                elif add_bytes is not None:
                    add_bytes(view)
                else:
                    accumulator.add(_as_tensor(view, chunk))
                on_bytes(chunk.nbytes)
            results.append(accumulator.result())
    finally:
        reader.close()
    return results


def _read_direct(chunk: Chunk, reader: Reader) -> memoryview | None:
    """The bytes of a chunk that lies in its file as it is (the executor's direct chunks,
    :func:`~ckpttool.execute.assembly.direct_offset`), read with one ``pread`` into the reader's buffer (valid until its
    next read), without the region arithmetic of :func:`~ckpttool.execute.assembly.build`: most of the cost of a
    small tensor. None for a chunk that must be built."""
    at = direct_offset(chunk) if 0 < chunk.nbytes <= reader.run_bytes else None
    if at is None:
        return None
    view = reader.run_buffer(chunk.nbytes)
    reader.read_into(view, chunk.target.copies[0].piece, at)
    return view


def _as_tensor(view: memoryview, chunk: Chunk) -> torch.Tensor:
    """The chunk's bytes ``view`` as :func:`~ckpttool.execute.assembly.build` gives the chunk: its dtype, its rows."""
    target = chunk.target
    values = torch.frombuffer(view, dtype=torch.uint8).view(torch_dtype(target.dtype))
    return values.reshape((chunk.stop - chunk.start, *target.shape[1:]) if target.shape else ())


def blocks(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Flat, contiguous blocks of at most :data:`BLOCK_ELEMENTS` elements, in C order."""
    flat = tensor.reshape(-1)
    n = flat.numel()
    if n <= BLOCK_ELEMENTS:  # most tensors: one block, the tensor itself when it is contiguous (no slice, no copy)
        if n:
            yield flat.contiguous()
        return
    for start in range(0, n, BLOCK_ELEMENTS):
        yield flat[start:start + BLOCK_ELEMENTS].contiguous()


_scratch = threading.local()


def _as_float(block: torch.Tensor) -> torch.Tensor:
    """``block`` as float32 in a buffer reused from block to block (a fresh one each time lets the heap grow)."""
    if block.dtype == torch.float32:
        return block
    buffer = getattr(_scratch, "buffer", None)
    if buffer is None:
        buffer = _scratch.buffer = torch.empty(BLOCK_ELEMENTS, dtype=torch.float32)
    return buffer[: block.numel()].copy_(block)


def _start_digest(target: Target) -> hashlib._Hash:
    """A fingerprint's sha256 before the elements: the dtype and the shape."""
    return hashlib.sha256(f"{target.dtype}{list(target.shape)}\n".encode())


class Fingerprint:
    """sha256 of ``dtype``, shape and the elements in C order: equal iff the logical tensors are bit-identical."""

    def __init__(self, target: Target) -> None:
        self._digest = _start_digest(target)

    def add(self, chunk: torch.Tensor) -> None:
        for block in blocks(chunk):
            self._digest.update(block.view(torch.uint8).numpy())

    def add_bytes(self, view: memoryview) -> None:
        """The chunk's elements in C order, as bytes: hashed as :meth:`add` hashes them."""
        self._digest.update(view)

    def result(self) -> str:
        return self._digest.hexdigest()


class Statistics:
    """Fingerprint, and for floating-point tensors RMS, mean, min, max over finite values, NaN and Inf counts.

    Blocks are summed in float32 (exact enough for statistics) and accumulated in float64; a block with a
    non-finite value, or whose squares overflow float32, is counted again in float64. Each block is hashed and
    measured in one pass (a checkpoint of 90k small tensors costs per tensor: a few torch calls each).
    """

    __slots__ = ("target", "_digest", "_finite", "_nan", "_inf", "_total", "_squares", "_low", "_high")

    def __init__(self, target: Target) -> None:
        self.target = target
        self._digest = _start_digest(target)
        self._finite = self._nan = self._inf = 0
        self._total = self._squares = 0.0
        self._low, self._high = math.inf, -math.inf

    def add(self, chunk: torch.Tensor) -> None:
        floating = chunk.is_floating_point()
        for block in blocks(chunk):
            self._digest.update(block.view(torch.uint8).numpy())
            if floating:
                self._measure(_as_float(block))

    def _measure(self, x: torch.Tensor) -> None:
        lo, hi = torch.aminmax(x)
        lo, hi, block_sum, block_squares = float(lo), float(hi), float(x.sum()), float(torch.dot(x, x))
        if not (_isfinite(lo) and _isfinite(hi) and _isfinite(block_sum) and _isfinite(block_squares)):
            x = x.double()
            ok = torch.isfinite(x)
            nans = int(torch.isnan(x).sum())
            self._nan += nans
            self._inf += x.numel() - int(ok.sum()) - nans
            x = x[ok]
            if not x.numel():
                return
            lo, hi = float(x.min()), float(x.max())
            block_sum, block_squares = float(x.sum()), float((x * x).sum())
        self._finite += x.numel()
        self._total += block_sum
        self._squares += block_squares
        if lo < self._low:
            self._low = lo
        if hi > self._high:
            self._high = hi

    def result(self) -> TensorStats:
        t, finite = self.target, self._finite
        nan, inf = self._nan, self._inf
        if not finite:
            return TensorStats(t.name, t.shape, t.dtype, self._digest.hexdigest(), nan=nan, inf=inf)
        return TensorStats(
            t.name, t.shape, t.dtype, self._digest.hexdigest(), rms=math.sqrt(self._squares / finite),
            mean=self._total / finite, min=self._low, max=self._high, nan=nan, inf=inf,
        )


_isfinite = math.isfinite
