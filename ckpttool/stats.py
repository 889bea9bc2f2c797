"""Tensor data, one logical tensor at a time: layout-independent fingerprints and statistics.

A fingerprint is the sha256 of the dtype, the shape and the elements in C order of the *logical* tensor, so
the same weights saved under any sharding (FSDP over 4 ranks, TP=2, one HF file) give the same fingerprint.
Tensors are assembled one at a time from the plan (memory: the largest tensor and its pieces); statistics are
computed over flat blocks so a float copy never exceeds :data:`BLOCK_ELEMENTS` elements.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch

from .executor import PieceLoader, assemble
from .findings import TensorStats
from .plan import Plan, Target

#: elements converted to float at once
BLOCK_ELEMENTS = 1 << 22

R = TypeVar("R")


def map_tensors(plan: Plan, fn: Callable[[Target, torch.Tensor], R], on_bytes: Callable[[int], None] = lambda n: None) -> list[R]:
    """``fn(target, tensor)`` for each target of ``plan`` in order; only one assembled tensor is alive at a time."""
    loader = PieceLoader.for_plan(plan)
    results = []
    for target in plan.targets:
        results.append(fn(target, assemble(target, loader)))
        on_bytes(target.nbytes)
    return results


def blocks(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Flat, contiguous blocks of at most :data:`BLOCK_ELEMENTS` elements, in C order."""
    flat = tensor.reshape(-1)
    for start in range(0, flat.numel(), BLOCK_ELEMENTS):
        yield flat[start:start + BLOCK_ELEMENTS].contiguous()


def fingerprint(tensor: torch.Tensor, dtype: str) -> str:
    """sha256 of ``dtype``, shape and the elements in C order: equal iff the logical tensors are bit-identical."""
    digest = hashlib.sha256(f"{dtype}{list(tensor.shape)}\n".encode())
    for block in blocks(tensor):
        digest.update(block.view(torch.uint8).numpy())
    return digest.hexdigest()


def tensor_stats(target: Target, tensor: torch.Tensor) -> TensorStats:
    """Fingerprint, and for floating-point tensors RMS, mean, min, max over finite values, NaN and Inf counts.

    Blocks are summed in float32 (exact enough for statistics) and accumulated in float64; a block with a
    non-finite value, or whose squares overflow float32, is counted again in float64.
    """
    digest = fingerprint(tensor, target.dtype)
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return TensorStats(target.name, target.shape, target.dtype, digest)
    nan = inf = finite = 0
    total = squares = 0.0
    low, high = math.inf, -math.inf
    for block in blocks(tensor):
        x = block.float()
        lo, hi = (float(v) for v in torch.aminmax(x))
        block_sum, block_squares = float(x.sum()), float(torch.dot(x, x))
        if not all(map(math.isfinite, (lo, hi, block_sum, block_squares))):
            x = x.double()
            ok = torch.isfinite(x)
            nans = int(torch.isnan(x).sum())
            nan, inf = nan + nans, inf + x.numel() - int(ok.sum()) - nans
            x = x[ok]
            if not x.numel():
                continue
            lo, hi = float(x.min()), float(x.max())
            block_sum, block_squares = float(x.sum()), float((x * x).sum())
        finite += x.numel()
        total += block_sum
        squares += block_squares
        low, high = min(low, lo), max(high, hi)
    if not finite:
        return TensorStats(target.name, target.shape, target.dtype, digest, nan=nan, inf=inf)
    return TensorStats(
        target.name, target.shape, target.dtype, digest,
        rms=math.sqrt(squares / finite), mean=total / finite, min=low, max=high, nan=nan, inf=inf,
    )
