"""Paths taken from checkpoint metadata stay inside the checkpoint; outputs never land inside a source."""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SourceError


def inside(root: Path, relative: str, *, named_by: str) -> Path:
    """Resolve ``relative`` (a path some metadata file names) under ``root``, refusing escapes.

    Absolute paths, ``..`` components and symlinks that lead outside ``root`` are refused, so a crafted
    index or metadata file cannot make ckpttool read ``/etc/passwd``.

    Raises:
        SourceError: the path leaves the checkpoint directory.
    """
    if "\0" in relative:
        raise SourceError(f"'{named_by}' names a path with a NUL byte ({relative!r}); no file can have that name")
    if os.path.isabs(relative) or relative.startswith(("/", "\\")):
        raise SourceError(f"'{named_by}' names the absolute path '{relative}'; files must lie inside the checkpoint")
    root_real = root.resolve()
    candidate = (root / relative).resolve()
    if candidate != root_real and root_real not in candidate.parents:
        raise SourceError(f"'{named_by}' names '{relative}', which leads outside the checkpoint directory")
    return root / relative


def is_within(path: Path, ancestor: Path) -> bool:
    """True when ``path`` is ``ancestor`` or lies under it (both resolved)."""
    p, a = path.resolve(), ancestor.resolve()
    return p == a or a in p.parents
