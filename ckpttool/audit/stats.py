"""Tensor data, streamed: layout-independent fingerprints and statistics in constant memory.

A fingerprint is the sha256 of the dtype, the shape and the elements in C order of the *logical* tensor, so
the same weights saved under any sharding (FSDP over 4 ranks, TP=2, one HF file) give the same fingerprint.
Tensors are never held whole: they arrive in the streaming executor's row chunks (:mod:`ckpttool.engine.executor`),
which an accumulator folds in order; statistics convert at most :data:`BLOCK_ELEMENTS` elements at once.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Protocol, TypeVar

from ..deferred import torch
from ..engine.executor import Reader, buffer_sizes, build, chunks, piece_uses
from ..engine.plan import Plan, Target
from ..findings import TensorStats

#: elements converted to float at once
BLOCK_ELEMENTS = 1 << 22

R = TypeVar("R", covariant=True)


class Accumulator(Protocol[R]):
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
            for chunk in chunk_list:
                accumulator.add(build(chunk, reader))
                on_bytes(chunk.nbytes)
            results.append(accumulator.result())
    finally:
        reader.close()
    return results


def blocks(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Flat, contiguous blocks of at most :data:`BLOCK_ELEMENTS` elements, in C order."""
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), BLOCK_ELEMENTS):
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


class Fingerprint:
    """sha256 of ``dtype``, shape and the elements in C order: equal iff the logical tensors are bit-identical."""

    def __init__(self, target: Target) -> None:
        self._digest = hashlib.sha256(f"{target.dtype}{list(target.shape)}\n".encode())

    def add(self, chunk: torch.Tensor) -> None:
        for block in blocks(chunk):
            self._digest.update(block.view(torch.uint8).numpy())

    def result(self) -> str:
        return self._digest.hexdigest()


class Statistics:
    """Fingerprint, and for floating-point tensors RMS, mean, min, max over finite values, NaN and Inf counts.

    Blocks are summed in float32 (exact enough for statistics) and accumulated in float64; a block with a
    non-finite value, or whose squares overflow float32, is counted again in float64.
    """

    def __init__(self, target: Target) -> None:
        self.target = target
        self._fingerprint = Fingerprint(target)
        self._counts: Counter[str] = Counter()
        self._total = self._squares = 0.0
        self._low, self._high = math.inf, -math.inf

    def add(self, chunk: torch.Tensor) -> None:
        self._fingerprint.add(chunk)
        if not chunk.is_floating_point():
            return
        for block in blocks(chunk):
            x = _as_float(block)
            lo, hi = (float(v) for v in torch.aminmax(x))
            block_sum, block_squares = float(x.sum()), float(torch.dot(x, x))
            if not all(map(math.isfinite, (lo, hi, block_sum, block_squares))):
                x = x.double()
                ok = torch.isfinite(x)
                nans = int(torch.isnan(x).sum())
                self._counts["nan"] += nans
                self._counts["inf"] += x.numel() - int(ok.sum()) - nans
                x = x[ok]
                if not x.numel():
                    continue
                lo, hi = float(x.min()), float(x.max())
                block_sum, block_squares = float(x.sum()), float((x * x).sum())
            self._counts["finite"] += x.numel()
            self._total += block_sum
            self._squares += block_squares
            self._low, self._high = min(self._low, lo), max(self._high, hi)

    def result(self) -> TensorStats:
        t, finite = self.target, self._counts["finite"]
        nan, inf = self._counts["nan"], self._counts["inf"]
        if not finite:
            return TensorStats(t.name, t.shape, t.dtype, self._fingerprint.result(), nan=nan, inf=inf)
        return TensorStats(
            t.name, t.shape, t.dtype, self._fingerprint.result(), rms=math.sqrt(self._squares / finite),
            mean=self._total / finite, min=self._low, max=self._high, nan=nan, inf=inf,
        )
