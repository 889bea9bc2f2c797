"""What the command line shows on a terminal: escaped names, the progress bar, the help layout, closed pipes.

Kept apart from :mod:`ckpttool.cli` (which parses options and calls the API) because each piece here guards
against something a terminal does: a tensor name holding a newline or an escape sequence would forge lines
of a report; a log line written while a bar is drawn tears the bar; ``ckpttool audit BAD | head -3`` closes
stdout while the report is printed, and the exit code must still be the audit's.
"""

from __future__ import annotations

import logging
import os
import re
import sys
from typing import Any, TextIO

import click


def shown(name: str) -> str:
    """A name (tensor, file) as the terminal shows it: unchanged when every character prints, else its Python
    ``repr`` (quoted, with ``\\n``, ``\\x1b`` ... escaped), so it cannot start a line or move the cursor."""
    return name if name.isprintable() else repr(name)


def quoted(name: str) -> str:
    """A name (tensor, file) for a message, in quotes: ``'name'`` when every character prints, else its
    :func:`shown` form (the Python ``repr``, which quotes it and escapes ``\\n``, ``\\x1b`` ...)."""
    return f"'{name}'" if name.isprintable() else shown(name)


def escaped(text: str, *, lines: bool = False) -> str:
    """A message with every control character escaped (``\\x1b`` becomes the four characters ``\\x1b``);
    with ``lines``, its own line breaks are kept (multi-line error messages) and only the rest is escaped."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() or (lines and c == "\n") else repr(c)[1:-1] for c in text)


def size_text(n: int) -> str:
    """A size as summaries and plans show it, in binary units: ``512 B``, ``1.5 KiB``, ``2.0 GiB``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


#: tqdm's default format without units on the counts; here "12.3MB/45.6MB" (decimal, as the rate)
_BAR_FORMAT = "{l_bar}{bar}| {n_fmt}B/{total_fmt}B [{elapsed}<{remaining}, {rate_fmt}]"


class Bar:
    """A tqdm bar on stderr, opened at the first bytes done (nothing shows while planning fails).

    While it exists, log records go through ``tqdm.write`` (so a warning never tears the bar); :meth:`close`
    ends both. After a failure or Ctrl-C it is closed with ``clear=True``, before the message is printed,
    so no stale bar is left above it; calls that arrive after (from worker threads) are ignored. Sizes are
    decimal (``MB`` is 10**6 bytes): tqdm names its units k, M, G whatever the divisor.
    """

    def __init__(self, desc: str = "merge") -> None:
        from tqdm.contrib.logging import logging_redirect_tqdm

        self._bar: Any = None
        self._desc = desc
        self._closed = False
        self._redirect = logging_redirect_tqdm(loggers=[logging.getLogger()])
        self._redirect.__enter__()

    def __call__(self, done: int, total: int) -> None:
        if self._closed:
            return
        if self._bar is None:
            from tqdm import tqdm

            self._bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1000, desc=self._desc,
                             file=sys.stderr, dynamic_ncols=True, bar_format=_BAR_FORMAT)
        self._bar.update(done)

    def close(self, *, clear: bool = False) -> None:
        """Close the bar (``clear``: erase it, after a failure) and give log records their handlers back."""
        if self._closed:
            return
        self._closed = True
        if self._bar is not None:
            if clear:
                self._bar.leave = False
            self._bar.close()
        self._redirect.__exit__(None, None, None)


class Command(click.Command):
    """A command whose one-line summary in the top-level ``--help`` is its docstring's first sentence, uncut
    (click shortens it to the terminal width and ends it with ``...``)."""

    def get_short_help_str(self, limit: int = 45) -> str:
        if self.short_help:
            return self.short_help
        paragraph = " ".join((self.help or "").strip().split("\n\n")[0].split())
        return re.split(r"(?<=\.)\s+(?=[A-Z0-9])", paragraph)[0]


class Group(click.Group):
    """The top-level group: its commands are :class:`Command`, and it makes stdout and stderr survive a
    reader that goes away (:func:`survive_closed_pipes`). Start-up's Ctrl-C handling lasts until a command has
    imported the API and calls it (``ckpttool.cli._run``): those imports (torch) are still start-up."""

    command_class = Command

    def main(self, *args: Any, **kwargs: Any) -> Any:
        survive_closed_pipes()
        return super().main(*args, **kwargs)


class _PipeGuard:
    """A process stream whose reader may go away (``| head``): on a broken pipe the stream's file descriptor is
    pointed at ``/dev/null`` and output continues there, so the command ends with its own exit code (not
    click's 1, nor Python's 120 when the final flush fails)."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        try:
            return self._stream.write(text)
        except BrokenPipeError:
            self._to_devnull()
            return len(text)

    def flush(self) -> None:
        try:
            self._stream.flush()
        except BrokenPipeError:
            self._to_devnull()

    def _to_devnull(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self._stream.fileno())
        finally:
            os.close(devnull)
        try:  # what was buffered for the closed pipe now goes to /dev/null
            self._stream.flush()
        except (BrokenPipeError, ValueError):
            pass

    def __getattr__(self, name: str) -> Any:
        return getattr(self._stream, name)


def survive_closed_pipes() -> None:
    """Guard the process's own stdout and stderr (not a test runner's captured streams) against broken pipes."""
    if sys.stdout is not None and sys.stdout is sys.__stdout__:
        sys.stdout = _PipeGuard(sys.stdout)  # type: ignore[assignment]
    if sys.stderr is not None and sys.stderr is sys.__stderr__:
        sys.stderr = _PipeGuard(sys.stderr)  # type: ignore[assignment]
