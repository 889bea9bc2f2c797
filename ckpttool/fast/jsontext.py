"""``--json`` documents as text: exactly the text of ``json.dumps(value, indent=2)``, in a fraction of its time.

A dry run of a 90k-tensor checkpoint prints ~2.6M JSON values, one per line. On Python 3.11 the C encoder does
not indent, so ``json.dumps(indent=2)`` runs the pure-Python one, a generator per value: half a second. Here
lists of strings or of numbers, the bulk of such a document, are joined at C speed, a list of records (dicts
with the same keys: a plan's targets) is written a column at a time (:func:`_records`), and everything else is
written in one pass. Any value this module does not write itself (a subclass, a non-string key, a type JSON has
no spelling for) hands the whole document back to ``json.dumps``, so the text, and every error, are its own.

Stdlib only.
"""

from __future__ import annotations

import json
import math
from itertools import chain, repeat
from json.encoder import encode_basestring_ascii as _string
from operator import itemgetter
from typing import Any

_INF = float("inf")


class _Unusual(Exception):
    """A value :func:`dumps` leaves to ``json.dumps``."""


def dumps(value: Any) -> str:
    """``json.dumps(value, indent=2)``, the same text (ASCII, ``NaN``/``Infinity`` allowed, keys in order).

    Example:
        >>> dumps({"a": [1, 2], "b": {}})
        '{\\n  "a": [\\n    1,\\n    2\\n  ],\\n  "b": {}\\n}'
    """
    parts: list[str] = []
    try:
        _write(value, parts, "\n")
    except (_Unusual, RecursionError):  # json.dumps writes it, or raises its own error (a cycle, a type)
        return json.dumps(value, indent=2)
    return "".join(parts)


def _float(value: float) -> str:
    if math.isnan(value):
        return "NaN"
    if value == _INF:
        return "Infinity"
    if value == -_INF:
        return "-Infinity"
    return float.__repr__(value)


def _scalar(value: Any) -> str:
    kind = type(value)
    if kind is str:
        return _string(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        return _float(value)
    raise _Unusual


def _write(value: Any, parts: list[str], newline: str) -> None:
    """Append ``value``'s text to ``parts``; ``newline`` is a line break and the indentation of its line."""
    kind = type(value)
    if kind is dict:
        if not value:
            parts.append("{}")
            return
        inner = newline + "  "
        opening = "{" + inner
        for key, item in value.items():
            if type(key) is not str:
                raise _Unusual
            kind = type(item)  # strings and integers inline: most values of a large document
            text = _string(item) if kind is str else int.__repr__(item) if kind is int else _flat(item, inner)
            if text is None:
                parts.append(opening + _string(key) + ": ")
                _write(item, parts, inner)
            else:
                parts.append(opening + _string(key) + ": " + text)
            opening = "," + inner
        parts.append(newline + "}")
    elif kind is list or kind is tuple:
        text = _flat(value, newline)
        if text is not None:
            parts.append(text)
            return
        inner = newline + "  "
        records = _records(value, inner)
        if records is not None:
            parts.append("[" + inner + records + newline + "]")
            return
        opening = "[" + inner
        for item in value:
            parts.append(opening)
            opening = "," + inner
            _write(item, parts, inner)
        parts.append(newline + "]")
    else:
        parts.append(_scalar(value))


def _flat(value: Any, newline: str) -> str | None:
    """The text of a string, an integer, or a list of strings or of integers (one join at C speed: names,
    shapes); None for anything else."""
    kind = type(value)
    if kind is str:
        return _string(value)
    if kind is int:
        return int.__repr__(value)
    if kind is not list and kind is not tuple:
        return None
    if not value:
        return "[]"
    kinds = set(map(type, value))
    if kinds == _STR:
        items = map(_string, value)
    elif kinds == _INT:
        items = map(int.__repr__, value)
    else:
        return None
    inner = newline + "  "
    return "[" + inner + ("," + inner).join(items) + newline + "]"


_STR, _INT = {str}, {int}


def _records(value: Any, newline: str) -> str | None:
    """The text of the items of a list of dicts that have the same string keys in the same order, each dict
    written at ``newline`` and followed by a comma but the last; None for any other list. Each key's values are
    written together, as a column: strings and integers at C speed, lists of one value likewise, other lists once
    per distinct value, any other value on its own."""
    if len(value) < 2 or type(value[0]) is not dict or not value[0] or set(map(type, value)) != {dict}:
        return None
    keys = set(map(tuple, value))
    if len(keys) != 1:
        return None
    (names,) = keys
    if set(map(type, names)) != _STR:
        return None
    inner = newline + "  "
    columns: list[Any] = []
    for i, key in enumerate(names):
        opening = ("{" if i == 0 else ",") + inner + _string(key) + ": "
        columns.append(chain([opening], repeat(newline + "}," + newline + opening)) if i == 0 else repeat(opening))
        columns.append(_column(list(map(itemgetter(key), value)), inner))
    return "".join(chain.from_iterable(zip(*columns))) + newline + "}"


def _column(cells: list[Any], newline: str) -> list[str]:
    """The texts of ``cells``, each a value written at ``newline`` (see :func:`_records`)."""
    kinds = set(map(type, cells))
    if kinds == _STR:
        return list(map(_string, cells))
    if kinds == _INT:
        return list(map(int.__repr__, cells))
    if kinds <= _LISTS:
        inner = newline + "  "
        if set(map(len, cells)) == {1}:  # one item each (a target's one source): written a column too
            single = _column(list(map(itemgetter(0), cells)), inner)
            return list(map("".join, zip(repeat("[" + inner), single, repeat(newline + "]"))))
        items = set(map(type, chain.from_iterable(cells)))
        if items == _STR or items == _INT or not items:  # shapes: few distinct ones
            cells = list(map(tuple, cells))
            texts = {cell: _flat(cell, newline) for cell in set(cells)}
            return list(map(texts.__getitem__, cells))
    return [_cell(cell, newline) for cell in cells]


def _cell(value: Any, newline: str) -> str:
    text = _flat(value, newline)
    if text is not None:
        return text
    parts: list[str] = []
    _write(value, parts, newline)
    return "".join(parts)


_LISTS = {list, tuple}
