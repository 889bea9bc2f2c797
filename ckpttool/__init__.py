"""ckpttool: merge sharded training checkpoints into HuggingFace safetensors, and prove them right.

Python API (mirrors the CLI)::

    import ckpttool
    layout = ckpttool.read_layout("ckpt/")           # metadata only: global shapes, pieces, files
    plan = ckpttool.plan_merge(layout)               # coverage-checked before any byte is read
    result = ckpttool.merge("ckpt/", "out/", config="config.json", dtype="bfloat16")
    ckpttool.split("out/", "dcp/", to="dcp", fsdp=2, tp=2)  # the way back: one DCP file per rank of a mesh
    report = ckpttool.audit("out/")                  # findings with stable codes; report.ok, report.to_json()
    same = ckpttool.diff("ckpt/", "out/").equal      # layout-independent fingerprints
    ok = ckpttool.verify("out/", against="ckpt/").ok  # a forward of both: logits equal within tolerance
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

from ckpttool.console.startup import collect_rarely, quiet_interrupts
from ckpttool.version import __version__

quiet_interrupts()  # first: a Ctrl-C while the command's imports run prints one line (see ckpttool.console.startup)
collect_rarely()

#: the public API, by the module that defines each name: imported on first use, so ``import ckpttool.cli`` (and
#: ``ckpttool --help``) runs without torch or transformers (tests/test_startup.py checks that)
_HOMES = {
    "audit": ".audit", "DiffResult": ".commands.diff", "diff": ".commands.diff", "Finding": ".findings",
    "Report": ".findings", "MergeResult": ".commands.merge", "merge": ".commands.merge", "prepare": ".commands.merge",
    "READERS": ".readers", "detect_format": ".readers", "read_layout": ".commands.source", "PieceSpec": ".io.sidecar",
    "save_shard": ".io.sidecar", "SplitResult": ".commands.split", "split": ".commands.split", "Tolerance": ".verify",
    "VerifyResult": ".verify", "verify": ".commands.verify",
    "AdapterExport": ".commands.adapter_only", "export_adapter": ".commands.adapter_only",
    **dict.fromkeys(("Box", "Fusion", "Layout", "Padding", "Piece", "TensorLayout"), ".layout.layout"),
    **dict.fromkeys(("Copy", "Plan", "Slice", "Target", "TargetSpec", "plan_merge"), ".plan.plan"),
    **dict.fromkeys((
        "ArgumentError", "AuditError", "CkptError", "ConfigError", "CoverageError", "DestinationError",
        "FormatNotDetectedError", "ForwardError", "OutputError", "SourceError", "SourceNotFoundError",
        "UnsafePickleError",
    ), ".errors"),
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_HOMES))


class _Package(types.ModuleType):
    """Importing the package ``ckpttool.audit`` would bind it as ``ckpttool.audit``, hiding the function of that
    name (likewise ``verify``): the API's names win, as when they were imported eagerly."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOMES and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package

if TYPE_CHECKING:
    from ckpttool.audit import audit
    from ckpttool.commands.diff import DiffResult, diff
    from ckpttool.layout.layout import Box, Fusion, Layout, Padding, Piece, TensorLayout
    from ckpttool.plan.tiling import Copy, Slice
    from ckpttool.plan.plan import Plan, Target, TargetSpec, plan_merge
    from ckpttool.errors import (
        ArgumentError,
        AuditError,
        CkptError,
        ConfigError,
        CoverageError,
        DestinationError,
        FormatNotDetectedError,
        ForwardError,
        OutputError,
        SourceError,
        SourceNotFoundError,
        UnsafePickleError,
    )
    from ckpttool.findings import Finding, Report
    from ckpttool.commands.merge_result import MergeResult
    from ckpttool.commands.merge import merge, prepare
    from ckpttool.commands.adapter_only import AdapterExport, export_adapter
    from ckpttool.commands.source import read_layout
    from ckpttool.readers import READERS, detect_format
    from ckpttool.io.sidecar import PieceSpec, save_shard
    from ckpttool.commands.split_result import SplitResult
    from ckpttool.commands.split import split
    from ckpttool.commands.verify import verify
    from ckpttool.verify import Tolerance, VerifyResult

__all__ = [
    "__version__", "ArgumentError", "AuditError", "DiffResult", "Finding", "Report", "audit", "diff",
    "Box", "CkptError", "ConfigError", "Copy", "CoverageError", "DestinationError", "FormatNotDetectedError",
    "Fusion", "Layout", "MergeResult", "OutputError", "Padding", "Piece", "PieceSpec", "Plan", "READERS", "Slice", "SourceError",
    "SourceNotFoundError", "Target", "TargetSpec", "TensorLayout", "UnsafePickleError", "detect_format", "merge",
    "plan_merge", "prepare", "read_layout", "save_shard", "split", "SplitResult", "ForwardError", "Tolerance",
    "VerifyResult", "verify",
    "AdapterExport", "export_adapter",
]
