"""Layout helpers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ckpttool.errors import SourceError
from ckpttool.layout.layout import range_boxes

from conftest import HYPOTHESIS_EXAMPLES


@st.composite
def flat_ranges(draw):
    shape = tuple(draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    n = math.prod(shape)
    start = draw(st.integers(0, n))
    return shape, start, draw(st.integers(start, n))


@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None)
@given(flat_ranges())
def test_a_flat_range_is_the_boxes_in_order(case):
    shape, start, stop = case
    boxes = range_boxes(shape, start, stop)
    assert len(boxes) <= 2 * len(shape) - 1
    whole = torch.arange(math.prod(shape)).reshape(shape)
    counted = 0
    for box, first in boxes:
        assert first == counted
        region = whole[tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))]
        assert region.reshape(-1).tolist() == list(range(start + first, start + first + box.numel))
        counted += box.numel
    assert counted == stop - start


def test_a_range_outside_the_tensor():
    with pytest.raises(SourceError, match=r"elements 5..13 do not lie in a tensor of shape \[3, 4\]"):
        range_boxes((3, 4), 5, 13)
