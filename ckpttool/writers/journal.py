"""The resume journal of a merge: the output files finished so far, for one plan, so a merge killed after hours
continues with ``--resume`` where it stopped (see :mod:`ckpttool.writers.hf`), re-checking what it keeps."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ckpttool.execute.buffers import CHUNK_BYTES
from ckpttool.plan.plan import Plan
from ckpttool.errors import DestinationError, OutputError, SourceError
from ckpttool.version import __version__
from ckpttool.writers.destination import JOURNAL_GLOB, journal_name
from ckpttool.writers.trust import create_file, read_journal, untrusted
from ckpttool.writers.files import OutputFile

__all__ = ["JOURNAL_VERSION", "Journal", "check_kept", "clean_staging", "plan_id", "recorded", "write_text"]


#: the journal's format; a journal of another (its digests made another way, see :mod:`ckpttool.execute.digest`)
#: is never trusted: its files are written again
JOURNAL_VERSION = 2


class Journal:
    """The output files finished so far, with their sizes and digests (see :mod:`ckpttool.execute.digest`), for
    one plan.

    Each writing process keeps its own journal file, rewritten atomically after each file; all journals of
    the same plan are read together. Journals of another plan (the source, the options or ckpttool
    changed) or of another :data:`JOURNAL_VERSION` are ignored, so a resume never mixes two merges.
    """

    def __init__(self, directory: Path, plan_id: str, rank: int = 0) -> None:
        self.path = directory / journal_name(rank)
        self.plan_id = plan_id
        self.files = recorded(directory, plan_id)
        self.mine: dict[str, dict[str, object]] = {}
        self._save()

    def kept(self, name: str, path: Path, nbytes: int, digest: Callable[[], str]) -> bool:
        """True when ``name`` was finished by an earlier run and still has its recorded size and digest."""
        record = self.files.get(name)
        if not isinstance(record, dict) or record.get("bytes") != nbytes or not os.path.lexists(path):
            return False
        check_kept(path)
        if path.stat().st_size != nbytes or digest() != record.get("digest"):
            self.files.pop(name)
            return False
        return True

    def record(self, name: str, nbytes: int, digest: str) -> None:
        self.files[name] = self.mine[name] = {"bytes": nbytes, "digest": digest}
        self._save()

    def _save(self) -> None:
        temporary = self.path.with_name(self.path.name + ".tmp")
        write_text(temporary, json.dumps({"version": JOURNAL_VERSION, "plan": self.plan_id, "files": self.mine}, indent=1))
        os.replace(temporary, self.path)


def recorded(directory: Path, plan_id: str) -> dict[str, dict[str, object]]:
    """The files every journal of ``plan_id`` in ``directory`` records as finished."""
    files: dict[str, dict[str, object]] = {}
    for path in directory.glob(JOURNAL_GLOB):
        doc = _journal(path, plan_id)
        if doc is not None and isinstance(doc.get("files"), dict):
            files.update(doc["files"])
    return files


def _journal(path: Path, plan_id: str) -> dict | None:
    """The journal at ``path`` when it is one of ``plan_id`` in this :data:`JOURNAL_VERSION`, else None."""
    doc = read_journal(path)
    ours = doc is not None and doc.get("plan") == plan_id and doc.get("version") == JOURNAL_VERSION
    return doc if ours else None


def clean_staging(directory: Path, plan_id: str) -> None:
    """Remove what no journal of ``plan_id`` holds: half-written files, another plan's files and journals, an
    old index or report. Done once, before any process writes.

    Raises:
        DestinationError: an entry is a symbolic link, a hard link, or another user's (see
            :func:`~ckpttool.writers.trust.untrusted`); nothing was touched. ckpttool never makes one, so
            the directory is not as a ckpttool run left it, and a resume would write or publish through it.
    """
    for entry in sorted(directory.iterdir()):
        reason = untrusted(entry, directory=entry.is_dir() and not entry.is_symlink())
        if reason is not None:
            raise DestinationError(
                f"'{entry}': it is {reason}; ckpttool never makes one in its staging directory, so it cannot trust "
                f"what is there. Nothing was touched: remove '{directory}' (or run without --resume) and merge again"
            )
    keep = set(recorded(directory, plan_id))
    keep.update(path.name for path in directory.glob(JOURNAL_GLOB) if _journal(path, plan_id) is not None)
    for leftover in directory.iterdir():
        if leftover.name not in keep:
            shutil.rmtree(leftover) if stat.S_ISDIR(leftover.lstat().st_mode) else leftover.unlink()


def check_kept(path: Path) -> None:
    """Refuse to keep ``path`` (a file a journal records as finished) unless ckpttool can trust it.

    Raises:
        DestinationError: it is a symbolic link, a hard link, not a regular file, or another user's.
    """
    reason = untrusted(path)
    if reason is not None:
        raise DestinationError(f"'{path}': the journal keeps it, but it is {reason}; ckpttool never makes one, so it "
                               f"cannot trust it. Nothing was touched: remove '{path.parent}' and merge again")


def plan_id(plan: Plan, files: Sequence[OutputFile]) -> str:
    """A digest of everything that decides the output bytes: ckpttool's version, the plan, the file split,
    and the size and modification time of every source file it reads."""
    stats = []
    every = [*plan.targets, *(t.scale for t in plan.targets if t.scale is not None),  # a scale's files too
             *(a for t in plan.targets for a in t.aux)]
    sources = sorted({c.piece.file for t in every for c in t.copies})
    for rel in sources:
        try:
            st = (Path(plan.root) / rel).stat()
        except OSError as e:
            raise SourceError(f"'{rel}': cannot read: {e.strerror or e}") from None
        stats.append([rel, st.st_size, st.st_mtime_ns])
    text = json.dumps({"ckpttool": __version__, "chunk": CHUNK_BYTES, "root": str(Path(plan.root).resolve()),
                       "sources": stats})
    digest = hashlib.sha256(text.encode())
    index = {rel: i for i, rel in enumerate(sources)}
    for out in files:
        digest.update(_layout_text(out, index).encode())
    return digest.hexdigest()


def _layout_text(out: OutputFile, index: Mapping[str, int]) -> str:
    """The file's name, then a line per target (name, dtype, shape) and per copy (its source file's number in
    ``index``, key when it is not the target's name, byte range, boxes), its dequantization, its transform and its
    scale's copies: text that tells two layouts apart (names and keys quoted by ``repr``), made at a few million lines a second."""
    parts = [json.dumps(out.name)]
    for t in out.targets:
        parts.append(f"\n{t.name!r} {t.dtype} {t.shape}")
        for c in t.copies:
            p = c.piece
            key = "" if p.key == t.name else repr(p.key)
            parts.append(f"\n {index[p.file]} {key} {p.byte_offset} {p.byte_length} {c.src.offsets}{c.src.sizes}"
                         f"{c.dst.offsets}{c.dst.sizes}")
        if t.dequant is not None:
            parts.append(f"\n {t.dequant!r}")
        if t.transform is not None:  # the same copies, another map: other bytes
            parts.append(f"\n t {t.transform!r}")
        if t.scale is not None:
            parts.extend(f"\n s {index[c.piece.file]} {c.piece.key!r} {c.piece.byte_offset}" for c in t.scale.copies)
        for d in t.lora:  # another adapter, or the same one changed since: other bytes
            parts.append(f"\n l {d.a.file!r} {_stat(d.a.file)} {d.a.byte_offset} {d.b.byte_offset} {d.scaling!r}"
                         + (f" e {d.expert}/{d.experts} {d.row_offset}" if d.experts > 1 else ""))
        for aux in t.aux:
            parts.extend(f"\n a {index[c.piece.file]} {c.piece.key!r} {c.piece.byte_offset}" for c in aux.copies)
    return "".join(parts)


def _stat(path: str) -> tuple[int, int]:
    """An adapter file's size and modification time (it lies outside the source: not among its files)."""
    try:
        st = Path(path).stat()
    except OSError as e:
        raise SourceError(f"'{path}': cannot read: {e.strerror or e}") from None
    return st.st_size, st.st_mtime_ns


def write_text(path: Path, text: str) -> None:
    """Write a small output file (a journal, an index, a config) with :func:`create_file`; a failure is an
    :class:`OutputError`."""
    try:
        with os.fdopen(create_file(path), "w") as f:
            f.write(text)
    except OSError as e:
        raise OutputError(f"'{path.name}': cannot write: {e.strerror or e}; nothing was published") from None
