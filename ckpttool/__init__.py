"""ckpttool: merge sharded training checkpoints into HuggingFace safetensors, and prove them right.

Python API (mirrors the CLI)::

    import ckpttool
    layout = ckpttool.read_layout("ckpt/")           # metadata only: global shapes, pieces, files
    plan = ckpttool.plan_merge(layout)               # coverage-checked before any byte is read
    result = ckpttool.merge("ckpt/", "out/", config="config.json", dtype="bfloat16")
    ckpttool.split("out/", "dcp/", to="dcp", fsdp=2, tp=2)  # the way back: one DCP file per rank of a mesh
    report = ckpttool.audit("out/")                  # findings with stable codes; report.ok, report.to_json()
    same = ckpttool.diff("ckpt/", "out/").equal      # layout-independent fingerprints
"""

from __future__ import annotations

from .startup import quiet_interrupts

quiet_interrupts()  # first: a Ctrl-C while the command's imports run prints one line (see ckpttool.startup)

from .audit import audit  # noqa: E402
from .diff import DiffResult, diff  # noqa: E402
from .errors import (  # noqa: E402
    ArgumentError,
    AuditError,
    CkptError,
    ConfigError,
    CoverageError,
    DestinationError,
    FormatNotDetectedError,
    OutputError,
    SourceError,
    SourceNotFoundError,
    UnsafePickleError,
)
from .findings import Finding, Report  # noqa: E402
from .engine.layout import Box, Fusion, Layout, Padding, Piece, TensorLayout  # noqa: E402
from .merge import MergeResult, merge, prepare  # noqa: E402
from .engine.plan import Copy, Plan, Slice, Target, TargetSpec, plan_merge  # noqa: E402
from .readers import READERS, detect_format, read_layout  # noqa: E402
from .sidecar import PieceSpec, save_shard  # noqa: E402
from .split import SplitResult, split  # noqa: E402

from .version import __version__  # noqa: E402

__all__ = [
    "__version__", "ArgumentError", "AuditError", "DiffResult", "Finding", "Report", "audit", "diff",
    "Box", "CkptError", "ConfigError", "Copy", "CoverageError", "DestinationError", "FormatNotDetectedError",
    "Fusion", "Layout", "MergeResult", "OutputError", "Padding", "Piece", "PieceSpec", "Plan", "READERS", "Slice", "SourceError",
    "SourceNotFoundError", "Target", "TargetSpec", "TensorLayout", "UnsafePickleError", "detect_format", "merge",
    "plan_merge", "prepare", "read_layout", "save_shard", "split", "SplitResult",
]
