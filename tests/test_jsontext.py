"""``ckpttool.fast.jsontext.dumps`` writes exactly ``json.dumps(value, indent=2)``: the ``--json`` documents users and
tests parse, byte for byte, whatever the value."""

from __future__ import annotations

import enum
import json
import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckpttool.fast.jsontext import dumps

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


records = st.lists(st.fixed_dictionaries({
    "name": st.text(max_size=4), "shape": st.lists(st.integers(), max_size=3) | st.tuples(st.integers()),
    "one": st.lists(scalars | st.lists(st.integers(), max_size=2), min_size=1, max_size=1),
    "%s é": values, "n": st.integers() | st.booleans(),
}), min_size=2, max_size=5)


@given(records)
def test_lists_of_records_with_the_same_keys_are_written_as_json_dumps_writes_them(value):
    assert dumps(value) == json.dumps(value, indent=2)
    assert dumps({"targets": value, "nested": [value, value]}) == json.dumps({"targets": value, "nested": [value, value]}, indent=2)


@pytest.mark.parametrize("value", [
    [{"a": 1, "b": [1, 2]}, {"a": 2, "b": []}],
    [{"a": [[1]], "b": [{"x": 1}]}, {"a": [[2, 3]], "b": [{"y": 2.5}]}],
    [{"a": ["x"]}, {"a": [1]}, {"a": [None]}, {"a": [[]]}, {"a": [{}]}],
    [{"a": 1}, {"b": 1}],
    [{"a": 1, "b": 2}, {"b": 2, "a": 1}],  # the same keys in another order: not one table
    [{"a": 1}, {"a": 2}, [3]],
    [{"a": Color.RED}, {"a": 1}],
])
def test_lists_of_records_and_lists_that_look_like_them(value):
    assert dumps(value) == json.dumps(value, indent=2)
