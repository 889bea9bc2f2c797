"""JSON from a checkpoint: a key twice (when asked) and nesting too deep are ``json.JSONDecodeError``s with a
message that says why, never ``RecursionError``."""

from __future__ import annotations

import json

import pytest

from ckpttool.io.jsonfile import JSONRefused, loads


def test_plain_json_is_parsed_as_json_loads_parses_it():
    text = '{"a": [1, 2.5, null, true], "b": {"c": "d"}}'
    assert loads(text) == json.loads(text) == loads(text.encode(), unique_keys=True)


def test_a_key_twice_is_refused_only_when_asked():
    assert loads('{"a": 1, "a": 2}') == {"a": 2}
    with pytest.raises(JSONRefused) as excinfo:
        loads('{"x": {"a": 1, "a": 2}}', unique_keys=True)
    assert str(excinfo.value) == "the key 'a' appears twice in one object"
    assert isinstance(excinfo.value, json.JSONDecodeError) and isinstance(excinfo.value, ValueError)


@pytest.mark.parametrize("text", ["[" * 100_000 + "]" * 100_000, '{"a":' * 50_000 + "1" + "}" * 50_000])
def test_nesting_too_deep_is_a_json_error_not_a_recursion_error(text):
    with pytest.raises(json.JSONDecodeError) as excinfo:
        loads(text)
    assert str(excinfo.value) == "nested too deeply (more levels of arrays and objects than ckpttool parses)"


def test_bytes_that_are_not_utf8_raise_unicode_decode_error():
    with pytest.raises(UnicodeDecodeError):
        loads(b'{"a": "\xff"}')
