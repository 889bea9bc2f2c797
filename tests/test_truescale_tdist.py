"""Megatron-Core torch_dist at true scale (issue 31): split's plan finds each chunk's slices by a bisect
(:class:`ckpttool.plan.compose.SliceIndex`) instead of composing every chunk from all of a tensor's
slices; these tests hold it to the slices a scan finds. Timing is benchmarks/truescale_readers.py's business."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from ckpttool.plan.compose import SliceIndex
from ckpttool.layout.layout import Box
from ckpttool.plan.tiling import Slice


def _stacked(experts: int, rows: int = 4, cols: int = 3) -> list[Slice]:
    """A stacked ``(experts, rows, cols)`` tensor made of one HF tensor per expert, in a shuffled order."""
    order = [(7 * e) % experts for e in range(experts)]
    return [Slice(f"e{e}", Box((0, 0), (rows, cols)), Box((e, 0, 0), (1, rows, cols))) for e in order]


def _targets(slices, dtypes=None):
    return {s.source: SimpleNamespace(dtype=(dtypes or {}).get(s.source, "BF16"), source_dtype="BF16") for s in slices}


@pytest.mark.parametrize("box", [Box((5, 0, 0), (1, 4, 3)), Box((0, 2, 0), (1, 2, 3)), Box((3, 0, 1), (4, 4, 2)),
                                 Box((0, 0, 0), (16, 4, 3))])
def test_the_index_finds_the_slices_a_scan_finds_in_their_order(box):
    slices = _stacked(16)
    found = SliceIndex(slices, _targets(slices)).meeting(box)
    assert list(found) == [s for s in slices if s.dst.intersect(box) is not None]


def test_slices_of_uneven_rows_are_found_by_the_longest():
    slices = [Slice("a", Box((0, 0), (10, 2)), Box((0, 0), (10, 2)))] + [
        Slice(f"r{i}", Box((0, 0), (1, 2)), Box((10 + i, 0), (1, 2))) for i in range(10)]
    index = SliceIndex(slices, _targets(slices))
    for box in (Box((9, 0), (2, 2)), Box((3, 0), (1, 2)), Box((15, 0), (1, 2))):
        assert list(index.meeting(box)) == [s for s in slices if s.dst.intersect(box) is not None]


def test_a_box_no_slice_meets_gets_them_all_so_compose_names_the_gap():
    slices = _stacked(16)
    assert SliceIndex(slices, _targets(slices)).meeting(Box((40, 0, 0), (1, 4, 3))) == tuple(slices)


def test_slices_of_several_dtypes_are_given_whole_so_compose_refuses_them():
    slices = _stacked(16)
    index = SliceIndex(slices, _targets(slices, {"e3": "F32"}))
    assert index.meeting(Box((5, 0, 0), (1, 4, 3))) == tuple(slices)


def test_a_row_index_finds_every_box_a_box_intersects_in_their_order():
    """:class:`RowIndex` (what a plan uses to find the pieces a target needs, and SliceIndex the slices a chunk
    needs) against a scan: uneven rows, overlapping replicas, empty shards, boxes past the end."""
    import random

    from ckpttool.layout.layout import RowIndex

    rng = random.Random(31)
    boxes = [Box((rng.randrange(0, 60), rng.randrange(0, 4)), (rng.randrange(0, 9), rng.randrange(1, 4)))
             for _ in range(200)]
    index = RowIndex(boxes)
    for _ in range(300):
        box = Box((rng.randrange(-3, 70), rng.randrange(0, 4)), (rng.randrange(1, 12), rng.randrange(1, 4)))
        meeting = index.meeting(box)
        assert meeting == sorted(meeting)
        assert [i for i, b in enumerate(boxes) if box.intersect(b) is not None] == \
            [i for i in meeting if box.intersect(boxes[i]) is not None]
    assert RowIndex([Box((), ()), Box((), ())]).meeting(Box((), ())) == [0, 1]  # no rows: every box
