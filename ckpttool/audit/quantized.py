"""Quantized checkpoints in the audit: the header checks of :mod:`ckpttool.quant.checks` as findings, and the
scales' data, streamed: a NaN, infinite, zero or negative scale turns a whole block of weights into NaN, Inf,
zeros or their negatives, whatever the stored values."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from ..engine.plan import Plan, Target
from ..findings import Finding, finding
from ..quant.checks import Problem
from ..quant.formats import E8M0_NAN
from .stats import blocks, fold


def quantization_findings(problems: Sequence[Problem]) -> list[Finding]:
    """Each problem of the plan's quantized tensors (:attr:`ckpttool.planning.Planned.quantization`) as a finding."""
    return [finding(p.code, p.message, tensor=p.tensor) for p in problems]


class ScaleCheck:
    """Counts of NaN, infinite, zero and negative scales of one scale tensor. Bytes (``U8``) are E8M0 exponents,
    whose only invalid value is 0xFF (NaN): E8M0 has neither zero nor sign."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.counts = {"NaN": 0, "infinite": 0, "zero": 0, "negative": 0}
        self.total = 0

    def add(self, chunk: torch.Tensor) -> None:
        for block in blocks(chunk):
            self.total += block.numel()
            if block.dtype == torch.uint8:
                self.counts["NaN"] += int((block == E8M0_NAN).sum())
                continue
            x = block.float()
            self.counts["NaN"] += int(torch.isnan(x).sum())
            self.counts["infinite"] += int(torch.isinf(x).sum())
            self.counts["zero"] += int((x == 0).sum())
            self.counts["negative"] += int((x < 0).sum())

    def result(self) -> Finding | None:
        bad = [f"{n} {kind}" for kind, n in self.counts.items() if n]
        if not bad:
            return None
        return finding(
            "quant-scale-invalid",
            f"'{self.target.name}': {', '.join(bad)} of its {self.total} scales: every value of those blocks "
            "dequantizes to NaN, infinity, zero or its own negative, whatever is stored. Quantize those blocks again "
            "from the original weights",
            tensor=self.target.name,
        )


def scale_findings(plan: Plan, scales: set[str]) -> list[Finding]:
    """Stream the scale tensors ``scales`` of ``plan`` and report the invalid ones."""
    targets = tuple(t for t in plan.targets if t.name in scales)
    if not targets:
        return []
    return [f for f in fold(replace(plan, targets=targets), ScaleCheck) if f is not None]
