"""Ctrl-C while the ``ckpttool`` command starts: one line, no traceback.

Before the command line is parsed, the process imports torch, transformers' helpers and every reader (a
second or more). A Ctrl-C there would print a long traceback through the import machinery. When this process
*is* the ``ckpttool`` command (its console script, or ``python -m ckpttool``, also under torchrun), the
package installs :func:`_interrupted` as the SIGINT handler first thing; the command line puts Python's own
handler back (:func:`restore_interrupts`) as soon as click runs, so an interrupt during a command is handled
by the command (``merge --resume`` advice, the progress bar erased). Importing ckpttool as a library changes
nothing.

Stdlib only: this module runs before anything else of ckpttool is imported.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType

#: what the command prints when interrupted while starting
MESSAGE = "Error: interrupted while starting; nothing was done"


def started_as_command() -> bool:
    """True when this process runs the ckpttool command rather than a program that imports ckpttool."""
    if os.path.basename(sys.argv[0] if sys.argv else "") in ("ckpttool", "ckpttool.exe"):
        return True  # the console script, while it imports ckpttool.cli
    argv = list(getattr(sys, "orig_argv", ()))
    return any(a == "-m" and b in ("ckpttool", "ckpttool.__main__") for a, b in zip(argv, argv[1:]))


def _interrupted(signum: int, frame: FrameType | None) -> None:
    sys.stderr.write(f"\n{MESSAGE}\n")
    sys.stderr.flush()
    raise SystemExit(1)


def quiet_interrupts() -> None:
    """Make Ctrl-C during start-up print :data:`MESSAGE` and exit 1, when this process is the command."""
    if not started_as_command():
        return
    try:
        signal.signal(signal.SIGINT, _interrupted)
    except ValueError:  # not the main thread: not a command starting
        pass


def restore_interrupts() -> None:
    """Give Ctrl-C back to Python (``KeyboardInterrupt``) once the command line runs."""
    try:
        if signal.getsignal(signal.SIGINT) is _interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:
        pass
