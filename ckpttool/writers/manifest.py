"""The manifest an output holds of itself: every file written, with its size, so ``--force`` can tell it from a
directory of the same names that ckpttool did not write (:func:`ckpttool.writers.destination.foreign_entries`).

A split writes ``.ckpttool-split.json`` into its output, the last file before publishing::

    {"written_by": "ckpttool", "version": "0.1.0", "command": "split",
     "files": {"config.json": 655, "iter_0000000/__0_0.distcp": 259670, "latest_checkpointed_iteration.txt": 1}}

``files`` maps every regular file of the output (its path relative to the output, ``/``-separated; the manifest
itself aside) to its size in bytes. A manifest is valid when it is a regular file of at most
:data:`MANIFEST_MAX_BYTES`, a JSON object with ``written_by`` ``"ckpttool"``, the ``command`` of the output and
``files`` mapping names to whole numbers of bytes; ``version`` is informative.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckpttool.errors import OutputError
from ckpttool.version import __version__

#: a manifest larger than this is none that ckpttool wrote (a million files list in well under it)
MANIFEST_MAX_BYTES = 256 << 20


def files_under(directory: Path, manifest: str | None = None) -> list[tuple[str, int]]:
    """Every regular file under ``directory`` (``manifest`` at the top aside) as (``/``-separated relative path,
    size), sorted within each directory; symbolic links are neither listed nor followed."""
    found = []
    for top, dirs, names in os.walk(directory):
        dirs.sort()
        for name in sorted(names):
            path = Path(top) / name
            relative = path.relative_to(directory).as_posix()
            if relative != manifest and path.is_file() and not path.is_symlink():
                found.append((relative, path.lstat().st_size))
    return found


def write_manifest(directory: Path, name: str, command: str) -> None:
    """Write the manifest ``name`` of ``command``'s output into ``directory`` (complete, not yet published).

    Raises:
        OutputError: it cannot be written; nothing is published.
    """
    document = {"written_by": "ckpttool", "version": __version__, "command": command,
                "files": dict(files_under(directory, name))}
    try:
        (directory / name).write_text(json.dumps(document, indent=1) + "\n")
    except OSError as e:
        raise OutputError(f"'{name}': cannot write: {e.strerror or e}; nothing was published") from None


def read_manifest(path: Path, command: str) -> dict[str, int] | None:
    """The files a manifest lists (relative path -> size), or None when ``path`` is no manifest that ``command``
    wrote: missing, not a regular file, too large, not JSON, or not of the documented form."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MANIFEST_MAX_BYTES:
            return None
        document = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(document, dict) or document.get("written_by") != "ckpttool" or document.get("command") != command:
        return None
    files = document.get("files")
    if not isinstance(files, dict) or not all(isinstance(size, int) and not isinstance(size, bool) and size >= 0
                                              for size in files.values()):
        return None
    return files
