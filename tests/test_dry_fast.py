"""Dry runs at 92k tensors, fast (issue 31): the shortcuts taken in the common case decide as the general code does.

- ``pickle_bounds._unshared``: a graph proven a tree at C speed passes :func:`bound_graph` without its walk; every
  other graph (shared parts, cycles, deep nesting, functions) goes to the exact walk, whose messages are unchanged.
"""

from __future__ import annotations

import pickle

import pytest

from ckpttool.errors import PickleBombError
from ckpttool.io import pickle_bounds
from ckpttool.io.pickle_bounds import MAX_DEPTH, bound_graph
from ckpttool.io.safe_pickle import load_metadata_pickle, record_class


def fresh_tree(n: int = 50) -> dict:
    """A DCP-like tree: records holding fresh shape tuples and chunk lists, nothing shared."""
    meta = record_class("TensorStorageMetadata")
    chunk = record_class("ChunkStorageMetadata")
    out = {}
    for i in range(n):
        m = meta()
        m.__setstate__({"size": tuple([4, i + 1]), "chunks": [chunk() for _ in range(2)]})
        for c, start in zip(m.chunks, (0, 2)):
            c.__setstate__({"offsets": tuple([start, 0]), "sizes": tuple([2, i + 1])})
        out[f"t{i}"] = m
    return out


def test_a_tree_is_proven_unshared():
    assert pickle_bounds._unshared(fresh_tree())
    assert pickle_bounds._unshared({"a": [[], (), [()], frozenset()], "b": ()})  # empty ones may be shared
    assert pickle_bounds._unshared("a leaf")


def shared_list() -> object:
    x = [1, 2]
    return {"a": x, "b": [x]}


def cycle() -> object:
    loop: list = []
    loop.append({"self": loop})
    return [loop]


def deep() -> object:
    d: list = []
    for _ in range(MAX_DEPTH + 5):
        d = [d]
    return d


def held_outside() -> object:
    tree = fresh_tree(3)
    held_outside.kept = tree["t1"].chunks  # type: ignore[attr-defined]
    return tree


@pytest.mark.parametrize("make", [shared_list, cycle, deep, held_outside, lambda: {"f": [len]},
                                  lambda: {"f": [lambda: 0]}, lambda: [bytearray(b"x")]])
def test_anything_else_is_left_to_the_exact_walk(make):
    assert not pickle_bounds._unshared(make())


def test_shortcut_or_not_bound_graph_decides_as_before(monkeypatch):
    """Every graph gets the same answer with the shortcut and without it."""
    graphs = [fresh_tree(), shared_list(), held_outside(), {"a": [(), ()]}]
    for graph in graphs:
        bound_graph(graph, "f.pt")
    monkeypatch.setattr(pickle_bounds, "_unshared", lambda obj: False)
    for graph in graphs:
        bound_graph(graph, "f.pt")


def test_a_cycle_and_deep_nesting_are_still_refused():
    with pytest.raises(PickleBombError, match="'.metadata': refused: its pickled objects contain themselves"):
        load_metadata_pickle(pickle.dumps(cycle()), ".metadata")
    with pytest.raises(PickleBombError, match=f"'.metadata': refused: its pickled objects are nested more than "
                                              f"{MAX_DEPTH} levels deep"):
        load_metadata_pickle(pickle.dumps(deep()), ".metadata")


def test_a_shared_graph_is_still_walked_and_refused():
    """A DAG whose tree walk is 2**60 nodes: refused with the exact walk's count."""
    node: list = [0]
    for _ in range(60):
        node = [node, node]
    with pytest.raises(PickleBombError, match=r"'f.pt': refused: .* would visit 3458764513820540927 objects "
                                              r"\(61 containers holding 121 references; the limit is 1001456\)"):
        bound_graph(node, "f.pt")


def test_an_unpickled_metadata_tree_takes_the_shortcut(monkeypatch):
    """A pickle of records with fresh tuples (as torch writes DCP's .metadata) is proven without the walk."""
    walked = []
    monkeypatch.setattr(pickle_bounds, "_parts", lambda node: walked.append(node))
    data = pickle.dumps({f"t{i}": {"size": (4, i), "chunks": [{"offsets": tuple([0, i]), "sizes": (4, i)}]}
                         for i in range(100)})
    assert load_metadata_pickle(data, ".metadata")["t7"]["size"] == (4, 7)
    assert walked == []


# --------------------------------------------------------------------------- plan: slabs proven by one sort

from ckpttool.layout.layout import RAW, Box, Piece  # noqa: E402
from ckpttool.plan.tiling import check_tiling, slab_copies  # noqa: E402


def pieces(*boxes: tuple[tuple[int, ...], tuple[int, ...]]) -> list[Piece]:
    return [Piece(f"r{i}.safetensors", "w", Box(o, s), "BF16", RAW, 0, 2 * len(s), ()) for i, (o, s) in enumerate(boxes)]


@pytest.mark.parametrize("shape, boxes", [
    ((8, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4))]),  # a TP pair along dim 0
    ((4, 9), [((0, 6), (4, 3)), ((0, 0), (4, 6))]),  # along dim 1, out of order, unequal
    ((2, 6, 3), [((0, 0, 0), (2, 2, 3)), ((0, 2, 0), (2, 2, 3)), ((0, 4, 0), (2, 2, 3))]),
])
def test_slabs_that_tile_are_copied_whole(shape, boxes):
    found = pieces(*boxes)
    copies = slab_copies(shape, found)
    assert [c.piece for c in copies] == found and [c.dst for c in copies] == [p.box for p in found]
    assert [c.src for c in copies] == [Box((0,) * len(shape), p.box.sizes) for p in found]
    assert check_tiling("w", shape, copies) == []
    equal = [c.src for c in copies if c.src.sizes == copies[0].src.sizes]
    assert all(b is equal[0] for b in equal)  # equal slabs share one box


@pytest.mark.parametrize("shape, boxes", [
    ((8, 4), [((0, 0), (4, 4)), ((5, 0), (3, 4))]),  # a gap
    ((8, 4), [((0, 0), (5, 4)), ((4, 0), (4, 4))]),  # an overlap
    ((8, 4), [((0, 0), (4, 4)), ((4, 0), (2, 4))]),  # short
    ((8, 4), [((0, 0), (4, 2)), ((4, 2), (4, 2))]),  # cut along two dims
    ((8, 4), [((0, 0), (8, 4)), ((0, 0), (8, 4))]),  # replicas
    ((8, 4), [((0, 0), (4, 4)), ((4, 0, 0), (4, 4, 1))]),  # a piece of other dims
    ((8, 4), [((0,), (4,)), ((4, 0), (4, 4))]),  # the first piece of other dims
    ((8, 4), [((0, 0), (8, 4))]),  # one piece: the one-copy path's
    ((0, 4), [((0, 0), (0, 4)), ((0, 0), (0, 4))]),  # empty
])
def test_anything_else_goes_to_the_general_proof(shape, boxes):
    assert slab_copies(shape, pieces(*boxes)) is None
