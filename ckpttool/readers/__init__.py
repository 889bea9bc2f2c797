"""Readers: one per on-disk format, each turning what it finds into a :class:`~ckpttool.layout.Layout`.

A reader is a module with ``NAME``, ``LOOKS_FOR`` (what detection checks, for error messages),
``matches(root) -> bool`` and ``read(root, model, **options) -> Layout``. Optionally:

- ``OPTIONS``: the reader options it takes (``weights``: ``"master"`` or ``"module"`` for formats that hold
  both fp32 master weights and module weights);
- ``to_hf(layout, info) -> (specs, notes, problems)``: the format's own cut of its tensors into HuggingFace
  tensors (fused QKV, SwiGLU pieces per TP rank, renames), where the generic rules of
  :mod:`ckpttool.models` cannot know it. ``problems`` are ``(source tensor, message)``.

Format knowledge lives only here; the plan and executor see pieces and boxes.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TypeVar

from ..errors import CkptError, FormatNotDetectedError, SourceError, SourceNotFoundError
from ..layout import Layout
from ..models import ModelInfo
from . import (
    colossalai,
    dcp,
    deepspeed,
    hf,
    hf_distributed,
    megatron_dist,
    megatron_legacy,
    sidecar,
    verl,
)

T = TypeVar("T")

#: in detection order: the most specific first
READERS: dict[str, ModuleType] = {
    sidecar.NAME: sidecar,
    deepspeed.NAME: deepspeed,
    verl.NAME: verl,
    colossalai.NAME: colossalai,
    megatron_dist.NAME: megatron_dist,
    megatron_legacy.NAME: megatron_legacy,
    dcp.NAME: dcp,
    hf_distributed.NAME: hf_distributed,
    hf.NAME: hf,
}


def detect_format(root: Path) -> str:
    """The name of the first reader that recognises ``root``.

    Raises:
        SourceNotFoundError: ``root`` does not exist.
        FormatNotDetectedError: no reader matched; the message lists what was looked for.
    """
    _check_directory(root)
    for name, reader in READERS.items():
        if reader.matches(root):
            return name
    looked = "\n".join(f"  - {reader.LOOKS_FOR} ({name})" for name, reader in READERS.items())
    raise FormatNotDetectedError(
        f"'{root}': no checkpoint format recognised. Looked for:\n{looked}\nPass --format to name one."
    )


def read_layout(
    src: str | Path, *, format: str | None = None, model: ModelInfo | None = None, **options: str | None
) -> Layout:
    """Describe a checkpoint directory as a layout, reading metadata and headers only.

    Args:
        src: the checkpoint directory.
        format: a reader name (``dcp``, ``hf-distributed``, ``sidecar``, ``hf``); detected when None.
        model: what the config says the model looks like; needed where the format records no global shapes
            (transformers distributed checkpoints).
        options: reader options (``weights="module"``); None values are left out. A reader that does not
            take an option refuses it.

    Raises:
        SourceError: the metadata is inconsistent or names files outside the directory.
        FormatNotDetectedError: nothing recognisable in ``src``.

    Example:
        >>> layout = read_layout("fixtures/llama_fsdp2_dcp/checkpoint")  # doctest: +SKIP
        >>> layout.tensors["model.embed_tokens.weight"].global_shape  # doctest: +SKIP
        (1001, 32)
    """
    root = Path(src)
    if format is None:
        format = detect_format(root)
    elif format not in READERS:
        raise SourceError(f"unknown format {format!r}; known: {', '.join(READERS)}")
    else:
        _check_directory(root)
    reader = READERS[format]
    given = {k: v for k, v in options.items() if v is not None}
    unknown = sorted(set(given) - set(getattr(reader, "OPTIONS", ())))
    if unknown:
        raise SourceError(f"'{root}': --{unknown[0]} does not apply to the {format} format")
    return guarded(format, root, lambda: reader.read(root, model, **given))


#: what a reader's parsing raises when metadata has the wrong types or shapes where it did not check them
MALFORMED = (KeyError, IndexError, TypeError, ValueError, AttributeError, ZeroDivisionError, OverflowError)


def guarded(format: str, root: Path, work: Callable[[], T]) -> T:
    """``work()`` (a reader reading ``root``), with what its metadata's unexpected contents raise turned into
    a :class:`SourceError`: a malformed checkpoint is the input's fault, never an internal error."""
    try:
        return work()
    except CkptError:
        raise
    except MALFORMED as e:
        raise SourceError(
            f"'{root}': malformed {format} checkpoint metadata ({type(e).__name__}: {e}); the files do not hold "
            "what this format writes"
        ) from None


def _check_directory(root: Path) -> None:
    if not root.exists():
        raise SourceNotFoundError(f"'{root}': no such file or directory")
    if not root.is_dir():
        raise SourceError(f"'{root}': not a directory; give the checkpoint's directory")
