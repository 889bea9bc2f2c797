"""``audit``: the pre-release gate. Every problem of a checkpoint as a finding, never a first-error exit.

The audit reads any source ``merge`` reads. It checks, in order: the files and index (HuggingFace
directories); what the source recorded (coverage of every tensor, padding); names and shapes against the
architecture transformers builds from ``config.json``, with a diagnosis of every wrong shape; the config's
consistency with the weights (vocab, tied embeddings, dtypes, tokenizer); and, unless ``data=False``, the
tensor data itself, one tensor at a time (NaN/Inf, zero or constant tensors, identical experts, per-layer
RMS outliers, diverging replicas).
"""

from __future__ import annotations

import json
import logging
import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

import torch

from . import jsonfile
from .dtypes import FLOAT_DTYPES, dtype_name
from .errors import CoverageError, SourceError
from .executor import PieceLoader
from .findings import Finding, Report, TensorStats, finding, sort_findings
from .layout import Layout
from .loadable import config_findings
from .paths import JSON_LIMIT, read_source
from .config_sizes import census, check_config_sizes
from .models import Mismatch, ModelInfo, compare_with_model, find_config, map_to_hf, model_info, read_config
from .plan import Plan, Target, TargetSpec, identity_specs, plan_merge
from .readers import detect_format, hf, read_layout
from .stats import Statistics, fold
from .writer import find_extras

log = logging.getLogger(__name__)

LAYER_NAME = re.compile(r"^(?P<prefix>.*?\.layers)\.(?P<index>\d+)\.(?P<rest>.+)$")
EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<index>\d+)\.(?P<rest>.+)$")
#: a tensor's RMS this many times above or below the median of its layer group is an outlier
OUTLIER_FACTOR = 10.0


