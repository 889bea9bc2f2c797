"""Where an output goes: which destinations may be replaced, and the one publish step of merge and live.

An output is written into a staging directory beside the destination (``.NAME.ckpttool-partial-XXXXXXXX``)
and published by renames. ``force=True`` (``--force``) replaces only an *earlier output*: a directory that
holds nothing but what a merge writes (:func:`foreign_entries`). Never the home directory, ``/``, the current
directory or one of its ancestors, a source, or anything holding a source.

Names alone cannot tell a split's output from the training checkpoints it imitates (torch's ``dcp.save`` and
Megatron-Core's ``torch_dist`` write the same ``.metadata``, ``__R_0.distcp``, ``iter_0000000/``). So a command
whose :class:`Output` has a ``manifest`` (split: ``.ckpttool-split.json``) lists in it every file it wrote, with
its size (:mod:`ckpttool.writers.manifest`), and ``force`` replaces such an output only when every file in it is
listed with its size; a directory without a valid manifest, or holding a file it does not list (or of another
size), is refused, naming those.

The earlier output survives until the new one is complete: it is moved aside
(``.NAME.ckpttool-old-XXXXXXXX``), the new one is renamed into place, and only then is the old one removed.
A run killed between those two renames leaves no output at ``NAME`` and the old one aside; the next run
puts it back and says so. A lock file beside the destination (``.NAME.ckpttool-lock``) keeps two runs from
writing one destination at once.

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
from dataclasses import dataclass
from pathlib import Path

from ckpttool.errors import DestinationError, OutputError
from ckpttool.io.paths import is_within
from ckpttool.writers import megatron_dist
from ckpttool.writers.manifest import files_under, read_manifest
from ckpttool.writers.trust import Lock, read_journal, untrusted

log = logging.getLogger(__name__)

INDEX = "model.safetensors.index.json"
#: the audit report a merge writes beside the weights (transformers ignores it)
AUDIT_FILE = "ckpttool-audit.json"
#: files copied beside the weights when present in the config's directory or the source
EXTRA_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    # a vision-language model's processor: its image and video preprocessing and the processor's own settings
    "preprocessor_config.json",
    "video_preprocessor_config.json",
    "processor_config.json",
)
JOURNAL_GLOB = ".ckpttool-journal-*.json"
PARTIAL, OLD, LOCK = ".ckpttool-partial-", ".ckpttool-old-", ".ckpttool-lock"

#: every name an output of ``merge`` (or ``live.save_hf``) can hold
_OURS = re.compile(
    r"model\.safetensors|model-\d+-of-\d+\.safetensors|"
    + "|".join(re.escape(n) for n in (INDEX, "config.json", AUDIT_FILE, *EXTRA_FILES))
    + r"|\.ckpttool-journal-\d+\.json(\.tmp)?"
)
#: foreign entries named in an error, at most
SHOWN = 10


@dataclass(frozen=True, slots=True)
class Output:
    """What one command writes into a destination: ``--force`` replaces a directory holding nothing else.
    ``command`` names it in messages ("an earlier output of a merge")."""

    command: str
    names: re.Pattern[str]
    #: directories the command writes (Megatron's ``iter_0000000/``): ours when every entry is a file of ``names``
    dirs: re.Pattern[str] | None = None
    #: the file listing what the command wrote (:mod:`ckpttool.writers.manifest`); with one, ``force`` also needs every file
    #: listed with its size, as names alone match a training checkpoint of the same format
    manifest: str | None = None


MERGE_OUTPUT = Output("merge", _OURS)
#: the manifest every split output holds (:mod:`ckpttool.writers.manifest`)
SPLIT_MANIFEST = ".ckpttool-split.json"
#: what a split writes (DCP rank files and ``.metadata``; for Megatron ``iter_NNNNNNN/`` with ``common.pt`` and
#: ``metadata.json``, and the tracker), config and tokenizer files: replaced only as its manifest lists it, since a
#: training run's own ``dcp.save`` or ``torch_dist`` save has the same names and no manifest
SPLIT_OUTPUT = Output("split", re.compile(
    r"\.metadata|__\d+_\d+\.distcp|" + "|".join(re.escape(n) for n in (
        "config.json", *EXTRA_FILES, megatron_dist.COMMON, megatron_dist.METADATA_JSON, megatron_dist.TRACKER,
        SPLIT_MANIFEST))),
    dirs=re.compile(r"iter_\d{7}"), manifest=SPLIT_MANIFEST)


def journal_name(rank: int = 0) -> str:
    """The journal file of one writing process (rank 0 when a single process merges)."""
    return f".ckpttool-journal-{rank}.json"


def foreign_entries(directory: Path, output: Output = MERGE_OUTPUT) -> list[str]:
    """The entries of ``directory`` that no merge writes, or no ``output`` of another command (sorted;
    sub-directories end in ``/``).

    Only regular files with the names of an output count as ours: weights (``model.safetensors``,
    ``model-0000i-of-0000N.safetensors``), the index, ``config.json``, generation config and tokenizer files,
    ``ckpttool-audit.json``, and journals. A symbolic link, any other name, or a directory is foreign, but for one
    of ``output.dirs`` holding only files of ``output.names`` (a split's ``iter_0000000/``).

    When every name is an output's and ``output`` has a ``manifest``: without a valid manifest every entry is
    foreign; with one, every file it does not list with its size (named by its path, ``iter_0000000/__0_0.distcp``).
    """
    foreign = _misnamed(directory, output)
    if foreign or output.manifest is None:
        return foreign
    listed = read_manifest(directory / output.manifest, output.command)
    if listed is None:
        with os.scandir(directory) as entries:
            return sorted(e.name + ("/" if e.is_dir(follow_symlinks=False) else "") for e in entries)
    return sorted(path for path, size in files_under(directory, output.manifest) if listed.get(path) != size)


def _misnamed(directory: Path, output: Output) -> list[str]:
    """The entries of ``directory`` whose name, kind or place no ``output`` has."""
    foreign = []
    with os.scandir(directory) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                ours = output.dirs is not None and output.dirs.fullmatch(entry.name) is not None
                if not ours or _misnamed(Path(entry.path), Output(output.command, output.names)):
                    foreign.append(entry.name + "/")
            elif not (entry.is_file(follow_symlinks=False) and output.names.fullmatch(entry.name)):
                foreign.append(entry.name)
    return sorted(foreign)


def check_destination(dest: Path, sources: Sequence[Path], force: bool, output: Output = MERGE_OUTPUT) -> None:
    """Refuse a destination whose replacement could lose data. Touches nothing.

    Raises:
        DestinationError: ``dest`` is the home directory, ``/``, the current directory or an ancestor of it;
            lies inside a source or holds one; is a file or a symbolic link; is a non-empty directory while
            not ``force``, or holds anything a merge does not write (named, at most :data:`SHOWN`); or its
            parent does not exist or cannot be written.
    """
    check_name_length(dest)
    protected = _protected(dest)
    if protected:
        raise DestinationError(f"destination '{dest}' is {protected}; ckpttool never writes there. Give a new directory")
    for src in sources:
        if is_within(dest, src):
            raise DestinationError(f"destination '{dest}' lies inside the source '{src}'; ckpttool never writes there")
        if dest.exists() and is_within(src, dest):
            raise DestinationError(f"destination '{dest}' contains the source '{src}'; replacing it would destroy the source")
    if dest.is_symlink():
        raise DestinationError(f"destination '{dest}' is a symbolic link; give the directory it points to, or a new one")
    if dest.exists():
        if not dest.is_dir():
            raise DestinationError(f"destination '{dest}' exists and is not a directory")
        try:
            not_empty = any(dest.iterdir())
            foreign = foreign_entries(dest, output) if not_empty and force else []
        except OSError as e:
            raise DestinationError(f"destination '{dest}': cannot list it: {e.strerror or e}") from None
        if not_empty and not force:
            raise DestinationError(f"destination '{dest}' exists and is not empty; pass force=True to replace it")
        if foreign:
            shown = ", ".join(foreign[:SHOWN]) + (f", ... ({len(foreign) - SHOWN} more)" if len(foreign) > SHOWN else "")
            raise DestinationError(
                f"destination '{dest}' holds {len(foreign)} entr{'y' if len(foreign) == 1 else 'ies'} that ckpttool did not "
                f"write ({shown}); force=True replaces only an earlier output of a {output.command}. Nothing was touched: choose "
                "another destination, or move those entries away yourself"
                + (f" (an output of a {output.command} lists every file it wrote, with its size, in {output.manifest})"
                   if output.manifest else "")
            )
    parent = dest.parent if dest.parent != Path("") else Path(".")
    if not parent.is_dir():
        raise DestinationError(f"cannot create '{dest}': its parent directory '{parent}' does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DestinationError(f"cannot create '{dest}': '{parent}' is not writable")


def _protected(dest: Path) -> str | None:
    """What makes ``dest`` a directory never to replace, or None."""
    target = dest.resolve()
    if target == Path(target.anchor):
        return "the root directory"
    home = os.environ.get("HOME")
    if home and target == Path(home).resolve():
        return "your home directory"
    cwd = Path.cwd().resolve()
    if target == cwd:
        return "the current directory"
    if target in cwd.parents:
        return "an ancestor of the current directory"
    return None


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


def check_name_length(dest: Path) -> None:
    """Refuse a destination whose name leaves no room for the names ckpttool derives from it (its staging,
    aside and lock entries), before anything is created.

    Raises:
        DestinationError: a derived name is longer than the file system allows.
    """
    parent = dest.parent if str(dest.parent) else Path(".")
    try:
        limit = os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    longest = len(f".{dest.name}{PARTIAL}00000000".encode())
    if longest > limit:
        room = limit - (longest - len(dest.name.encode()))
        raise DestinationError(
            f"destination '{dest}': its name is too long: ckpttool's staging directory beside it "
            f"('.NAME{PARTIAL}XXXXXXXX') would take {longest} bytes, over the file system's {limit}. Give a name of "
            f"at most {room} bytes"
        )


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
