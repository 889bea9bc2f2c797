"""Checks of what a checkpoint's metadata holds, one line each in a reader.

A reader walks objects that came out of a file: JSON, or a pickle read with stand-ins (:mod:`ckpttool.io.torch_save`,
:mod:`ckpttool.io.safe_pickle`). Any value in them can have any type: a parallel size can be a string, a list of
paddings ``None``, a shape infinite. Readers check every value before they use it, with these helpers, so bad input
is a :class:`~ckpttool.errors.SourceError` naming the file, what was read, what was expected and what was found;
anything else that escapes a reader is a bug in ckpttool and is reported as one.

Example:
    >>> args = {"tensor_model_parallel_size": "2"}
    >>> integer(args.get("tensor_model_parallel_size"), "args.tensor_model_parallel_size", "mp_rank_00/x.pt", minimum=1)
    Traceback (most recent call last):
    ...
    ckpttool.errors.SourceError: 'mp_rank_00/x.pt': malformed args.tensor_model_parallel_size: expected an integer >= 1, found '2' (a str)
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ckpttool.errors import SourceError
from ckpttool.io.safe_pickle import Record

T = TypeVar("T")
_ABSENT: Any = object()

_NAMES = {int: "an integer", float: "a number", str: "a string", list: "a list", tuple: "a tuple", dict: "a dict",
          bool: "a boolean", type(None): "nothing", Record: "a record of named fields"}


def malformed(file: str, what: str, expected: str, found: Any) -> SourceError:
    """The error for ``what`` in ``file``: ``'<file>': malformed <what>: expected <expected>, found <value> (<type>)``."""
    return SourceError(f"'{file}': malformed {what}: expected {expected}, found {shown(found)}")


def shown(value: Any) -> str:
    """A value for a message: its repr, cut to 60 characters, and its type."""
    text = repr(value)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = type(value).__name__
    return f"{text} ({'an' if kind[:1] in 'aeiou' else 'a'} {kind})"


def expect(value: Any, kind: type[T] | tuple[type, ...], what: str, file: str) -> T:
    """``value`` when it is a ``kind`` (a ``bool`` is not an ``int`` here), else a :class:`SourceError`."""
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds):
        return value  # type: ignore[return-value]
    raise malformed(file, what, _expected(kinds), value)


def integer(value: Any, what: str, file: str, *, minimum: int | None = 0) -> int:
    """``value`` when it is an integer (not a bool) of at least ``minimum`` (None: any), else a :class:`SourceError`."""
    if isinstance(value, int) and not isinstance(value, bool) and (minimum is None or value >= minimum):
        return value
    raise malformed(file, what, "an integer" + (f" >= {minimum}" if minimum is not None else ""), value)


def dims(value: Any, what: str, file: str) -> tuple[int, ...]:
    """``value`` as a shape: a tuple or list of non-negative integers, else a :class:`SourceError`."""
    if isinstance(value, (tuple, list)) and all(type(n) is int and n >= 0 for n in value):
        return tuple(value)
    raise malformed(file, what, "a list of non-negative integers", value)


def field(mapping: Any, key: str, kind: type[T] | tuple[type, ...] | Callable[[Any, str, str], T], file: str, *,
          what: str | None = None, default: Any = _ABSENT) -> T:
    """``mapping[key]`` checked with :func:`expect` (``kind`` a type or types) or with ``kind`` itself (a check
    such as :func:`integer` or :func:`dims`). Absent (or ``mapping`` is no mapping): ``default`` when given, else
    a :class:`SourceError`; None counts as absent when there is a default. ``mapping`` may be a dict or a pickle
    stand-in (:class:`~ckpttool.io.safe_pickle.Record`).

    Example:
        >>> field({"offset": 8}, "offset", integer, ".metadata", what="'w' storage offset")
        8
    """
    label = what or key
    value = mapping.get(key, _ABSENT) if isinstance(mapping, (Mapping, Record)) else _ABSENT
    if value is _ABSENT or (value is None and default is not _ABSENT):
        if default is not _ABSENT:
            return default  # type: ignore[no-any-return]
        expected = _expected(kind)
        raise SourceError(f"'{file}': malformed {label}: expected {expected}, found nothing")
    if isinstance(kind, (type, tuple)):
        return expect(value, kind, label, file)
    return kind(value, label, file)


def _expected(kind: Any) -> str:
    if kind is integer:
        return "an integer"
    if kind is dims:
        return "a list of non-negative integers"
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(_NAMES.get(k, f"a {getattr(k, '__name__', k)}") for k in kinds)
