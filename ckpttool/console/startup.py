"""Ctrl-C while the ``ckpttool`` command starts: one line, no traceback.

Once the command line is parsed, the command imports what it needs: torch, transformers' helpers, the readers
(a second or more). A Ctrl-C there would print a long traceback through the import machinery. When this
process *is* the ``ckpttool`` command (its console script, or ``python -m ckpttool``, also under torchrun), the
package installs :func:`_interrupted` as the SIGINT handler first thing; the command line puts Python's own
handler back (:func:`restore_interrupts`) when the command has its imports and calls the API, so an interrupt
during a command is handled by the command (``merge --resume`` advice, the progress bar erased). Importing
ckpttool as a library changes nothing.

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


#: the cyclic garbage collector's thresholds for the command (Python's default: 700, 10, 10)
COLLECT_THRESHOLDS = (100_000, 20, 20)
#: the commands that plan a source (:func:`ckpttool.families.source.plan_layout`) before anything else of their own
PLANNING_COMMANDS = frozenset({"merge", "audit", "diff", "split"})
#: True while the command holds the collector off until its plan is built (see :func:`collect_rarely`)
_held = False


def collect_rarely() -> None:
    """Run the cyclic garbage collector less often, when this process is the command; not at all while a
    command that plans (:data:`PLANNING_COMMANDS`, not under torchrun) builds its plan.

    A plan of a 90k-tensor checkpoint allocates millions of small objects (boxes, pieces, copies) that are never
    garbage, and with the default thresholds every full collection walks them all again: half the time of a
    ``merge --dry-run`` (benchmarks/many_tensors_bench.py). Collections run a hundred times less often; and
    until the plan is built, not at all (each object would still be walked once, 8% of a dry run): planning
    makes no garbage cycles, and :func:`planned` then freezes what it built (``gc.freeze``: never walked again,
    freed as usual once unused) and lets the collector run again for the rest of the command.
    """
    if started_as_command():
        import gc

        gc.set_threshold(*COLLECT_THRESHOLDS)
        command = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
        # not under torchrun: its process groups' objects are collected as they always were (a split held the
        # collector off, froze them and aborted in gloo's teardown)
        if command in PLANNING_COMMANDS and gc.isenabled() and "WORLD_SIZE" not in os.environ:
            global _held
            gc.disable()
            _held = True


def planned() -> None:
    """A plan is built (:func:`ckpttool.families.source.plan_layout`): if the command held the collector off until now,
    freeze every object there is and let the collector run again. Does nothing otherwise (a library's caller,
    a second plan)."""
    global _held
    if _held:
        import gc

        _held = False
        gc.freeze()
        gc.enable()


def restore_interrupts() -> None:
    """Give Ctrl-C back to Python (``KeyboardInterrupt``) once the command line runs."""
    try:
        if signal.getsignal(signal.SIGINT) is _interrupted:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    except ValueError:
        pass
