"""What transformers needs, beyond the tensors, to load an audited checkpoint: the audit's config findings.

A HuggingFace directory without ``config.json`` holds valid safetensors, but ``from_pretrained`` stops before
reading a weight. A merge without a config (a generic merge) writes exactly that, so the audit says so with a
warning (``config-missing``), never a bare PASS. A sharded source without a config is no such problem: it is
not what transformers loads, and only ``no-config`` (info) says its names and shapes were not checked.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from .findings import Finding, finding
from .readers import hf

CONFIG = "config.json"


def config_findings(root: Path, fmt: str, config: Mapping[str, object] | None, checked: bool) -> list[Finding]:
    """The findings about the config of the checkpoint in ``root``.

    Args:
        root: the audited directory.
        fmt: its format.
        config: the config used (found in or next to ``root``, or given), if any.
        checked: whether names and shapes were checked against an architecture built from it.

    Returns:
        ``config-missing`` for a HuggingFace directory with no ``config.json`` of its own (even when a config
        from elsewhere was given: transformers reads the directory's), and ``no-config`` when nothing was
        checked against an architecture (unless ``config-missing`` already says so).
    """
    found: list[Finding] = []
    missing = fmt == hf.NAME and not (root / CONFIG).is_file()
    if missing:
        unchecked = "; its names and shapes are not checked against an architecture" if config is None else ""
        found.append(finding(
            "config-missing",
            f"no {CONFIG} beside the weights: transformers cannot load this directory (from_pretrained reads "
            f"{CONFIG} first){unchecked}. Merge again with the model's config, or copy its {CONFIG} here",
            file=CONFIG,
        ))
    if not checked and not (missing and config is None):
        why = "no config.json found" if config is None else (
            f"transformers has no causal LM for model_type {config.get('model_type')!r}")
        found.append(finding("no-config", f"{why}: names and shapes are not checked against an architecture"))
    return found
