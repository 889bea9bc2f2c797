"""How a command of the command line runs: the API called, its errors worded for the command line (API arguments
named by their options) and turned into exit codes, Ctrl-C, rank 0 speaking under torchrun, JSON output, logging.

Exit codes: 0 ok, 1 error, 2 usage, 3 audit found errors, 130 interrupted (Ctrl-C).
"""

from __future__ import annotations

import json
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

import click

from ckpttool.console.startup import restore_interrupts
from ckpttool.console.terminal import Bar, escaped
from ckpttool.errors import CkptError
from ckpttool.fast.jsontext import dumps as json_text

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_AUDIT = 0, 1, 2, 3
#: Ctrl-C while a command runs: 128 + SIGINT, as a shell reports a process that SIGINT ended
EXIT_INTERRUPTED = 130


def speaks() -> bool:
    """Under torchrun only rank 0 prints; the others' failures reach it and it names them."""
    return os.environ.get("RANK", "0") == "0"


def fail(message: str, as_json: bool, code: int = EXIT_ERROR, tell: bool = False) -> None:
    """Print ``message`` (rank 0 only under torchrun, or every rank when ``tell``) and exit with ``code``."""
    if not (tell or speaks()):
        sys.exit(code)
    if as_json:
        click.echo(json.dumps({"status": "error", "error": message}))
    click.echo(f"Error: {escaped(message, lines=True)}", err=True)
    sys.exit(code)


def interrupted(error: KeyboardInterrupt) -> str:
    """What Ctrl-C left: the staging directory a merge kept for ``--resume`` (:class:`ckpttool.errors.Interrupted`),
    named only when one was really kept."""
    kept = getattr(error, "kept", None)
    if kept is None:
        return "interrupted; nothing was published"
    return (f"interrupted; nothing was published. The files finished so far are kept in '{kept}': run the same "
            "merge with --resume to continue")


#: the API's arguments, as library errors name them, and the options that set them on the command line
FLAGS = {
    "force=True": "--force", "audit=False": "--no-audit", "weights='master'": "--weights master",
    "weights='module'": "--weights module", "format='NAME'": "--format NAME", "dtype= asks": "--dtype asks",
    "config='PATH'": "--config PATH", "quantize='fp8'": "--quantize fp8", "without quantize=": "without --quantize",
    "dtype='bfloat16'": "--dtype bfloat16", "dequantize=True": "--dequantize",
    "config='path/to/config.json'": "--config path/to/config.json", "raw_names=True": "--raw-names",
    "drop=": "--drop ", "quantize='int4'": "--quantize int4", "quantize='nvfp4'": "--quantize nvfp4",
    "(group=)": "(--group)", "quantize='int4-asym'": "--quantize int4-asym", "scales_from= (--scales-from)": "--scales-from",
    "scales_from='": "--scales-from '",
}


def as_flags(message: str) -> str:
    """A library error worded for the command line: API arguments become the options that set them."""
    for argument, flag in FLAGS.items():
        message = message.replace(argument, flag)
    return message


def run(as_json: bool, call: Callable[[], Any], bar: Bar | None = None) -> Any:
    """Call the API; expected errors become a message and exit 1, anything else too (traceback on request).
    The progress ``bar`` is erased before any message, so no stale bar stays above it, and closed after success."""
    restore_interrupts()  # start-up (the command's imports) is over: Ctrl-C is the command's (ckpttool.console.startup)
    try:
        try:
            result = call()
            if bar is not None:
                bar.close()
            return result
        except BaseException:
            if bar is not None:
                bar.close(clear=True)
            raise
    except CkptError as e:
        if os.environ.get("CKPTTOOL_DEBUG") == "1":
            traceback.print_exc()
        # a lost process is told by every survivor: rank 0 may be the one lost
        fail(as_flags(str(e)), as_json, tell=getattr(e, "every_rank_tells", False))
    except KeyboardInterrupt as e:
        fail(interrupted(e), as_json, EXIT_INTERRUPTED)
    except Exception as e:  # bad input is a CkptError: anything else is a bug in ckpttool; no traceback unless asked
        if os.environ.get("CKPTTOOL_DEBUG") == "1":
            traceback.print_exc()
        fail(f"internal error in ckpttool ({type(e).__name__}: {e}); rerun with CKPTTOOL_DEBUG=1 and report it",
              as_json)


def printed_as_json(result: Any, as_json: bool) -> bool:
    """Say what a publishing command restored; print its JSON document. True when nothing more is to be printed
    (``--json``, or a torchrun rank other than 0)."""
    if not speaks():
        return True
    if result.restored:
        click.echo(f"note: {result.restored}", err=True)
    if as_json:
        click.echo(json_text(result.to_json()))  # json.dumps(indent=2)'s text, faster (ckpttool.fast.jsontext)
    return as_json


def setup_logging(verbose: int, quiet: bool) -> None:
    level = logging.WARNING if quiet else (logging.DEBUG if verbose > 1 else logging.INFO if verbose else logging.WARNING)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    logging.getLogger("ckpttool").setLevel(level)
