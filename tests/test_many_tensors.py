"""The shortcuts that make a 90k-tensor checkpoint quick to read and plan (benchmarks/many_tensors_bench.py) give
exactly what the general code gives: a header checked whole, a tensor declared with its one piece, a target
that is one whole piece copied as it is. Each is compared with the general path on the same input, valid or not.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.plan import plan as plan_module
from ckpttool.layout.layout import RAW, Box, Piece
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import SourceError
from ckpttool.commands.source import plan_source
from ckpttool.io.safetensors_format import _check_contiguous, _entry, _well_formed
from conftest import FIXTURES

# --------------------------------------------------------------------------------------------- safetensors headers

DATA_START = 8 + 64


def _per_tensor(header: dict, buffer: int) -> dict | str:
    """What the per-tensor checks make of ``header``: its entries, or the message they raise."""
    try:
        entries = {key: _entry("f", key, info, DATA_START, buffer) for key, info in header.items()}
        _check_contiguous("f", entries, DATA_START, DATA_START + buffer)
    except SourceError as e:
        return str(e)
    return entries


def _valid(shapes: list[list[int]], dtypes: list[str]) -> tuple[dict, int]:
    header, position = {}, 0
    for i, (shape, dtype) in enumerate(zip(shapes, dtypes)):
        size = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "I64": 8}[dtype]
        n = size
        for d in shape:
            n *= d
        header[f"t{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [position, position + n]}
        position += n
    return header, position


#: ways a header can go wrong, each a change of one record's field
BREAKS = [
    ("dtype", "F4"), ("dtype", None), ("dtype", ["F32"]), ("shape", [2, -1]), ("shape", [True]), ("shape", "2"),
    ("shape", [2.0]), ("shape", [[2]]), ("data_offsets", [0]), ("data_offsets", [0, 1, 2]), ("data_offsets", [-4, 0]),
    ("data_offsets", [8, 4]), ("data_offsets", [0, 10**9]), ("data_offsets", [0.0, 4]), ("data_offsets", "0-4"),
    ("data_offsets", [False, 4]), (None, "not a record"), (None, ["a list"]), (None, {}),
]


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.lists(st.integers(0, 4), max_size=3), min_size=0, max_size=5),
    st.data(),
)
def test_a_header_checked_whole_agrees_with_the_checks_one_tensor_at_a_time(shapes, data):
    dtypes = [data.draw(st.sampled_from(["F32", "BF16", "F8_E4M3", "I64"])) for _ in shapes]
    header, end = _valid(shapes, dtypes)
    buffer = end + data.draw(st.sampled_from([0, 0, 0, 4]))  # bytes after the last tensor, sometimes
    if header and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(sorted(header)))
        field, value = data.draw(st.sampled_from(BREAKS))
        if field is None:
            header[key] = value
        else:
            header[key] = {**header[key], field: value}
    if header and data.draw(st.booleans()):  # two tensors swap places, or overlap
        a, b = data.draw(st.sampled_from(sorted(header))), data.draw(st.sampled_from(sorted(header)))
        if isinstance(header[a], dict) and isinstance(header[b], dict):
            header[a] = {**header[a], "data_offsets": header[b].get("data_offsets")}
    expected = _per_tensor(header, buffer)
    found = _well_formed(header, DATA_START, buffer, DATA_START + buffer)
    if isinstance(expected, str):
        assert found is None, expected
    else:
        assert found == expected


def test_a_real_header_is_checked_whole():
    header, end = _valid([[4, 8], [], [0, 3], [16]], ["BF16", "F32", "I64", "F8_E4M3"])
    found = _well_formed(header, DATA_START, end, DATA_START + end)
    assert found is not None and found == _per_tensor(header, end)


# --------------------------------------------------------------------------------------------- the layout builder

def _declared_then_added(items: list[tuple[str, Piece]]) -> tuple[object, list[str]]:
    builder = LayoutBuilder("root", "hf")
    for fqn, piece in items:
        if builder.declare(fqn, piece.box.sizes, piece.dtype, where=f"'{piece.file}'"):
            builder.add(fqn, piece)
    return _built(builder)


def _added_whole(items: list[tuple[str, Piece]]) -> tuple[object, list[str]]:
    builder = LayoutBuilder("root", "hf")
    for fqn, piece in items:
        builder.add_whole(fqn, piece, where=f"'{piece.file}'")
    return _built(builder)


def _built(builder: LayoutBuilder) -> tuple[object, list[str]]:
    try:
        return builder.build(), []
    except SourceError as e:
        return None, str(e).splitlines()


def _piece(file: str, key: str, sizes: tuple, offsets: tuple | None = None, dtype: str = "BF16") -> Piece:
    return Piece(file, key, Box(offsets if offsets is not None else (0,) * len(sizes), sizes), dtype, RAW, 0, 0)


@pytest.mark.parametrize("items", [
    [("a", _piece("x", "a", (4, 8))), ("b", _piece("x", "b", ())), ("c", _piece("y", "c", (3,)))],
    [("empty", _piece("x", "empty", (0, 4)))],  # declared, but no piece of no element
    [("a", _piece("x", "a", (4,))), ("a", _piece("y", "a", (4,)))],  # a replica: two pieces
    [("a", _piece("x", "a", (4,))), ("a", _piece("y", "a", (5,)))],  # shapes disagree
    [("a", _piece("x", "a", (4,))), ("a", _piece("y", "a", (4,), dtype="F32"))],  # dtypes disagree
    [("a", _piece("x", "a", (4, 2), offsets=(1, 0)))],  # not at the origin: outside its declared shape
    [("a", _piece("x", "a", (-1, 2)))],  # a negative size
    [("a", _piece("x", "a", (True, 2)))],  # a size that is no plain integer
])
def test_a_tensor_added_whole_is_declared_and_added(items):
    assert _added_whole(items) == _declared_then_added(items)


# --------------------------------------------------------------------------------------------- the plan

@pytest.mark.parametrize(("source", "shortcuts"), [
    (FIXTURES / "llama_hf_tp2" / "reference", True),
    (FIXTURES / "llama_tp2_dcp" / "checkpoint", True),
    (FIXTURES / "mixtral_hf_tp2_ep2" / "checkpoint", True),
    (FIXTURES / "quantized_deepseek_v3_fp8" / "checkpoint", True),  # FP8 weights, their scales beside them
    # TP pieces, a padded vocab, fused QKV: since the slab proof (plan.tiling.slab_copies) the shortcut takes the
    # tensors cut along one dim too (4 of 26 here), the rest the general path
    (FIXTURES / "megatron_tp2_padvocab" / "legacy", True),
])
def test_a_whole_piece_copied_as_it_is_is_planned_as_the_general_path_plans_it(source, shortcuts, monkeypatch):
    whole_copy, taken = plan_module._whole_copy, []
    monkeypatch.setattr(plan_module, "_whole_copy", lambda *args: taken.append(whole_copy(*args)) or taken[-1])
    quick = plan_source(source)
    assert any(t is not None for t in taken) == shortcuts
    monkeypatch.setattr(plan_module, "_whole_copy", lambda layout, spec, dtype: None)
    general = plan_source(source)
    assert quick.plan == general.plan
    assert quick.uncovered == general.uncovered
    assert json.dumps([t.name for t in quick.plan.targets]) == json.dumps([t.name for t in general.plan.targets])


def test_a_target_of_a_piece_not_at_the_origin_is_left_to_the_general_path():
    from ckpttool.layout.layout import Layout, TensorLayout
    from ckpttool.plan.tiling import Slice
    from ckpttool.plan.plan import TargetSpec

    piece = _piece("x", "w", (2, 4), offsets=(2, 0))
    layout = Layout("root", "hf", {"w": TensorLayout("w", (4, 4), "BF16", (piece,))})
    whole = Box((0, 0), (4, 4))
    spec = TargetSpec("w", (4, 4), (Slice("w", whole, whole),))
    assert plan_module._whole_copy(layout, spec, None) is None
    plan, uncovered = plan_module.plan_covered(layout, [spec])
    assert plan.targets == () and uncovered[0][1] == [(
        "'w': rows 0..2 covered by no piece (shape [4, 4]; found 1 piece in 'x'). Is a rank's file missing, or the "
        "checkpoint incomplete?"
    )]
