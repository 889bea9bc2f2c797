"""Readers: one per on-disk format, each turning what it finds into a :class:`~ckpttool.layout.layout.Layout`.

Each reader module defines ``READER``, a :class:`~.base.Reader` (``name``, ``looks_for``, ``options``,
``matches(root)``, ``read(root, model, **options)``; the call order is in :mod:`.base`). :data:`READERS` lists
them in detection order; :func:`detect_format` picks one (:mod:`.claims` when several claim a directory) and
:func:`read_layout` runs it. A PEFT adapter is no source format (``merge --adapter`` fuses one: :mod:`ckpttool.lora`):
:func:`find_adapter` finds one, and a source that is one, holds one beside the base or holds one in a subfolder is
refused (the base would come out without it).

Format knowledge lives only here; the plan and executor see pieces and boxes, and what tensor names mean for a
model family is :mod:`ckpttool.families`' business.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath

from ckpttool.model.description import ModelInfo
from ckpttool.model.config_sizes import Census
from ckpttool.layout.layout import Layout
from ckpttool.errors import CkptError, FormatNotDetectedError, SourceError, SourceNotFoundError
from ckpttool.io.paths import contained
from ckpttool.readers import accelerate
from ckpttool.readers import colossalai
from ckpttool.readers import dcp
from ckpttool.readers.deepspeed import reader as deepspeed
from ckpttool.readers import hf
from ckpttool.readers import hf_distributed
from ckpttool.readers.lightning import reader as lightning
from ckpttool.readers.megatron import dist as megatron_dist
from ckpttool.readers.megatron import legacy as megatron_legacy
from ckpttool.readers import sidecar
from ckpttool.readers.verl import reader as verl
from ckpttool.readers.base import Reader
from ckpttool.readers.claims import claimed_format

#: in detection order: the most specific first
READERS: dict[str, Reader] = {
    module.READER.name: module.READER
    for module in (sidecar, deepspeed, verl, colossalai, megatron_dist, megatron_legacy, lightning, dcp, hf_distributed,
                   hf)
}


def detect_format(root: Path) -> str:
    """The name of the reader that recognises ``root`` (see :mod:`.claims` when several do).

    Raises:
        SourceNotFoundError: ``root`` does not exist.
        SourceError: ``root`` is or holds a PEFT adapter, or holds no checkpoint and a subfolder holds one (the
            message names the adapter's weights file).
        SourceError: ``root`` holds checkpoints of two formats; the message names both and what was found.
        FormatNotDetectedError: no reader matched; the message lists what was looked for.
    """
    _check_directory(root)
    _refuse_adapter(root, find_adapter(root))
    found = claimed_format(root, READERS)
    if found is not None:
        return found
    below = _checkpoints_below(root)
    _refuse_adapter(root, _adapter_below(root), below)
    if below:
        listed = "\n".join(f"  - '{path}' ({name})" for path, name in below)
        raise FormatNotDetectedError(
            f"'{root}': no checkpoint here, but {'these subfolders hold' if len(below) > 1 else 'this subfolder holds'} "
            f"one; give {'one of them' if len(below) > 1 else 'it'} as the source:\n{listed}"
        )
    looked = "\n".join(f"  - {reader.looks_for} ({name})" for name, reader in READERS.items())
    raise FormatNotDetectedError(
        f"'{root}': no checkpoint format recognised. Looked for:\n{looked}\nPass format='NAME' to name one."
    )


#: what PEFT's ``save_pretrained`` writes for an adapter: its config, and its weights in one of these files
ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")


def find_adapter(root: Path) -> Path | None:
    """The weights file of the PEFT adapter saved at the top level of ``root`` (``adapter_config.json`` beside
    ``adapter_model.safetensors`` or ``.bin``), or None."""
    if not (root / ADAPTER_CONFIG).is_file():
        return None
    return next((root / name for name in ADAPTER_WEIGHTS if (root / name).is_file()), None)


def _adapter_below(root: Path) -> Path | None:
    """The first PEFT adapter in a subfolder of ``root`` (a run's folder holding ``base/`` and ``adapter/``)."""
    try:
        folders = sorted(p for p in root.iterdir() if not p.name.startswith(".") and p.is_dir())
    except OSError:
        return None
    return next((found for found in map(find_adapter, folders[:SUBFOLDERS_LOOKED_AT]) if found is not None), None)


def _refuse_adapter(root: Path, adapter: Path | None, below: Sequence[tuple[Path, str]] = ()) -> None:
    """Refuse a source that is, holds or sits above a PEFT adapter (``below``: the checkpoints in the subfolders
    of such a source): merging the base alone would silently leave the adapter out."""
    if adapter is None:
        return
    base = f"a merge of '{below[0][0]}'" if below else "a merge"
    raise SourceError(
        f"'{adapter}': a PEFT adapter ({ADAPTER_CONFIG} beside it). ckpttool fuses an adapter only when asked: {base} "
        "would write the base without it. Fuse it with --adapter: ckpttool merge BASE OUT --adapter "
        f"'{adapter.parent}', BASE a folder holding the base alone"
    )


#: subfolders :func:`detect_format` looks into when the source itself holds no checkpoint
SUBFOLDERS_LOOKED_AT = 64


def _checkpoints_below(root: Path) -> list[tuple[Path, str]]:
    """The subfolders of ``root`` that hold a checkpoint, with its format: a run's folder often holds several
    (Megatron's ``legacy/`` and ``torch_dist/``, one folder per step), and the user gave the folder above."""
    try:
        folders = sorted(p for p in root.iterdir() if not p.name.startswith(".") and p.is_dir())
    except OSError:
        return []
    found = []
    for folder in folders[:SUBFOLDERS_LOOKED_AT]:
        if accelerate.is_optimizer_folder(folder):  # optimizer state beside accelerate's model folder
            continue
        for name, reader in READERS.items():
            try:
                if reader.matches(folder):
                    found.append((folder, name))
                    break
            except (CkptError, OSError):  # unreadable or malformed: not one to suggest
                break
    return found


def read_layout(
    src: str | Path, *, format: str | None = None, model: ModelInfo | None = None,
    tables: Mapping[str, object] | None = None, **options: str | None
) -> Layout:
    """Describe a checkpoint directory as a layout, reading metadata and headers only.

    The readers carry no table of what a framework's modules are: what a source convention tells a reader
    (``tables``, by format name) comes from :data:`ckpttool.families.registry.READER_TABLES`, handed down by the
    one place that reads a source (:func:`ckpttool.read_layout`, :func:`ckpttool.commands.source.read_layout`);
    a reader that needs its table refuses without it (``megatron-legacy``).

    Args:
        src: the checkpoint directory.
        format: a reader name (``dcp``, ``hf-distributed``, ``sidecar``, ``hf``); detected when None.
        model: what the config says the model looks like; needed where the format records no global shapes
            (transformers distributed checkpoints).
        tables: format name -> what that format's source convention tells its reader (a reader of a format not
            named gets nothing).
        options: reader options (``weights="module"``); None values are left out. A reader that does not
            take an option refuses it.

    Raises:
        SourceError: ``src`` is, holds or sits above a PEFT adapter (:func:`find_adapter`), which no reader
            reads yet; the metadata is malformed (every value is checked: :mod:`ckpttool.readers.validate`), inconsistent,
            or names files outside the directory; a file cannot be read (the ``OSError``, naming the file).
        FormatNotDetectedError: nothing recognisable in ``src``.

    Anything else a reader raises is a bug in ckpttool, never caught here: the CLI reports it as an internal error.

    Example:
        >>> layout = read_layout("fixtures/llama_fsdp2_dcp/checkpoint")  # doctest: +SKIP
        >>> layout.tensors["model.embed_tokens.weight"].global_shape  # doctest: +SKIP
        (1001, 32)
    """
    root = Path(src)
    if format is None:
        format = detect_format(root)
    elif format not in READERS:
        raise SourceError(f"format={format!r} is not a format ckpttool reads; known: {', '.join(READERS)}")
    else:
        _check_directory(root)
        _refuse_adapter(root, find_adapter(root))
    reader = READERS[format]
    given = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(given) - set(reader.options))
    if unknown:
        raise SourceError(f"'{root}': {unknown[0]}={given[unknown[0]]!r} does not apply to the {format} format")
    told = {"tables": tables[format]} if tables is not None and format in tables else {}
    try:
        layout = reader.read(root, model, **told, **given)
    except OSError as e:  # a file the reader opens is unreadable (permissions, I/O error): the input, not a bug
        if isinstance(e, CkptError):
            raise
        raise SourceError(f"'{e.filename or root}': cannot read it: {e.strerror or e}") from None
    _refuse_links_out(layout)
    return layout


def census(root: Path, format: str | None = None, weights: str | None = None,
           tables: Mapping[str, object] | None = None) -> Census | None:
    """What the checkpoint in ``root`` holds, read without a model (``tables`` as :func:`read_layout` takes them),
    for :func:`ckpttool.model.config_sizes.check_config_sizes`; None when it cannot be read so."""
    try:
        return Census.of(read_layout(root, format=format, weights=weights, tables=tables))
    except CkptError:  # no global shapes without the model, or a broken source: the real read says why
        return None


def _refuse_links_out(layout: Layout) -> None:
    """Every file a piece names stays inside the layout's root, links followed (each reader opens its files through
    :mod:`ckpttool.io.paths`; this holds the rule for the bytes the executor will copy, whatever the reader).

    Raises:
        LinkOutError: a piece's file, or a folder on the way to it, is a symlink out of the source.
    """
    root = Path(layout.root)
    files = {p.file for t in layout.tensors.values() for p in t.pieces}
    # each folder on the way once (a universal checkpoint has a folder per parameter): one lstat per path
    paths = sorted({"/".join(parts[:i]) for parts in (PurePosixPath(f).parts for f in files)
                    for i in range(1, len(parts) + 1)}, key=lambda p: (p.count("/"), p))
    for path in paths:
        if (root / path).is_symlink():
            contained(root, path)


def _check_directory(root: Path) -> None:
    if not root.exists():
        raise SourceNotFoundError(f"'{root}': no such file or directory")
    if not root.is_dir():
        raise SourceError(f"'{root}': not a directory; give the checkpoint's directory")
