"""``ckpttool.jsontext.dumps`` writes exactly ``json.dumps(value, indent=2)``: the ``--json`` documents users and
tests parse, byte for byte, whatever the value."""

from __future__ import annotations

import enum
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpttool.jsontext import dumps

scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text()
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    | st.lists(st.integers(), max_size=4) | st.lists(st.text(max_size=4), max_size=4),
    max_leaves=30,
)


@given(values)
def test_any_json_value_is_written_as_json_dumps_writes_it(value):
    assert dumps(value) == json.dumps(value, indent=2)


class Color(enum.IntEnum):
    RED = 1


class Name(str):
    pass


@pytest.mark.parametrize("value", [
    {"targets": [{"name": "w", "shape": [256, 32], "dtype": "BF16", "pieces": 1, "sources": ["w"]}], "notes": []},
    {"empty": {}, "list": [], "tuple": (1, "a"), "nested": [[1, 2], ["é", "\n"], [1.5, None]]},
    [math.nan, math.inf, -math.inf, 0.1, -0.0, 10**30, True, False, None],
    {1: "a non-string key", None: [1]},  # json.dumps turns keys into strings: left to it
    [Color.RED, Name("a str subclass"), (Color.RED, 2)],  # subclasses: left to json.dumps
    "ünïcode \u2028 and \x00",
])
def test_documents_and_the_values_left_to_json_dumps(value):
    assert dumps(value) == json.dumps(value, indent=2)


def test_a_value_json_cannot_write_raises_what_json_dumps_raises():
    with pytest.raises(TypeError, match="Object of type set is not JSON serializable"):
        dumps({"a": [1, {2}]})
    cycle: list = []
    cycle.append(cycle)
    with pytest.raises(ValueError, match="Circular reference detected"):
        dumps(cycle)
