"""Findings grouped by root cause: one :class:`~ckpttool.findings.Cause` per thing to fix, its tensors under it.

The checks report symptoms tensor by tensor: one missing rank file leaves every tensor it held uncovered, one
router that diverged on 7 ranks gives 7 findings per layer. A cause gathers the findings one fix removes:

- a ``missing_file`` in a finding's detail: "file '__1_0.distcp' is missing: 29 tensors uncovered";
- a ``cause`` in a finding's detail, which the check words itself ("norms saved as plain w in a gemma model");
- diverging replicas of one tensor across layers: "'model.layers.{L}.mlp.gate.weight' diverges between rank 0
  and ranks 1-7 in layers 0-60";
- anything about an expert (missing, dead, NaN): one cause per expert index across the layers;
- a shared expert's missing tensors: one cause per shared expert across the layers;
- a vision-language model's missing vision tower, projector or merger tensors: one cause per tower (``visual``,
  ``vision_tower``, ``vision_model``, ``multi_modal_projector``: :data:`~.shapes.VISION_SIDE`), whatever blocks or
  layers they are in (a tower without any of its layers is no missing pipeline stage);
- otherwise the same code on the same tensor of several layers: "'model.layers.{L}.mlp.up_proj.weight' in layers
  0-3".

A finding that names no tensor, or that no other finding shares a cause with, is a cause of its own worded as
the finding. Every finding is in exactly one cause, so no cause hides a finding.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

from ckpttool.console.words import counted
from ckpttool.findings import CODES, SEVERITIES, Cause, Finding, sort_findings
from ckpttool.audit.shapes import LAYER_NAME, VISION_SIDE

#: an expert's tensor, or the expert itself (``expert-missing`` names ``...experts.3``)
_EXPERT = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)(?:\.(?P<rest>.+))?$")
_SHARED = re.compile(r"^(?P<prefix>.*\.shared_experts?)\.(?P<rest>.+)$")
#: a rank in a file name: DCP's ``__3_0.distcp``, Megatron's and DeepSpeed's ``mp_rank_03``, verl's ``rank_3``, a sidecar's ``rank-00003``
_RANK = re.compile(r"(?:^__|rank[-_])(\d+)")


def group_findings(findings: Iterable[Finding]) -> tuple[Cause, ...]:
    """The findings grouped by cause, errors first, each cause in the order of its first finding.

    Example:
        >>> causes = group_findings(report.findings)  # doctest: +SKIP
        >>> causes[0].cause  # doctest: +SKIP
        "file '__1_0.distcp' is missing: 20 tensors uncovered"
    """
    groups: dict[tuple[str | None, ...], list[Finding]] = {}
    for f in findings:
        groups.setdefault(_key(f), []).append(f)
    causes = [_cause(key, members) for key, members in groups.items()]
    return tuple(sorted(causes, key=lambda c: SEVERITIES.index(c.severity)))


def span(indices: Iterable[int]) -> str:
    """Sorted indices as compressed ranges: ``[0, 1, 2, 5, 7, 8]`` -> ``"0-2, 5, 7-8"``."""
    ranges: list[list[int]] = []
    for i in sorted(set(indices)):
        if ranges and ranges[-1][1] == i - 1:
            ranges[-1][1] = i
        else:
            ranges.append([i, i])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in ranges)


def _key(f: Finding) -> tuple[str | None, ...]:
    detail = dict(f.detail)
    if "missing_file" in detail:
        return (f.code, "file", detail["missing_file"])
    if "cause" in detail:  # the check named the cause itself
        return (f.code, "named", detail["cause"])
    if f.tensor is None:
        return (f.code, "message", f.message)
    pattern = _layer_pattern(f.tensor)
    if f.code == "replica-divergence":
        return (f.code, "replica", pattern, detail.get("reference"))
    expert = _EXPERT.match(pattern)
    if expert:
        return (f.code, "expert", expert["prefix"], expert["index"])
    shared = _SHARED.match(pattern)
    if shared and f.code == "tensor-missing":
        return (f.code, "shared", shared["prefix"])
    tower = VISION_SIDE.match(f.tensor)
    if tower and f.code == "tensor-missing":
        return (f.code, "tower", tower["prefix"])
    return (f.code, "tensor", pattern)


def _cause(key: tuple[str | None, ...], members: Sequence[Finding]) -> Cause:
    code, kind = str(key[0]), key[1]
    tensors = tuple(dict.fromkeys(f.tensor for f in members if f.tensor))
    severity = sort_findings(members)[0].severity
    layers = _layers(tensors)
    n = counted(len(tensors), "tensor")
    if kind == "file":
        files = str(key[2]).split(", ")
        text = (f"file{'s' if len(files) > 1 else ''} {', '.join(map(repr, files))} "
                f"{'are' if len(files) > 1 else 'is'} missing: {n} uncovered")
    elif kind == "replica":
        reference = _ranks([key[3]] if key[3] else [])
        copies = _ranks(f.file for f in members if f.file)
        between = f" between {reference} and {copies}" if reference else f" in {copies}"
        text = f"'{key[2]}' diverges{between}{layers}"
    elif kind == "named":
        text = f"{key[2]}: {n}{layers}"
    elif len(members) == 1:
        text = members[0].message
    elif kind == "expert":
        text = f"expert {key[3]} of '{key[2]}'{layers} ({n}): {CODES[code][1]}"
    elif kind == "tower":
        text = (f"the vision side '{key[2]}' of a vision-language model is missing ({n}); the config declares it "
                "(was only the language model saved?)")
    elif kind == "shared":
        text = f"shared expert '{key[2]}' is missing{layers} ({n}); the config declares it"
    else:
        text = f"'{key[2]}'{layers} ({n}): {CODES[code][1]}"
    return Cause(code, severity, text, tensors, tuple(members))


def _layer_pattern(name: str) -> str:
    match = LAYER_NAME.match(name)
    return f"{match['prefix']}.{{L}}.{match['rest']}" if match else name


def _layers(tensors: Sequence[str]) -> str:
    indices = [int(m["index"]) for m in map(LAYER_NAME.match, tensors) if m]
    if not indices:
        return ""
    return f" in layer{'s' if len(set(indices)) > 1 else ''} {span(indices)}"


def _ranks(files: Iterable[str]) -> str:
    """``rank 0``, ``ranks 1-7``, or the files quoted when their names carry no rank."""
    files = sorted(set(files))
    ranks = [_RANK.search(f.rsplit("/", 1)[-1]) or _RANK.search(f) for f in files]
    if files and all(ranks):
        numbers = [int(m[1]) for m in ranks if m]
        return f"rank{'s' if len(set(numbers)) > 1 else ''} {span(numbers)}"
    return ", ".join(f"'{f}'" for f in files)
