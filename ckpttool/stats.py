"""Tensor data, one logical tensor at a time: layout-independent fingerprints and statistics.

A fingerprint is the sha256 of the dtype, the shape and the elements in C order of the *logical* tensor, so
the same weights saved under any sharding (FSDP over 4 ranks, TP=2, one HF file) give the same fingerprint.
Tensors are assembled one at a time from the plan (memory: the largest tensor and its pieces); statistics are
computed over row blocks so a float copy never exceeds :data:`BLOCK_ELEMENTS`.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator

import torch

from .executor import PieceLoader, assemble
from .findings import TensorStats
from .plan import Plan, Target

#: elements converted to float64 at once
BLOCK_ELEMENTS = 1 << 22


def iter_tensors(plan: Plan, on_bytes: Callable[[int], None] = lambda n: None) -> Iterator[tuple[Target, torch.Tensor]]:
    """Each target of ``plan`` with its assembled tensor, in plan order; only one tensor is alive at a time."""
    loader = PieceLoader.for_plan(plan)
    for target in plan.targets:
        tensor = assemble(target, loader)
        yield target, tensor
        on_bytes(target.nbytes)


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
    """Fingerprint, and for floating-point tensors RMS, mean, min, max over finite values, NaN and Inf counts."""
    digest = fingerprint(tensor, target.dtype)
    if not tensor.is_floating_point() or tensor.numel() == 0:
        return TensorStats(target.name, target.shape, target.dtype, digest)
    nan = inf = finite = 0
    total = squares = 0.0
    low, high = math.inf, -math.inf
    for block in blocks(tensor):
        x = block.double()
        ok = torch.isfinite(x)
        n_ok = int(ok.sum())
        if n_ok < x.numel():
            nans = int(torch.isnan(x).sum())
            nan, inf = nan + nans, inf + x.numel() - n_ok - nans
            x = x[ok]
        if n_ok:
            finite += n_ok
            total += float(x.sum())
            squares += float((x * x).sum())
            low, high = min(low, float(x.min())), max(high, float(x.max()))
    if not finite:
        return TensorStats(target.name, target.shape, target.dtype, digest, nan=nan, inf=inf)
    return TensorStats(
        target.name, target.shape, target.dtype, digest,
        rms=math.sqrt(squares / finite), mean=total / finite, min=low, max=high, nan=nan, inf=inf,
    )
