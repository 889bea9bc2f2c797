"""Where an output goes: which destinations may be replaced, and the names of what ckpttool writes there.

An output is written into a staging directory beside the destination (``.NAME.ckpttool-partial-XXXXXXXX``)
and published by renames (:mod:`ckpttool.writers.staging`, the one publish step of merge, split and live).
``force=True`` (``--force``) replaces only an *earlier output*: a directory that holds nothing but what a merge writes
(:func:`foreign_entries`). Never the home directory, ``/``, the current directory or one of its ancestors, a source,
or anything holding a source.

Names alone cannot tell a split's output from the training checkpoints it imitates (torch's ``dcp.save`` and
Megatron-Core's ``torch_dist`` write the same ``.metadata``, ``__R_0.distcp``, ``iter_0000000/``). So a command
whose :class:`Output` has a ``manifest`` (split: ``.ckpttool-split.json``) lists in it every file it wrote, with
its size (:mod:`ckpttool.writers.manifest`), and ``force`` replaces such an output only when every file in it is
listed with its size; a directory without a valid manifest, or holding a file it does not list (or of another
size), is refused, naming those.
"""
from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from ckpttool.errors import DestinationError
from ckpttool.io.paths import is_within
from ckpttool.writers import megatron_dist
from ckpttool.writers.manifest import files_under, read_manifest

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
