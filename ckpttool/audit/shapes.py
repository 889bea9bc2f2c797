"""Names and shapes against the architecture transformers builds from the config, as findings.

Mismatches come from :func:`ckpttool.families.compare_with_model`, each wrong shape with its diagnosis
(:mod:`ckpttool.plan.diagnose`); here every layer range or expert whose tensors are all missing is grouped into one
finding (a pipeline stage or an EP rank not merged) instead of one per tensor.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from ckpttool.console.words import counted
from ckpttool.model.description import ModelInfo
from ckpttool.families import Mismatch
from ckpttool.families.hybrid import grouped_rows_note, layer_kinds_in_words, missing_mixer_cause
from ckpttool.findings import Finding, finding

LAYER_NAME = re.compile(r"^(?P<prefix>.*?\.layers)\.(?P<index>\d+)\.(?P<rest>.+)$")
EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<rest>.+)$")
#: a vision-language model's vision side, as transformers names it in memory and on disk (Qwen-VL's and GLM-4V's
#: ``visual`` with its merger, LLaVA's, Gemma 3's and Mistral 3's ``vision_tower``, Llama 4's ``vision_model``, and
#: the ``multi_modal_projector``)
VISION_SIDE = re.compile(r"^(?P<prefix>(?:model\.)?(?:visual|vision_tower|vision_model|multi_modal_projector))\.")


def shape_findings(mismatches: Iterable[Mismatch], model: ModelInfo) -> list[Finding]:
    """Mismatches as findings: whole missing layers and experts grouped, wrong shapes with their diagnosis."""
    mismatches = list(mismatches)
    missing = {m.name for m in mismatches if m.kind == "missing"}
    found: list[Finding] = []
    grouped: set[str] = set()
    if missing:  # grouping walks every expected name: 90k of DeepSeek-V3's, for nothing when none is missing
        grouped = _missing_layers(missing, model.disk_shapes, found, model)
        grouped |= _missing_experts(missing - grouped, model.disk_shapes, found)
    tie = model.config.get("tie_word_embeddings")
    for m in mismatches:
        if m.kind == "missing" and m.name not in grouped:
            if m.name.endswith("lm_head.weight") and not tie:
                found.append(finding(
                    "tie-mismatch",
                    f"'{m.name}' is missing, but tie_word_embeddings is {json.dumps(tie)}: transformers would "
                    "initialise a random output layer. Restore it, or set tie_word_embeddings to true if the model "
                    "was trained with tied embeddings",
                    tensor=m.name,
                ))
            else:
                # a hybrid layer's missing mixer is one cause across the layers of its kind, worded here
                cause = missing_mixer_cause(m.name, model.model_type, model.config)
                found.append(finding("tensor-missing", m.message(), tensor=m.name,
                                     detail=(("cause", cause),) if cause else ()))
        elif m.kind == "unexpected":
            found.append(finding("tensor-unexpected", m.message(), tensor=m.name))
        elif m.kind == "shape":
            assert m.diagnosis is not None
            # a gated DeltaNet's grouped projection: what its rows say about the cut (whole key-head groups or not)
            note = grouped_rows_note(m.name, tuple(m.shape or ()), tuple(m.expected or ()), model.config)
            found.append(finding(m.diagnosis.code, m.message() + note, tensor=m.name))
    return found


def _missing_layers(missing: set[str], expected: Mapping[str, object], found: list[Finding],
                    model: ModelInfo) -> set[str]:
    grouped: set[str] = set()
    for prefix, by_index, gone in _wholly_missing(missing, expected, LAYER_NAME):
        if VISION_SIDE.match(prefix) and len(gone) == len(by_index):
            continue  # no layer of a vision tower: the tower is missing, one cause with its other tensors (causes.py)
        for start, end in _ranges(gone):
            names = [n for i in range(start, end + 1) for n in by_index[i]]
            grouped.update(names)
            span = f"{start}..{end}" if end > start else str(start)
            kinds = layer_kinds_in_words(list(range(start, end + 1)), model.model_type, model.config)  # a hybrid's layers: which kind
            present = sorted(set(by_index) - set(gone))
            found.append(finding(
                "layers-missing",
                f"layers {span}{kinds} of '{prefix}' are missing entirely ({counted(len(names), 'tensor')}; present: "
                f"{_spans(present) or 'none'} of {counted(len(by_index), 'layer')}): a pipeline stage missing?",
                tensor=f"{prefix}.{span}",
            ))
    return grouped


def _missing_experts(missing: set[str], expected: Mapping[str, object], found: list[Finding]) -> set[str]:
    grouped: set[str] = set()
    for prefix, by_index, gone in _wholly_missing(missing, expected, EXPERT_NAME):
        for e in gone:
            grouped.update(by_index[e])
            found.append(finding(
                "expert-missing",
                f"expert {e} of '{prefix}' is missing entirely ({counted(len(by_index[e]), 'tensor')}; "
                f"{len(by_index) - len(gone)} of {counted(len(by_index), 'expert')} present)",
                tensor=f"{prefix}.{e}",
            ))
    return grouped


def _wholly_missing(
    missing: set[str], expected: Iterable[str], pattern: re.Pattern[str]
) -> list[tuple[str, dict[int, list[str]], list[int]]]:
    """Expected names grouped by ``pattern``'s prefix and index (a layer, an expert), with the sorted indices
    whose every expected tensor is missing."""
    groups: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for name in expected:
        match = pattern.match(name)
        if match:
            groups[match["prefix"]][int(match["index"])].append(name)
    return [
        (prefix, by_index, sorted(i for i, names in by_index.items() if all(n in missing for n in names)))
        for prefix, by_index in groups.items()
    ]


def _ranges(indices: Sequence[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][1] == i - 1:
            out[-1] = (out[-1][0], i)
        else:
            out.append((i, i))
    return out


def _spans(indices: Sequence[int]) -> str:
    return ", ".join(f"{a}..{b}" if b > a else str(a) for a, b in _ranges(indices))
