"""The one publish step of merge, split and live: an output written into a staging directory beside its
destination and renamed into place, never leaving a partial checkpoint at the destination.

The output is written into ``.NAME.ckpttool-partial-XXXXXXXX`` (:class:`Staging`). The earlier output survives
until the new one is complete: it is moved aside (``.NAME.ckpttool-old-XXXXXXXX``), the new one is renamed into
place, and only then is the old one removed. A run killed between those two renames leaves no output at ``NAME``
and the old one aside; the next run puts it back and says so. A lock file beside the destination
(``.NAME.ckpttool-lock``) keeps two runs from writing one destination at once. Which destinations may be replaced
is :mod:`ckpttool.writers.destination`'s to say, checked when the staging opens and again before it is published.

Nothing is ever written through a link: every output file is created new (``O_EXCL | O_NOFOLLOW``), and a
staging directory, a file kept on ``resume`` or a lock file is trusted only when it is what ckpttool makes: a
directory or regular file of this user, with one link (:func:`ckpttool.writers.trust.untrusted` says why not).
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import uuid
from collections.abc import Sequence
from pathlib import Path

from ckpttool.errors import DestinationError, OutputError
from ckpttool.writers.destination import (
    JOURNAL_GLOB,
    LOCK,
    MERGE_OUTPUT,
    OLD,
    PARTIAL,
    Output,
    check_destination,
    check_name_length,
)
from ckpttool.writers.trust import Lock, read_journal, untrusted

log = logging.getLogger(__name__)


def siblings(dest: Path, kind: str) -> list[Path]:
    """Directories beside ``dest`` that ckpttool made for it (``kind``: :data:`PARTIAL` or :data:`OLD`), newest
    first. Matched by exact name, never by glob, so a destination named ``m[v2]`` or ``m*`` finds its own."""
    found = [d for d in named(dest, kind) if untrusted(d, directory=True) is None]
    return sorted(found, key=lambda d: d.lstat().st_mtime, reverse=True)


def named(dest: Path, kind: str) -> list[Path]:
    """Every entry beside ``dest`` named as ckpttool names its ``kind`` of directory, whatever it is (a symbolic
    link, another user's directory: see :func:`siblings` for those ckpttool can trust)."""
    pattern = re.compile(re.escape(f".{dest.name}{kind}") + "[0-9a-f]{8}")
    parent = dest.parent
    try:
        return [parent / n for n in os.listdir(parent) if pattern.fullmatch(n)]
    except FileNotFoundError:
        return []


def journaled(directory: Path, *, finished: bool = False) -> bool:
    """True when ``directory`` holds a journal ckpttool can trust (see :func:`untrusted`); with ``finished``, one
    that records at least one finished file (something a resume would keep)."""
    for path in directory.glob(JOURNAL_GLOB):
        if untrusted(path) is None:
            doc = read_journal(path) if finished else None
            if not finished or (doc is not None and isinstance(doc.get("files"), dict) and doc["files"]):
                return True
    return False


class Staging:
    """The staging directory of one output and its publication.

    Call order: :meth:`open` (lock the destination, put back an output an interrupted run left aside, check
    the destination, clear earlier staging directories or take one up again with ``resume``), write into
    :attr:`path`, then :meth:`publish` (sync, move the earlier output aside, rename, remove the earlier
    output) or :meth:`abandon` (remove the staging directory; after Ctrl-C a journaled one is kept for
    ``resume``). Both release the lock.
    """

    def __init__(self, dest: Path, *, sources: Sequence[Path] = (), force: bool = False, resume: bool = False,
                 output: Output = MERGE_OUTPUT) -> None:
        self.dest = dest
        self.output = output
        self.sources = tuple(sources)
        self.force = force
        self.resume = resume
        self.path = dest.parent / f".{dest.name}{PARTIAL}{uuid.uuid4().hex[:8]}"
        self.resumed = False
        self.restored: Path | None = None
        #: the staging directory :meth:`abandon` kept for ``resume`` (after Ctrl-C, with finished files), else None
        self.kept: Path | None = None
        self._lock: Lock | None = None

    def open(self) -> Path:
        """Lock, repair, check and create (or take up) the staging directory; returns its path."""
        check_name_length(self.dest)
        self._lock = Lock(self.dest.parent / f".{self.dest.name}{LOCK}", self.dest)
        try:
            self._restore()
            try:
                check_destination(self.dest, self.sources, self.force, self.output)
            except DestinationError as e:
                if self.restored is None:
                    raise
                raise DestinationError(f"{self.restoration}; {e}") from None
            earlier = siblings(self.dest, PARTIAL)
            if self.resume:
                self._refuse_foreign_staging()
                taken = [d for d in earlier if journaled(d)]
                if taken:
                    self.path, self.resumed = taken[0], True
            for stale in earlier:
                if stale != self.path:
                    shutil.rmtree(stale, ignore_errors=True)
            if not self.resumed:
                self.path.mkdir()
        except BaseException:
            self._release()
            raise
        return self.path

    def _refuse_foreign_staging(self) -> None:
        """On ``resume``, refuse an entry named like a staging directory of this destination that ckpttool did
        not make: a symbolic link, a file, another user's directory. Resuming into it would write there."""
        for entry in named(self.dest, PARTIAL):
            reason = untrusted(entry, directory=True)
            if reason is not None:
                raise DestinationError(
                    f"cannot resume into '{entry}': it is {reason}, not a staging directory this ckpttool run can "
                    "trust. Nothing was touched: move it away, or run without --resume"
                )

    def abandon(self, error: BaseException | None = None) -> None:
        """Remove the staging directory (kept after Ctrl-C when its journal records a finished file: then
        :attr:`kept` names it) and release the lock."""
        try:
            interrupted = isinstance(error, KeyboardInterrupt)
            if untrusted(self.path, directory=True) is None:
                if interrupted and journaled(self.path, finished=True):
                    self.kept = self.path
                else:
                    shutil.rmtree(self.path, ignore_errors=True)
        finally:
            self._release()

    def release(self) -> None:
        """Release the lock and leave the staging directory as it is (one that a resume refused untouched)."""
        self._release()

    def publish(self) -> None:
        """Make every byte durable, then replace the destination; the earlier output goes only at the end.

        Raises:
            DestinationError: the destination changed while the output was written (a training run saved into it)
                and is no longer one to replace; it is left as it is.
            OutputError: a rename failed; the destination is as it was.
        """
        try:
            # checked again: the lock keeps other ckpttool runs out, not a training run saving into the destination
            check_destination(self.dest, self.sources, self.force, self.output)
            for journal in self.path.glob(JOURNAL_GLOB):
                journal.unlink()
            sync_tree(self.path)
            old = None
            if self.dest.exists():
                old = self.dest.parent / f".{self.dest.name}{OLD}{uuid.uuid4().hex[:8]}"
                os.rename(self.dest, old)
            try:
                os.rename(self.path, self.dest)
            except BaseException:
                if old is not None:
                    os.rename(old, self.dest)
                raise
            sync_directory(self.dest.parent)
            if old is not None:
                shutil.rmtree(old, ignore_errors=True)
        except DestinationError:  # an OSError too (FileExistsError), but no failed rename: its own message
            raise
        except OSError as e:
            raise OutputError(f"'{self.dest}': cannot publish: {e.strerror or e}; the destination is as it was") from None
        finally:
            self._release()

    def _restore(self) -> None:
        """Put back an earlier output that a run killed between its two renames left aside; remove the rest."""
        aside = siblings(self.dest, OLD)
        if aside and not self.dest.exists() and not self.dest.is_symlink():
            self.restored, aside = aside[0], aside[1:]
            os.rename(self.restored, self.dest)
            log.info("%s", self.restoration)
            for staged in siblings(self.dest, PARTIAL):  # the killed run's new output: without a journal, no use
                if not journaled(staged):
                    shutil.rmtree(staged, ignore_errors=True)
        for leftover in aside:  # an earlier output already replaced: the run was killed before removing it
            shutil.rmtree(leftover, ignore_errors=True)

    @property
    def restoration(self) -> str | None:
        """What :meth:`open` put back, in words (None when nothing)."""
        if self.restored is None:
            return None
        return (f"restored the earlier output '{self.dest}' from '{self.restored.name}', where an interrupted run had "
                "moved it aside")

    def _release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None


def sync_tree(directory: Path) -> None:
    """``fsync`` every file under ``directory`` and every directory, so a rename publishes durable bytes (a split's
    ``iter_0000000/`` too)."""
    for entry in os.scandir(directory):
        if entry.is_dir(follow_symlinks=False):
            sync_tree(Path(entry.path))
        elif entry.is_file(follow_symlinks=False):
            fd = os.open(entry.path, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    sync_directory(directory)


def sync_directory(directory: Path) -> None:
    """``fsync`` a directory, making the names in it (a rename) durable."""
    fd = os.open(directory if str(directory) else ".", os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
