"""DeepSpeed's universal checkpoints beside the step they were converted from: which one a merge reads.

``python -m deepspeed.checkpoint.ds_to_universal --input_folder <save>/<tag> --output_folder <save>/<tag>_universal``
writes ``zero/<param name>/fp32.pt`` (each parameter whole, fp32), copies the step's ``*_model_states.pt`` files
unchanged (``shutil.copy2``) and names the output in ``<save>/latest_universal``. A universal checkpoint holds the
fp32 master weights whatever the parallel layout (tensor, pipeline, expert parallelism), so when one lies beside the
step a merge resolves to, it is what the merge reads (``weights="master"``) -- but only when it provably is *that
step's*: its copied model states equal the step's, byte for byte (the archives' entries, sizes and CRC-32s; no
tensor is read). Otherwise the step is read as it is, and the universal checkpoints beside it are named:

============================================  ====================================================================
beside the step                               a merge
============================================  ====================================================================
``<tag>_universal`` (or the one               reads it, with a note saying so (also in ``--dry-run``)
``latest_universal`` names) of this step
a universal checkpoint of another step        reads the step, with a note naming it; an error naming both when
                                              the source folder's ``latest`` and ``latest_universal`` disagree
several, none of this step                    reads the step, with a note naming them
``latest_universal`` naming nothing           reads the step, with a note that the tag names nothing
============================================  ====================================================================

When the step itself cannot be read (tensor parallelism without a recorded split, MoE), the refusal names the
universal checkpoints beside it and what is known of each (:func:`universal_instead`).
"""

from __future__ import annotations

import zipfile
from dataclasses import dataclass
from pathlib import Path

from ckpttool.console.terminal import quoted
from ckpttool.errors import SourceError
from ckpttool.io.paths import contained, inside, list_inside, open_inside, read_tag

#: the tag file ``ds_to_universal`` writes beside ``latest``
LATEST_UNIVERSAL = "latest_universal"
#: the model states files ds_to_universal copies into its output
_STATES = "_model_states.pt"


@dataclass(frozen=True, slots=True)
class Universal:
    """A universal checkpoint folder beside a step, and whether it was converted from that step: True (its model
    states are the step's), False (they differ), None (it holds none to compare)."""

    path: Path
    of_step: bool | None
    named: bool  # named by latest_universal

    def relation(self) -> str:
        return {True: "converted from this step",
                False: "converted from another step: its model states differ from this step's",
                None: "no model states in it to tell which step it was converted from"}[self.of_step]

    def described(self) -> str:
        return f"{quoted(str(self.path))} ({self.relation()}{'; named by ' + LATEST_UNIVERSAL if self.named else ''})"


@dataclass(frozen=True, slots=True)
class Choice:
    """What a merge of a step reads: ``path`` (a universal checkpoint of the step) or None (the step itself), with
    the notes that say why."""

    path: Path | None
    notes: tuple[str, ...] = ()


def choose(step: Path, *, via_latest: bool) -> Choice:
    """The universal checkpoint to read instead of ``step``, if one beside it was converted from it.

    Args:
        step: the step folder a source resolved to (``global_stepN`` with rank files).
        via_latest: the source was the save folder, and ``step`` is the tag its ``latest`` file names.

    Raises:
        SourceError: ``latest`` and ``latest_universal`` name different steps (the source folder does not say which
            to merge); several universal checkpoints are copies of this step.
    """
    step = _plain(step)
    found, stale = beside(step)
    if not found and stale is None:
        return Choice(None)
    notes = [] if stale is None else [
        f"'{step.parent / LATEST_UNIVERSAL}' names {stale!r}, which is not a folder beside '{step.name}': ignored"]
    own = [u for u in found if u.of_step]
    if len(own) > 1:
        raise SourceError(f"'{step}': several universal checkpoints beside it were converted from it: "
                          f"{', '.join(repr(str(u.path)) for u in own)}; give the one to merge")
    named = next((u for u in found if u.named), None)
    if named is not None and not named.of_step and via_latest and not own:
        raise SourceError(
            f"{quoted(str(step.parent))}: 'latest' names {quoted(step.name)} but '{LATEST_UNIVERSAL}' names "
            f"{quoted(named.path.name)} ({named.relation()}); give the folder to merge: {quoted(str(step))} or "
            f"{quoted(str(named.path))}")
    if own:
        notes.append(f"read the universal checkpoint '{own[0].path}' (ds_to_universal's output of '{step.name}', "
                     "whose model states it holds unchanged) instead of the step's own files")
        notes += [f"not read: {u.described()}" for u in found if u is not own[0]]
        return Choice(own[0].path, tuple(notes))
    notes += [f"'{step}' read as it is; beside it, not read: {u.described()}" for u in found]
    return Choice(None, tuple(notes))


