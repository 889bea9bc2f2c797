"""``audit``: the pre-release gate. Every problem of a checkpoint as a finding, never a first-error exit.

The audit reads any source ``merge`` reads. It checks, in order: the files and index (HuggingFace
directories); what the source recorded (coverage of every tensor, padding); names and shapes against the
architecture transformers builds from ``config.json``, with a diagnosis of every wrong shape; the config's
consistency with the weights (vocab, tied embeddings, dtypes, tokenizer); and, unless ``data=False``, the
tensor data itself, one tensor at a time (NaN/Inf, zero or constant tensors, identical experts, per-layer
RMS outliers, diverging replicas).

This module holds the order of the checks (:func:`audit`, :func:`check`) and what the source recorded
(coverage, padding); each other kind of check has its own room:

- :mod:`.shapes`: names and shapes against the architecture (missing layers and experts grouped);
- :mod:`.config`: the config's consistency with the weights (config.json, dtypes, tokenizer, tied embeddings);
- :mod:`.stats`: tensor data streamed into fingerprints and statistics (``diff`` uses it too);
- :mod:`.data`: the data checks on those statistics, and diverging replicas;
- :mod:`.mtp`: MTP layers present but never trained (initial values, copies of a main layer);
- :mod:`.vocab_rows`: rows of the embedding and head past the tokenizer that copy real rows;
- :mod:`.norms`: norm weights against the model type's convention (``w`` or Gemma's ``1 + w``);
- :mod:`.quantized`: FP8 and MXFP4 scales against their weights and the config, and the scales' data;
- :mod:`.causes`: the findings grouped by root cause (a missing file, a diverged replica, an expert);
- :mod:`.report_html`: the report as one self-contained HTML page.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from ckpttool.errors import ConfigError
from ckpttool.model.description import ModelInfo
from ckpttool.model.architecture import model_info
from ckpttool.model.config_file import find_config, read_config
from ckpttool.model.config_sizes import check_config_sizes
from ckpttool.layout.layout import Layout
from ckpttool.plan.plan import TargetSpec, plan_covered
from ckpttool.families import READER_TABLES, mtp_missing_note, reduced_layers
from ckpttool.families.quantized import companion_names, scale_names
from ckpttool.findings import Finding, Report, TensorStats, finding, sort_findings
from ckpttool.families.source import plan_layout
from ckpttool.lora.embedded import split_embedded
from ckpttool.readers import census, detect_format, hf, hf_distributed, read_layout
from ckpttool.readers.dcp import locating_deferred
from ckpttool.audit.causes import group_findings
from ckpttool.audit.config import (
    checkpoint_tokenizer_size,
    config_findings,
    dtype_findings,
    tie_findings,
    tokenizer_findings,
    unloadable_findings,
)
from ckpttool.audit.data import data_findings, replica_findings
from ckpttool.audit.mtp import mtp_findings
from ckpttool.audit.norms import norm_findings
from ckpttool.audit.quantized import data_plan, quantization_findings, scale_findings
from ckpttool.audit.shapes import shape_findings
from ckpttool.audit.stats import Statistics, fold
from ckpttool.audit.vocab_rows import copied_row_findings

__all__ = ["audit", "check", "config_findings", "data_findings", "shape_findings"]


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
            headers and metadata, and the scale tensors of a quantized checkpoint (one scale per block of
            weights: a NaN, infinite, zero or negative one is an error finding either way).
        progress: called as ``progress(bytes_just_read, total_bytes)`` during the data checks.

    A config transformers cannot load (a key it rejects, an unknown ``model_type`` in a HuggingFace directory) is
    a ``config-invalid`` finding, and the weights are audited without an architecture.

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
    fmt = format or detect_format(root)
    invalid: list[Finding] = []
    if config_path is not None and config_dict is not None:  # absurd sizes refused before transformers spends minutes
        check_config_sizes(config_dict, str(config_path), lambda: census(root, format, tables=READER_TABLES))
        rejected = None
        try:
            model = model_info(config_dict, label=str(config_path), reduce=reduced_layers)
        except ConfigError as e:  # the weights are still audited, as a generic checkpoint
            rejected = e
        if model is None and fmt == hf_distributed.NAME:  # no generic audit: only the config gives its shapes
            raise hf_distributed.undescribed(root, str(config_path), config_dict.get("model_type"),
                                             None if rejected is None else f"transformers cannot use it ({rejected})")
        if model is None:
            invalid = unloadable_findings(config_path, config_dict, rejected, hf_directory=fmt == hf.NAME)
    return check(root, config_path=config_path, config=config_dict, model=model, format=fmt, data=data,
                 progress=progress, read_scales=True, config_problems=invalid)


def check(
    root: Path,
    *,
    config_path: Path | None,
    config: Mapping[str, object] | None,
    model: ModelInfo | None,
    format: str | None = None,
    data: bool = True,
    progress: Callable[[int, int], None] | None = None,
    read_scales: bool = False,
    config_problems: Sequence[Finding] = (),
    defer: bool = True,
) -> Report:
    """:func:`audit` with the config already found and the architecture already built (the merge's case).

    ``defer``: without ``data``, describe a DCP source's items unlocated (:func:`ckpttool.readers.dcp.locating_deferred`:
    seconds at 90k items); when scale tensors are then to be read, the source is described again, located.

    ``read_scales``: read a quantized checkpoint's scale tensors (and report NaN, infinite, zero or negative ones)
    even without ``data``; :func:`audit` does, a merge's audit of what it wrote, whose scales it copied or used,
    does not. ``config_problems``: why transformers cannot load the config (``config-invalid``), if it cannot."""
    fmt = format or detect_format(root)
    found: list[Finding] = list(config_problems)
    if fmt == hf.NAME:
        scan = hf.scan(root)
        layout = scan.layout
        found.extend(scan.findings)
    else:
        with locating_deferred(defer and not data):
            layout = read_layout(root, format=fmt, model=model, tables=READER_TABLES)  # what the conventions tell readers
        embedded = split_embedded(layout)  # a PEFT model saved whole: its base audited, the LoRA tensors set aside
        layout = embedded.base if embedded is not None else layout
    found.extend(finding("source-note", note) for note in layout.notes)
    found.extend(_padding(layout))

    planned = plan_layout(layout, config_path=config_path, config=dict(config) if config is not None else None,
                          model=model, keep_specs=data)  # the specs: the dequantized targets of data_plan
    tied = list(planned.tied)
    # the merge leaves these out with a note in the same words; the source as it stands holds them (a warning)
    found.extend(finding("tensor-unexpected", message, tensor=name) for name, message in planned.historical)
    if model is not None:
        found.extend(finding("source-note", note) for note in planned.adapter_notes)
        found.extend(finding("shape-mismatch", message, tensor=fqn) for fqn, message in planned.unplaced)
    found.extend(config_findings(root, fmt, config, checked=model is not None, invalid=bool(config_problems)))
    tied_plan, tied_uncovered = plan_covered(layout, tied)
    plan = replace(planned.plan, targets=planned.plan.targets + tied_plan.targets)
    coverage = _coverage(layout, [*planned.uncovered, *tied_uncovered])
    found.extend(coverage)
    tensors = len(planned.plan.targets) + len(planned.uncovered)
    if not tensors and not coverage:
        found.append(finding("no-weights", f"'{root}' holds no model tensors"))
    if model is not None:
        found.extend(shape_findings(list(planned.mismatches), model))
        if planned.mtp_missing:
            first, last = planned.mtp_missing[0], planned.mtp_missing[-1]
            found.append(finding("mtp-missing", mtp_missing_note(planned.mtp_missing, model),
                                 tensor=f"model.layers.{first}" + (f"..{last}" if last > first else "")))
    scales = scale_names([t.name for t in plan.targets])
    found.extend(quantization_findings(planned.quantization))
    scales_or_companions = scales | companion_names([t.name for t in plan.targets])
    found.extend(dtype_findings([t for t in plan.targets if t.name not in scales_or_companions], config))
    found.extend(tokenizer_findings(root, config_path, config))

    if scales and read_scales and defer and not data and fmt != hf.NAME:  # read from pieces located (rare: quantized DCP)
        return check(root, config_path=config_path, config=config, model=model, format=fmt, data=data,
                     progress=progress, read_scales=read_scales, config_problems=config_problems, defer=False)
    if data or read_scales:  # scales are few (one per block): read even when the weights are not
        found.extend(scale_findings(plan, scales))
    stats: list[TensorStats] = []
    if data:
        values = data_plan(plan, planned)  # quantized weights as their dequantized values
        total = values.nbytes
        stats = fold(values, Statistics, (lambda n: progress(n, total)) if progress else (lambda n: None))
        found.extend(data_findings(stats))
        found.extend(replica_findings(layout))
        tokens = checkpoint_tokenizer_size(root, config_path)
        if tokens is not None:
            found.extend(copied_row_findings(plan, tokens))
    if model is not None:
        found.extend(tie_findings(tied, model, {s.name: s for s in stats}, data))
        found.extend(norm_findings(stats, model.model_type))
        found.extend(mtp_findings(stats, model))
    findings = sort_findings(found)
    return Report(
        source=str(root),
        format=fmt,
        config=str(config_path) if config_path else None,
        model_type=model.model_type if model else None,
        data_checked=data,
        tensors=tensors + len(tied),
        findings=findings,
        stats=tuple(stats),
        adapter="generic (transformers cannot load the config)" if config_problems else planned.adapter,
        causes=group_findings(findings),
        expected=tuple(model.disk_shapes) if model is not None else (),
    )


def _coverage(layout: Layout, uncovered: Sequence[tuple[TargetSpec, list[str]]]) -> list[Finding]:
    """A coverage finding for each problem of a target not covered exactly once, naming a missing file."""
    found: list[Finding] = []
    for spec, problems in uncovered:
        files = sorted({p.file for sl in spec.slices for p in layout.absent.get(sl.source, ())})
        detail = (("missing_file", ", ".join(files)),) if files else ()
        found.extend(finding("coverage", problem, tensor=spec.name, file=files[0] if files else None, detail=detail)
                     for problem in problems)
    return found


def _padding(layout: Layout) -> list[Finding]:
    return [
        finding("padding-recorded", f"'{t.fqn}': dim {pad.dim} padded to {t.global_shape[pad.dim]}, true size "
                f"{pad.true_size}; a merge strips rows {pad.true_size}..{t.global_shape[pad.dim]}", tensor=t.fqn)
        for t in layout.tensors.values() for pad in t.padding
    ]
