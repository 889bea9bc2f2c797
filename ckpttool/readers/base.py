"""The reader protocol: what every format reader offers the rest of ckpttool, and in which order it is used.

1. :meth:`Reader.matches` — detection: does this directory hold the format? Cheap (names and small files),
   never raises on a directory of another format; several readers may claim one directory
   (:mod:`.claims` decides).
2. :meth:`Reader.read` — the directory as a :class:`~ckpttool.layout.layout.Layout`: every global tensor, its recorded
   shape, dtype, padding and the pieces that hold it, from metadata and headers only (no tensor byte is read).
   ``model`` is what the config says the model looks like, for formats that record no global shapes; ``options``
   are the reader's own (:attr:`Reader.options`, e.g. ``weights="module"``). Bad input is a
   :class:`~ckpttool.errors.SourceError` naming the file; anything else is a bug.

A reader describes bytes and boxes in its format's own tensor names; what those names mean for a model family is
the business of :mod:`ckpttool.families`, which readers never import.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import Layout


class Reader(Protocol):
    """A format reader (see the module docstring for the call order)."""

    @property
    def name(self) -> str:
        """The format's name, as ``--format`` takes it."""
        ...

    @property
    def looks_for(self) -> str:
        """What detection looks for, in words, for the message when nothing matched."""
        ...

    @property
    def options(self) -> tuple[str, ...]:
        """The reader options :meth:`read` takes."""
        ...

    def matches(self, root: Path) -> bool:
        """True when ``root`` holds a checkpoint of this format."""
        ...

    def read(self, root: Path, model: ModelInfo | None, **options: str) -> Layout:
        """``root`` as a layout, from metadata and headers only."""
        ...


@dataclass(frozen=True, slots=True)
class FormatReader:
    """A :class:`Reader` made of a format module's functions; each reader module defines one as ``READER``."""

    name: str
    looks_for: str
    matches: Callable[[Path], bool]
    read: Callable[..., Layout]
    options: tuple[str, ...] = ()