def beside(step: Path) -> tuple[list[Universal], str | None]:
    """The universal checkpoint folders next to ``step`` (each ``*_universal`` folder and the one
    ``latest_universal`` names), and the tag of a ``latest_universal`` that names no folder (None if it does or
    is absent). A tag that is not a plain folder name, a symlink and unreadable folders are ignored."""
    step = _plain(step)
    folder = step.parent
    named, stale = _tagged(folder)
    try:
        paths = {p for p in folder.iterdir() if p.name.endswith("_universal") and p.is_dir() and not p.is_symlink()}
    except OSError:
        paths = set()
    if named is not None:
        paths.add(named)
    paths.discard(step)
    found = [Universal(p, _converted_from(p, step), p == named) for p in sorted(paths)]
    return found, stale


def way_out(step: Path) -> str:
    """How to read a step whose tensor-parallel cuts are not recorded: the universal checkpoints beside it when
    there are some, else the conversion that writes one."""
    return universal_instead(step).removeprefix("; ") or (
        "convert the checkpoint with DeepSpeed's ds_to_universal (which applies the model's split patterns) and "
        "merge the result")


def universal_instead(step: Path) -> str:
    """``"; its universal checkpoint ... merge that instead"`` when one converted from ``step`` lies beside it, the
    universal checkpoints beside it and what is known of each otherwise, ``""`` when there is none: the end of an
    error refusing the step."""
    found, _ = beside(step)
    own = [u for u in found if u.of_step]
    if len(own) == 1:
        return (f"; its universal checkpoint {quoted(str(own[0].path))} (ds_to_universal's output) lies beside it: "
                "merge that instead")
    if not found:
        return ""
    return ("; beside it, universal checkpoints (ds_to_universal's output) not known to be of this step: "
            + ", ".join(u.described() for u in found) + "; merge the one of this step, or convert the step again")


def _plain(step: Path) -> Path:
    """``step`` with a name of its own, so that its parent is the folder beside it ('.' and '..' resolved)."""
    return step.resolve() if step.name in ("", ".", "..") else step


def _converted_from(universal: Path, step: Path) -> bool | None:
    """Whether ``universal`` holds the step's model states files, all of them and each the same file. Both lie in
    ``step.parent``; no link out of it is followed (a model states file that is one compares as different)."""
    folder = step.parent
    try:
        copied = sorted(p.name for p in list_inside(folder, universal.name) if p.name.endswith(_STATES) and p.is_file())
        own = sorted(p.name for p in list_inside(folder, step.name) if p.name.endswith(_STATES) and p.is_file())
    except (OSError, SourceError):
        return None
    if not copied:
        return None
    return copied == own and all(
        _same_archive(folder, f"{universal.name}/{name}", f"{step.name}/{name}") for name in copied)


def _same_archive(folder: Path, a: str, b: str) -> bool:
    """Two ``torch.save`` archives in ``folder`` with the same size and the same entries (names, sizes, CRC-32s),
    read from their central directories; False when either cannot be read as one or is a link out of ``folder``."""
    try:
        first, second = contained(folder, a), contained(folder, b)
        if not second.is_file() or first.stat().st_size != second.stat().st_size:
            return False
        entries = []
        for rel in (a, b):
            with open_inside(folder, rel) as f, zipfile.ZipFile(f) as archive:
                entries.append([(i.filename, i.file_size, i.CRC) for i in archive.infolist()])
    except (OSError, SourceError, zipfile.BadZipFile, ValueError):
        return False
    return entries[0] == entries[1]


def _tagged(folder: Path) -> tuple[Path | None, str | None]:
    """The folder ``latest_universal`` names, or the tag when it names no folder; its content is shown only when it
    is a plain folder name."""
    tag_file = folder / LATEST_UNIVERSAL
    if tag_file.is_symlink() or not tag_file.is_file():
        return None, None
    try:
        tag = read_tag(tag_file)
    except SourceError:
        return None, None
    if tag is None or "/" in tag or "\\" in tag or tag in (".", ".."):
        return None, None
    try:
        path = inside(folder, tag, named_by=LATEST_UNIVERSAL)
    except SourceError:
        return None, None
    return (path, None) if path.is_dir() and not path.is_symlink() else (None, tag)
