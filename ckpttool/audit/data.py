"""The data checks: what the streamed statistics of every tensor say, and whether replicated pieces agree.

:func:`data_findings` judges the :class:`~ckpttool.findings.TensorStats` that :mod:`.stats` folds from the
tensor data (NaN/Inf, zero or constant tensors, identical experts, per-layer RMS outliers);
:func:`replica_findings` compares, byte for byte, the pieces a sharded source holds more than once.
"""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Sequence

from ckpttool.console.words import counted
from ckpttool.fast.deferred import torch
from ckpttool.layout.layout import Layout
from ckpttool.execute.reference import PieceLoader
from ckpttool.findings import Finding, TensorStats, finding
from ckpttool.audit.shapes import EXPERT_NAME, LAYER_NAME

#: a tensor's RMS this many times above or below the median of its layer group is an outlier
OUTLIER_FACTOR = 10.0


def data_findings(stats: Sequence[TensorStats]) -> list[Finding]:
    """NaN/Inf, zero and constant tensors, identical experts, per-layer RMS outliers."""
    found: list[Finding] = []
    flat: set[str] = set()
    for s in stats:
        numel = math.prod(s.shape)
        if s.nan:
            found.append(finding("nan", f"'{s.name}' holds {s.nan} NaN values of {numel}", tensor=s.name))
        if s.inf:
            found.append(finding("inf", f"'{s.name}' holds {s.inf} infinite values of {numel}", tensor=s.name))
        if s.min is None or s.max is None or s.min != s.max or numel < 2 or s.nan or s.inf:
            continue
        flat.add(s.name)
        expert = EXPERT_NAME.match(s.name)
        if s.min == 0:
            if len(s.shape) == 1 and s.name.endswith("bias"):
                found.append(finding("zero-bias", f"'{s.name}' is all zeros", tensor=s.name))
            else:
                what = f"expert {expert['index']} is dead: " if expert else ""
                found.append(finding("zero-tensor", f"'{s.name}' is all zeros ({what}{numel} elements)", tensor=s.name))
        elif len(s.shape) == 1:
            found.append(finding("constant-vector", f"'{s.name}' is {s.min} everywhere", tensor=s.name))
        else:
            found.append(finding("constant-tensor", f"'{s.name}' is {s.min} everywhere ({numel} elements)", tensor=s.name))
    found.extend(_identical_experts([s for s in stats if s.name not in flat]))
    found.extend(_outliers([s for s in stats if s.name not in flat]))
    return found


def _identical_experts(stats: Sequence[TensorStats]) -> list[Finding]:
    seen: dict[tuple[str, str, str], str] = {}
    found = []
    for s in stats:
        match = EXPERT_NAME.match(s.name)
        if match is None:
            continue
        key = (match["prefix"], match["rest"], s.fingerprint)
        if key in seen:
            found.append(finding("experts-identical", f"'{s.name}' is identical to '{seen[key]}'", tensor=s.name))
        else:
            seen[key] = s.name
    return found


def _outliers(stats: Sequence[TensorStats]) -> list[Finding]:
    groups: dict[str, list[TensorStats]] = defaultdict(list)
    for s in stats:
        match = LAYER_NAME.match(s.name)
        if match is not None and s.rms:
            groups[f"{match['prefix']}.{{L}}.{match['rest']}"].append(s)
    found = []
    for pattern, members in groups.items():
        if len(members) < 4:
            continue
        median = statistics.median(s.rms for s in members if s.rms)
        for s in members:
            assert s.rms is not None
            ratio = s.rms / median
            if ratio > OUTLIER_FACTOR or ratio < 1 / OUTLIER_FACTOR:
                found.append(finding(
                    "norm-outlier",
                    f"'{s.name}' has RMS {s.rms:.4g}, {ratio:.3g}x the median {median:.4g} of '{pattern}' over "
                    f"{counted(len(members), 'layer')}",
                    tensor=s.name,
                ))
    return found


def replica_findings(layout: Layout) -> list[Finding]:
    """Pieces with the same box (a tensor every TP rank holds) must hold the same bytes."""
    found = []
    loader = PieceLoader(layout.root)
    for tensor in layout.tensors.values():
        by_box: dict[object, list] = defaultdict(list)
        for piece in tensor.pieces:
            by_box[piece.box].append(piece)
        for pieces in by_box.values():
            if len(pieces) < 2:
                continue
            first = loader.load(pieces[0])
            for other in pieces[1:]:
                data = loader.load(other)
                if torch.equal(first.reshape(-1).view(torch.uint8), data.reshape(-1).view(torch.uint8)):
                    continue
                delta = (first.double() - data.double()).abs().max().item() if first.is_floating_point() else None
                found.append(finding(
                    "replica-divergence",
                    f"'{tensor.fqn}': the copies in {pieces[0].where()} and {other.where()} differ"
                    + (f" (max |difference| {delta:.4g})" if delta is not None else ""),
                    tensor=tensor.fqn, file=other.file, detail=(("reference", pieces[0].file),),
                ))
    return found
