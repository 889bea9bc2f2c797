"""Counts in words: ``1 error``, ``2 errors``, ``0 warnings``, one helper for every count a report prints.

Kept free of imports so that the library (the audit's causes, the HTML report) and the command line word
counts the same way.
"""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """``n`` and ``noun``, the noun in the plural unless ``n`` is 1.

    Args:
        n: the count.
        noun: the singular (``"error"``).
        plural: the plural when it is not ``noun + "s"`` (``"info"`` stays ``"info"``).

    Example:
        >>> counted(1, "error"), counted(0, "warning"), counted(3, "info", "info")
        ('1 error', '0 warnings', '3 info')
    """
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
