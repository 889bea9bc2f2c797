"""Finishing a merged output once its weights are written: the index, ``config.json`` (its dtype: :func:`config_dtype`)
and the tokenizer files, the audit of what was written (with a LoRA fuse's proof), the forward check when asked,
then the publish (:func:`finish_output`). The merge, the split and ``live`` end with it."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ckpttool.errors import AuditError, ConfigError, ForwardError, SourceError
from ckpttool.families.quantize import output_config as quantized_config
from ckpttool.families.quantized import output_config, scale_names
from ckpttool.fast.jsontext import dumps as json_text
from ckpttool.findings import Finding, Report, sort_findings
from ckpttool.io.dtypes import dtype_name, prevailing_float
from ckpttool.model.description import ModelInfo
from ckpttool.model.config_file import read_config
from ckpttool.plan.plan import Plan
from ckpttool.writers.destination import AUDIT_FILE
from ckpttool.writers.files import OutputFile
from ckpttool.writers.hf import write_extras, write_index
from ckpttool.writers.journal import write_text
from ckpttool.writers.staging import Staging

__all__ = ["config_dtype", "finish_output"]


def finish_output(
    staging: Staging, plan: Plan, files: tuple[OutputFile, ...], *, config: dict[str, object] | None,
    model: ModelInfo | None, config_label: str | None, search: list[Path], dtype: str | None, audit: bool,
    verify_forward: bool = False,
) -> tuple[list[str], Report | None]:
    """Once every weights file is written and checked: the index, config and tokenizer files, the audit of
    what was written, then the rename into place. Returns the extra files written and the audit report."""
    path = staging.path
    write_index(plan, files, path)
    dequantizing = any(t.dequant is not None for t in plan.targets)
    dtype_written = config_dtype(config, plan, cast=dtype is not None)
    written = write_extras(path, quantized_config(output_config(config, dequantizing), plan), search, dtype_written)
    found = None
    if audit:
        fused = _fuse_findings(plan, files, path)
        found = _audit_output(path, staging.dest, config is not None, config_label, model, fused)
        written.append(AUDIT_FILE)
    if verify_forward:
        _verify_forward(path, staging.dest, config is not None)
    staging.publish()
    return written, found


def _verify_forward(staging: Path, dest: Path, has_config: bool) -> None:
    if not has_config:
        raise ConfigError(f"'{dest}': the forward check needs the model's config.json, and this merge has none "
                          f"(give config=)")
    from ckpttool.verify.forward import check_output  # torch's model code and transformers only when asked

    checked = check_output(staging)
    if checked.problems:
        raise ForwardError(checked.problems, str(dest))


def config_dtype(config: dict[str, object] | None, plan: Plan, *, cast: bool) -> str | None:
    """The dtype ``config.json`` must be given (a safetensors name), or None to leave it as the source's.

    transformers loads the weights in the config's dtype, so it must name the floating-point dtype written:
    after a cast, and whenever the source's config says another (DeepSpeed's module weights are bf16 under a
    config saying float32). ``"auto"`` and non-string values (per-module dtypes) are left alone.
    """
    scales = scale_names([t.name for t in plan.targets])  # float32 scales of FP8 weights are no model dtype
    written = prevailing_float(t.dtype for t in plan.targets if t.name not in scales)
    if config is None or written is None:
        return None
    stated = [config[key] for key in ("dtype", "torch_dtype") if config.get(key) is not None]
    if not stated:
        return written if cast else None
    return written if any(_names_another(value, written) for value in stated) else None


def _names_another(value: object, dtype: str) -> bool:
    if not isinstance(value, str) or value == "auto":
        return False
    try:
        return dtype_name(value) != dtype
    except SourceError:  # a spelling ckpttool does not know: replaced by one transformers does
        return True


def _fuse_findings(plan: Plan, files: tuple[OutputFile, ...], staging: Path) -> list[Finding]:
    """The proof of a LoRA fuse (:mod:`ckpttool.lora.audit`) when the plan fuses adapters; none otherwise."""
    if not any(t.lora for t in plan.targets):
        return []
    from ckpttool.lora.audit import fuse_findings

    return fuse_findings(plan, staging, {t.name: f.name for f in files for t in f.targets})


def _audit_output(staging: Path, dest: Path, has_config: bool, config_label: str | None, model: ModelInfo | None,
                  extra: Sequence[Finding] = ()) -> Report:
    """The shape audit (headers only) of what was written, with ``extra`` findings (a fuse's); its report goes beside
    the weights."""
    from ckpttool.audit import check  # imported when a merge writes (a dry run needs none of the audit)
    from ckpttool.audit.causes import group_findings

    config_path = staging / "config.json" if has_config else None
    config = read_config(config_path) if config_path is not None else None
    report = replace(check(staging, config_path=config_path, config=config, model=model, data=False),
                     source=str(dest), config=config_label)
    if extra:
        findings = sort_findings((*report.findings, *extra))
        report = replace(report, findings=findings, causes=group_findings(findings))
    write_text(staging / AUDIT_FILE, json_text(report.to_json()) + "\n")  # json.dumps(indent=2)'s text, faster
    if report.errors:
        raise AuditError(report, str(dest))
    return report
