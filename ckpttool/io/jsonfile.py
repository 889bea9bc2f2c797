"""JSON from a checkpoint, parsed as strictly as its consumers parse it, with every failure a ``ValueError``.

``json.loads`` keeps the last of two equal keys without a word, and deeply nested input (``[[[[...]]]]``)
raises ``RecursionError``, which is no ``ValueError``: callers that catch ``json.JSONDecodeError`` would let it
through as an internal error. :func:`loads` turns both into :class:`JSONRefused`, a ``json.JSONDecodeError``,
so a caller's existing ``except json.JSONDecodeError`` names the file and says why.

Example:
    >>> loads('{"a": 1, "a": 2}', unique_keys=True)
    Traceback (most recent call last):
    ...
    ckpttool.io.jsonfile.JSONRefused: the key 'a' appears twice in one object
"""

from __future__ import annotations

import json
from typing import Any


class JSONRefused(json.JSONDecodeError):
    """JSON that parses in principle but is refused: a key twice in one object, or nesting too deep."""

    def __init__(self, message: str, doc: str) -> None:
        super().__init__(message, doc, 0)
        self.args = (message,)  # no "line 1 column 1 (char 0)": the position is not known

    def __str__(self) -> str:
        return str(self.args[0])


def loads(text: str | bytes, *, unique_keys: bool = False) -> Any:
    """``json.loads(text)``, refusing nesting deeper than Python's parser takes and, with ``unique_keys``, a
    key that appears twice in one object (the safetensors library refuses such a header).

    Raises:
        json.JSONDecodeError: not JSON, or refused (:class:`JSONRefused`).
        UnicodeDecodeError: ``text`` is bytes that are not UTF-8.
    """
    doc = text if isinstance(text, str) else text.decode("utf-8")
    hook = _unique if unique_keys else None
    try:
        return json.loads(doc, object_pairs_hook=hook)
    except RecursionError:
        raise JSONRefused("nested too deeply (more levels of arrays and objects than ckpttool parses)", doc) from None
    except _Duplicate as e:
        raise JSONRefused(f"the key {e.key!r} appears twice in one object", doc) from None


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)  # at C speed: a safetensors header holds up to thousands of keys, a checkpoint 90k
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _Duplicate(key)
            seen.add(key)
    return result