def audit(
    src: str | Path,
    *,
    config: str | Path | None = None,
    format: str | None = None,
    data: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """Audit a checkpoint (any format ``merge`` reads) and return every finding.

    Args:
        src: the checkpoint directory.
        config: ``config.json`` or a directory holding it; found in or next to ``src`` when None.
        format: reader name; detected when None.
        data: read tensor data (NaN/Inf, zeros, identical experts, outliers, replicas); False reads only
            headers and metadata.
        progress: called as ``progress(bytes_just_read, total_bytes)`` during the data checks.

    Raises:
        SourceError, ConfigError: the input cannot be read at all (exit 1), as opposed to findings (exit 3).

    Example:
        >>> report = audit("out/llama")  # doctest: +SKIP
        >>> [f.code for f in report.errors]  # doctest: +SKIP
    """
    root = Path(src)
    model = None
    config_path = find_config(root, config)
    config_dict = read_config(config_path) if config_path is not None else None
    if config_dict is not None:  # absurd sizes are refused before transformers spends minutes on them
        check_config_sizes(config_dict, str(config_path), lambda: census(root, format))
        model = model_info(config_dict, label=str(config_path))
    return check(root, config_path=config_path, config=config_dict, model=model, format=format, data=data,
                 progress=progress)


def check(
    root: Path,
    *,
    config_path: Path | None,
    config: Mapping[str, object] | None,
    model: ModelInfo | None,
    format: str | None = None,
    data: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Report:
    """:func:`audit` with the config already found and the architecture already built (the merge's case)."""
    fmt = format or detect_format(root)
    found: list[Finding] = []
    if fmt == hf.NAME:
        scan = hf.scan(root)
        layout = scan.layout
        found.extend(scan.findings)
    else:
        layout = read_layout(root, format=fmt, model=model)
    found.extend(finding("source-note", note) for note in layout.notes)
    found.extend(_padding(layout))

    tied: list[TargetSpec] = []
    if model is not None:
        mapping = map_to_hf(layout, model)
        specs, tied = mapping.specs, mapping.tied
        found.extend(finding("source-note", note) for note in mapping.notes)
        found.extend(finding("shape-mismatch", message, tensor=fqn) for fqn, message in mapping.problems)
    else:
        specs = identity_specs(layout)
    found.extend(config_findings(root, fmt, config, checked=model is not None))
    plan, coverage = _plan(layout, [*specs, *tied])
    found.extend(coverage)
    if not specs and not coverage:
        found.append(finding("no-weights", f"'{root}' holds no model tensors"))
    if model is not None:
        found.extend(shape_findings(compare_with_model({s.name: s.shape for s in specs}, model), model))
    found.extend(_dtypes(plan.targets, config))
    found.extend(_tokenizer(root, config_path, config))

    stats: list[TensorStats] = []
    if data:
        total = plan.nbytes
        stats = fold(plan, Statistics, (lambda n: progress(n, total)) if progress else (lambda n: None))
        found.extend(data_findings(stats))
        found.extend(_replicas(layout))
    if model is not None:
        found.extend(_tied(tied, model, {s.name: s for s in stats}, data))
    return Report(
        source=str(root),
        format=fmt,
        config=str(config_path) if config_path else None,
        model_type=model.model_type if model else None,
        data_checked=data,
        tensors=len(specs) + len(tied),
        findings=sort_findings(found),
        stats=tuple(stats),
    )


def _plan(layout: Layout, specs: Sequence[TargetSpec]) -> tuple[Plan, list[Finding]]:
    """The plan of every tensor that is covered exactly once; a coverage finding for each one that is not."""
    targets: list[Target] = []
    found: list[Finding] = []
    for spec in specs:
        try:
            targets.extend(plan_merge(layout, [spec]).targets)
        except CoverageError as e:
            files = sorted({p.file for sl in spec.slices for p in layout.absent.get(sl.source, ())})
            for problem in e.problems:
                found.append(finding("coverage", problem, tensor=spec.name, file=files[0] if files else None))
    return Plan(layout.root, layout.format, tuple(targets), tuple(layout.notes)), found


def _padding(layout: Layout) -> list[Finding]:
    return [
        finding("padding-recorded", f"'{t.fqn}': dim {pad.dim} padded to {t.global_shape[pad.dim]}, true size "
                f"{pad.true_size}; a merge strips rows {pad.true_size}..{t.global_shape[pad.dim]}", tensor=t.fqn)
        for t in layout.tensors.values() for pad in t.padding
    ]


def shape_findings(mismatches: Iterable[Mismatch], model: ModelInfo) -> list[Finding]:
    """Mismatches as findings: whole missing layers and experts grouped, wrong shapes with their diagnosis."""
    mismatches = list(mismatches)
    missing = {m.name for m in mismatches if m.kind == "missing"}
    found: list[Finding] = []
    grouped = _missing_layers(missing, model.disk_shapes, found)
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
                found.append(finding("tensor-missing", m.message(), tensor=m.name))
        elif m.kind == "unexpected":
            found.append(finding("tensor-unexpected", m.message(), tensor=m.name))
        elif m.kind == "shape":
            assert m.diagnosis is not None
            found.append(finding(m.diagnosis.code, m.message(), tensor=m.name))
    return found


def _missing_layers(missing: set[str], expected: Mapping[str, object], found: list[Finding]) -> set[str]:
    grouped: set[str] = set()
    for prefix, by_index, gone in _wholly_missing(missing, expected, LAYER_NAME):
        for start, end in _ranges(gone):
            names = [n for i in range(start, end + 1) for n in by_index[i]]
            grouped.update(names)
            span = f"{start}..{end}" if end > start else str(start)
            present = sorted(set(by_index) - set(gone))
            found.append(finding(
                "layers-missing",
                f"layers {span} of '{prefix}' are missing entirely ({len(names)} tensors; present: "
                f"{_spans(present) or 'none'} of {len(by_index)} layers): a pipeline stage missing?",
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
                f"expert {e} of '{prefix}' is missing entirely ({len(by_index[e])} tensors; "
                f"{len(by_index) - len(gone)} of {len(by_index)} experts present)",
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


def _dtypes(targets: Sequence[Target], config: Mapping[str, object] | None) -> list[Finding]:
    floats = Counter(t.dtype for t in targets if t.dtype in FLOAT_DTYPES)
    if not floats:
        return []
    main, count = floats.most_common(1)[0]
    total = sum(floats.values())
    found = []
    if len(floats) > 1 and count > total / 2:
        found.extend(
            finding("dtype-mix", f"'{t.name}' is {t.dtype}, but {count} of {total} floating-point tensors are {main}",
                    tensor=t.name)
            for t in targets if t.dtype in FLOAT_DTYPES and t.dtype != main
        )
    elif len(floats) > 1:
        found.append(finding("dtype-mix", f"floating-point tensors come in several dtypes: {dict(floats)}"))
    declared = (config or {}).get("dtype") or (config or {}).get("torch_dtype")
    if isinstance(declared, str) and declared != "auto":
        try:
            name = dtype_name(declared)
        except SourceError:
            name = None
        if name is not None and name != main:
            found.append(finding("config-dtype", f"config.json says dtype {declared}, but the weights are {main}",
                                 file="config.json"))
    return found


def _tokenizer(root: Path, config_path: Path | None, config: Mapping[str, object] | None) -> list[Finding]:
    extras, skipped = find_extras([root] + ([config_path.parent] if config_path is not None else []))
    found = [finding("file-link-outside", f"'{path.name}' is a symlink to '{path.resolve()}', outside the checkpoint: "
                     "not read, and a merge does not copy it", file=path.name) for path in skipped]
    vocab = (config or {}).get("vocab_size")
    path = next((p for p in extras if p.name == "tokenizer.json"), None)
    if not isinstance(vocab, int) or path is None:
        return found
    return found + _tokenizer_size(path, vocab)


def _tokenizer_size(path: Path, vocab: int) -> list[Finding]:
    size = tokenizer_size(path)
    if size is None:
        return [finding("tokenizer-invalid", f"'{path.name}' is not a tokenizer.json with a vocab; its size is not checked",
                        file=path.name)]
    if size > vocab:
        return [finding("tokenizer-vocab", f"'{path.name}' has token ids up to {size - 1}, but vocab_size is {vocab}: "
                        f"ids {vocab}..{size - 1} index past the embedding", file=path.name)]
    if size < vocab:
        return [finding("tokenizer-smaller", f"'{path.name}' has {size} token ids for vocab_size {vocab}", file=path.name)]
    return []


def tokenizer_size(path: Path) -> int | None:
    """One more than the largest token id of a ``tokenizer.json`` (vocab and added tokens), or None when the
    file is not a tokenizer this can read."""
    try:
        doc = jsonfile.loads(read_source(path, limit=JSON_LIMIT))
    except (SourceError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    model = doc.get("model") if isinstance(doc, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids: list[int] = []
    if isinstance(vocab, dict):
        ids.extend(v for v in vocab.values() if isinstance(v, int))
    elif isinstance(vocab, list):
        ids.append(len(vocab) - 1)
    added = doc.get("added_tokens") if isinstance(doc, dict) else None
    ids.extend(t["id"] for t in added or () if isinstance(t, dict) and isinstance(t.get("id"), int))
    return max(ids) + 1 if ids else None


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
                    f"{len(members)} layers",
                    tensor=s.name,
                ))
    return found


def _replicas(layout: Layout) -> list[Finding]:
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
                    tensor=tensor.fqn, file=other.file,
                ))
    return found


def _tied(tied: Sequence[TargetSpec], model: ModelInfo, stats: Mapping[str, TensorStats], data: bool) -> list[Finding]:
    found = []
    for spec in tied:
        partner = model.tied[spec.name]
        if not data:
            found.append(finding(
                "tie-mismatch",
                f"'{spec.name}' is saved although tie_word_embeddings is true; transformers will use '{partner}' "
                "instead (data not checked)",
                tensor=spec.name, severity="warning",
            ))
        elif spec.name in stats and partner in stats:
            if stats[spec.name].fingerprint == stats[partner].fingerprint:
                found.append(finding("tied-copy", f"'{spec.name}' is saved although tied; it equals '{partner}'",
                                     tensor=spec.name))
            else:
                found.append(finding(
                    "tie-mismatch",
                    f"'{spec.name}' differs from '{partner}', but tie_word_embeddings is true: transformers will "
                    f"load '{partner}' as the output layer and drop the trained one. Set tie_word_embeddings to false",
                    tensor=spec.name,
                ))
    return found


