"""The one exception hierarchy of ckpttool.

Every error that bad input can cause is a :class:`CkptError`. Subclasses also inherit the builtin they
resemble, so callers can catch either ``ckpttool.CoverageError`` or plain ``ValueError``. The CLI turns any
``CkptError`` into ``Error: <message>`` on stderr and exit code 1, without a traceback.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ckpttool.findings import Report


class CkptError(Exception):
    """Base class of every error ckpttool raises on purpose."""


class SourceError(CkptError, ValueError):
    """The source checkpoint is malformed, inconsistent or unsupported."""


class SourceNotFoundError(CkptError, FileNotFoundError):
    """The source path, or a file its metadata names, does not exist."""


class LinkOutError(SourceError):
    """A symlink in the source leads out of it (ckpttool follows links only inside the source); also raised while
    a format is being recognised, so the link is named rather than the format missed."""


class FormatNotDetectedError(SourceError):
    """No supported checkpoint format was recognised in the source directory."""


class UnsafePickleError(SourceError):
    """A pickled file asked for a class outside ckpttool's allow-list and was refused unread."""


class PickleBombError(SourceError):
    """A pickled file was refused because reading it would take work without bound: objects shared and handed
    over and over (a graph that is exponential as a tree), a reference cycle, or nesting too deep."""


class ArgumentError(CkptError, ValueError):
    """A Python API argument has a value the call does not take; the message names the argument (``dtype=``).

    The command line never shows these: its options are checked by click before the API is called.
    """


class ConfigError(CkptError, ValueError):
    """The model config is missing, unreadable, or disagrees with the checkpoint."""


class DestinationError(CkptError, FileExistsError):
    """The destination cannot be written safely (exists, lies inside the source, not writable)."""


class OutputError(CkptError, OSError):
    """Writing the output failed (disk full, I/O error); nothing was published at the destination."""


class CoverageError(CkptError, ValueError):
    """The plan does not tile every target tensor exactly once.

    ``problems`` holds one message per defect, all collected before raising.
    """

    def __init__(self, problems: Iterable[str]) -> None:
        self.problems = tuple(problems)
        count = len(self.problems)
        head = f"the checkpoint does not cover its tensors exactly ({count} problem{'s' if count != 1 else ''}):"
        shown = self.problems[:20]
        more = [f"... and {count - len(shown)} more"] if count > len(shown) else []
        super().__init__("\n".join([head, *(f"  - {p}" for p in shown), *more]))


class AuditError(CkptError):
    """The merged checkpoint failed its audit; nothing was published. ``report`` holds every finding."""

    def __init__(self, report: Report, output: str) -> None:
        self.report = report
        errors = report.errors
        lines = [f"  - [{f.code}] {f.message}" for f in errors[:20]]
        if len(errors) > 20:
            lines.append(f"  ... and {len(errors) - 20} more")
        super().__init__(
            f"the merged checkpoint fails its audit ({len(errors)} error{'s' if len(errors) != 1 else ''}); nothing was "
            f"published at '{output}':\n" + "\n".join(lines) + "\nPass audit=False to publish it anyway."
        )


class ForwardError(CkptError):
    """The merged checkpoint fails its forward check (``verify_forward=True``); nothing was published.
    ``problems`` holds every one, each naming its tensor or position."""

    def __init__(self, problems: Iterable[str], output: str) -> None:
        self.problems = tuple(problems)
        count = len(self.problems)
        lines = [f"  - {p}" for p in self.problems[:20]] + ([f"  ... and {count - 20} more"] if count > 20 else [])
        super().__init__(
            f"the merged checkpoint fails its forward check ({count} problem{'s' if count != 1 else ''}); nothing was "
            f"published at '{output}':\n" + "\n".join(lines)
        )


class Interrupted(KeyboardInterrupt):
    """Ctrl-C stopped a merge that kept its staging directory, with a journal, for ``resume=True``.

    Not an error of the input: a ``KeyboardInterrupt`` (so callers that catch that still do), saying what can
    be resumed: ``kept`` is the staging directory that holds the files finished so far.
    """

    def __init__(self, kept: str) -> None:
        self.kept = kept
        super().__init__(f"interrupted; the files finished so far are kept in '{kept}' for resume=True")
