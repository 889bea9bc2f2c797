"""Quantized checkpoints in the audit: the header checks of :mod:`ckpttool.quant.checks` as findings, the
scales' data, streamed (a NaN, infinite, zero or negative scale turns a whole block of weights into NaN, Inf,
zeros or their negatives, whatever the stored values), and the plan the data checks read, in which each quantized
weight is its dequantized values (:func:`data_plan`)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import torch_dtype
from ckpttool.plan.plan import Plan, Target
from ckpttool.findings import Finding, finding
from ckpttool.families.source import Planned, dequantized_targets
from ckpttool.quant.checks import Problem
from ckpttool.quant.formats import E8M0_NAN, SCALES_SUFFIX, links
from ckpttool.audit.stats import blocks, fold


def quantization_findings(problems: Sequence[Problem]) -> list[Finding]:
    """Each problem of the plan's quantized tensors (:attr:`ckpttool.families.source.Planned.quantization`) as a finding."""
    return [finding(p.code, p.message, tensor=p.tensor) for p in problems]


class ScaleCheck:
    """Counts of NaN, infinite, zero and negative scales of one scale tensor. Bytes (``U8``) are E8M0 exponents,
    whose only invalid value is 0xFF (NaN): E8M0 has neither zero nor sign."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.counts = {"NaN": 0, "infinite": 0, "zero": 0, "negative": 0}
        self.total = 0
        self.first: int | None = None  # the flat index of the first invalid scale, to name its block

    def add(self, chunk: torch.Tensor) -> None:
        for block in blocks(chunk):
            at = self.total
            self.total += block.numel()
            if block.dtype == torch.uint8:
                if int(block.max()) == E8M0_NAN:  # the largest byte: none is NaN unless the largest is
                    self._count("NaN", block == E8M0_NAN, at)
                continue
            x = block.float()
            lo, hi = torch.aminmax(x)  # NaN in a block makes both NaN
            if float(lo) > 0 and float(hi) < math.inf:  # every scale positive and finite (most): nothing to count
                continue
            self._count("NaN", torch.isnan(x), at)
            self._count("infinite", torch.isinf(x), at)
            self._count("zero", x == 0, at)
            self._count("negative", x < 0, at)

    def _count(self, kind: str, mask: torch.Tensor, at: int) -> None:
        n = int(mask.sum())
        if n:
            self.counts[kind] += n
            first = at + int(mask.nonzero()[0, 0])
            self.first = first if self.first is None else min(self.first, first)

    def add_bytes(self, view: memoryview) -> None:
        """A chunk's bytes, read straight from its file: float32 or E8M0 scales that are all valid are told by
        numpy's min and max, without a tensor (a scale tensor of a small checkpoint is a few values); any other
        chunk is counted by :meth:`add`."""
        import numpy as np  # here, not at import: ``merge --dry-run`` never needs it

        dtype = self.target.dtype
        if dtype == "F32":
            x = np.frombuffer(view, dtype=np.float32)
            if x.size and x.min() > 0 and x.max() < math.inf:  # NaN fails both
                self.total += x.size
                return
        elif dtype in ("U8", "F8_E8M0"):
            x = np.frombuffer(view, dtype=np.uint8)
            if x.size and x.max() != E8M0_NAN:
                self.total += x.size
                return
        elif dtype in _HALF_LIMITS:  # as bit patterns: positive and finite is above 0 and below +inf's
            x = np.frombuffer(view, dtype=np.uint16)
            if x.size and x.min() > 0 and x.max() < _HALF_LIMITS[dtype]:
                self.total += x.size
                return
        self.add(torch.frombuffer(view, dtype=torch.uint8).view(torch_dtype(dtype)))

    def result(self) -> Finding | None:
        bad = [f"{n} {kind}" for kind, n in self.counts.items() if n]
        if not bad:
            return None
        return finding(
            "quant-scale-invalid",
            f"'{self.target.name}': {', '.join(bad)} of its {self.total} scales: every value of those blocks "
            "dequantizes to NaN, infinity, zero or its own negative, whatever is stored. Quantize those blocks again "
            f"from the original weights{self._where()}",
            tensor=self.target.name,
        )

    def _where(self) -> str:
        """The first invalid scale's index, and the block of values it scales, in words."""
        if self.first is None or not self.target.shape:
            return ""
        index, rest = [], self.first
        for size in reversed(self.target.shape):
            rest, i = divmod(rest, size)
            index.append(i)
        index.reverse()
        if len(index) < 2:
            return f" (the first is {index})"
        *lead, a, b = index
        if self.target.name.endswith(SCALES_SUFFIX):  # MXFP4 [..., R, G]: one scale per group of 32 in a row
            words = f"row {a}, group {b}"
        else:  # FP8 [..., O/B0, I/B1]
            words = f"row block {a}, column block {b}"
        expert = f"expert {lead[-1]}, " if lead else ""
        return f" (the first is {index}: {expert}{words})"


#: the bit pattern of +inf of the 16-bit float dtypes: a positive finite value's bits lie between 0 and it
_HALF_LIMITS = {"BF16": 0x7F80, "F16": 0x7C00}


def scale_findings(plan: Plan, scales: set[str]) -> list[Finding]:
    """Stream the scale tensors ``scales`` of ``plan`` and report the invalid ones."""
    targets = tuple(t for t in plan.targets if t.name in scales)
    if not targets:
        return []
    return [f for f in fold(replace(plan, targets=targets), ScaleCheck) if f is not None]


def data_plan(plan: Plan, planned: Planned) -> Plan:
    """``plan`` (the audit's, kept quantized) with each quantized weight and its scales replaced by the weight
    dequantized to float32, computed in row chunks as a merge given ``dtype="float32"`` computes it, so the data
    checks (NaN/Inf, zero and constant tensors, identical experts, outliers) judge the values a loader gets, not the
    stored FP8 or FP4 codes. Every other target stays as it is (its fingerprint too). ``plan`` itself when nothing
    is quantized, or the quantization has header problems (reported by :func:`quantization_findings`)."""
    if planned.config is None or planned.quantization or not links(t.name for t in plan.targets)[0]:
        return plan
    computed = {t.name: t for t in dequantized_targets(planned, "F32")}
    found = {link.weight: link for link in links(t.name for t in plan.targets)[0] if link.logical in computed}
    dropped = {link.scale for link in found.values()}
    targets = [computed[found[t.name].logical] if t.name in found else t for t in plan.targets if t.name not in dropped]
    return replace(plan, targets=tuple(targets))
