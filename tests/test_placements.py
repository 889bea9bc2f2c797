"""DTensor placement arithmetic (``ckpttool.layout.placements``): the regions a rank holds are the ones torch computes.

The verl reader reads placements from pickles and uses this arithmetic; the live gather uses torch's own
``compute_local_shape_and_global_offset`` on live DTensors. These tests hold the two to the same answers: for
``Shard``/``Replicate`` over any mesh and any shape, and for FSDP2 over TP (``_StridedShard``) wherever torch's
formula describes what FSDP2 stores. Where it does not (uneven splits over 3 or more data-parallel ranks), the
arithmetic follows FSDP2's storage, checked against ``torch.chunk`` itself.
"""

from __future__ import annotations

import torch
from conftest import HYPOTHESIS_EXAMPLES
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

from ckpttool.layout.layout import Box
from ckpttool.layout.placements import Placement, local_ranges, local_shape, range_pieces


class _MeshAt:
    """The parts of a ``DeviceMesh`` that ``compute_local_shape_and_global_offset`` asks: its shape and the
    calling rank's coordinate (a real mesh needs a process group of its size)."""

    def __init__(self, shape: tuple[int, ...], coordinate: tuple[int, ...]) -> None:
        self.shape, self.coordinate = shape, coordinate

    def _is_current_rank_part_of_mesh(self) -> bool:
        return True

    def _sym_get_coordinate(self, mesh_dim: int) -> int:
        return self.coordinate[mesh_dim]

    def get_coordinate(self) -> list[int]:  # what older torch asks
        return list(self.coordinate)

    def size(self, mesh_dim: int) -> int:
        return self.shape[mesh_dim]

    @property
    def ndim(self) -> int:
        return len(self.shape)


def _torch(p: Placement):
    if p.kind == "shard":
        return Shard(p.dim)
    if p.kind == "strided":
        return _StridedShard(p.dim, split_factor=p.split_factor)
    return Replicate()


def _by_torch(shape, mesh, coordinate, placements) -> tuple[tuple[int, ...], tuple[int, ...]]:
    got = compute_local_shape_and_global_offset(shape, _MeshAt(tuple(mesh), tuple(coordinate)),
                                                [_torch(p) for p in placements])
    return tuple(got[0]), tuple(got[1])


def _assert_as_torch(shape, mesh, coordinate, placements) -> None:
    ranges = local_ranges(shape, mesh, coordinate, placements)
    torch_shape, torch_offset = _by_torch(shape, mesh, coordinate, placements)
    assert local_shape(ranges) == torch_shape, (ranges, torch_shape)
    for dim, offset, n in zip(ranges, torch_offset, torch_shape):
        if n:  # torch gives an empty piece the offset of the dim's end; no element sits there
            assert dim[0][0] == offset, (ranges, torch_offset)


@st.composite
def sharded(draw):
    """A global shape (even or not), a mesh of 1 to 3 dims, a coordinate in it and Shard/Replicate placements,
    several mesh dims possibly sharding one tensor dim."""
    ndim = draw(st.integers(1, 3))
    shape = draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim))
    mesh = draw(st.lists(st.integers(1, 4), min_size=1, max_size=3))
    coordinate = [draw(st.integers(0, n - 1)) for n in mesh]
    placements = [draw(st.sampled_from([Placement("replicate"), *(Placement("shard", d) for d in range(ndim))]))
                  for _ in mesh]
    return shape, mesh, coordinate, placements


@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None)
@given(case=sharded())
def test_shard_and_replicate_give_torchs_local_shape_and_offset(case):
    shape, mesh, coordinate, placements = case
    _assert_as_torch(shape, mesh, coordinate, placements)
    ranges = local_ranges(shape, mesh, coordinate, placements)
    assert all(len(dim) == 1 for dim in ranges)  # without _StridedShard a rank holds one box


@st.composite
def fsdp_over_tp(draw, *, even: bool):
    """FSDP2 over TP as torch records it: ``(_StridedShard(d, sf=tp), Shard(d))`` on a ``(dp, tp)`` mesh, after an
    optional leading mesh dim (replicas, or a shard of another tensor dim), other tensor dims whole."""
    ndim = draw(st.integers(1, 3))
    d = draw(st.integers(0, ndim - 1))
    dp, tp = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    shape = draw(st.lists(st.integers(0, 13), min_size=ndim, max_size=ndim))
    if even:
        shape[d] = dp * tp * draw(st.integers(0, 4))
    mesh, placements = [dp, tp], [Placement("strided", d, tp), Placement("shard", d)]
    lead = draw(st.sampled_from(["none", "replicate", *(f"shard{o}" for o in range(ndim) if o != d)]))
    if lead != "none":
        mesh.insert(0, draw(st.integers(1, 3)))
        placements.insert(0, Placement("replicate") if lead == "replicate" else Placement("shard", int(lead[5:])))
    coordinate = [draw(st.integers(0, n - 1)) for n in mesh]
    return shape, mesh, coordinate, placements


@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None)
@given(case=fsdp_over_tp(even=True))
def test_fsdp2_over_tp_split_evenly_gives_torchs_local_shape_and_offset(case):
    _assert_as_torch(*case)


@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None)
@given(case=fsdp_over_tp(even=False))
def test_fsdp2_over_tp_over_two_data_parallel_ranks_gives_torchs_local_shape_and_offset(case):
    shape, mesh, coordinate, placements = case
    if mesh[-2] <= 2:
        _assert_as_torch(shape, mesh, coordinate, placements)


@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None)
@given(case=fsdp_over_tp(even=False))
def test_fsdp2_over_tp_is_each_ranks_chunk_of_its_tp_shard(case):
    """What FSDP2 stores: ``torch.chunk`` over dp of the TP rank's ``torch.chunk`` of the tensor, uneven included."""
    shape, mesh, coordinate, placements = case
    d = placements[-1].dim
    dp_rank, tp_rank = coordinate[-2:]
    tp_shard = torch.arange(shape[d]).chunk(mesh[-1])
    tp_shard = tp_shard[tp_rank] if tp_rank < len(tp_shard) else torch.arange(0)
    mine = tp_shard.chunk(mesh[-2])
    expected = mine[dp_rank].tolist() if dp_rank < len(mine) else []
    ranges = local_ranges(shape, mesh, coordinate, placements)
    assert [i for a, b in ranges[d] for i in range(a, b)] == expected


def test_uneven_fsdp2_over_tp_on_three_data_parallel_ranks_follows_what_fsdp2_stores():
    """7 rows, tp=2 (rows 0-3 and 4-6), dp=3: FSDP2 keeps no row of TP shard 0 on dp rank 2 and row 6 of TP shard
    1; torch's formula puts row 6 on (dp 2, tp 0) and nothing on (dp 2, tp 1)."""
    placements = [Placement("strided", 0, 2), Placement("shard", 0)]
    assert local_ranges([7], [3, 2], [2, 0], placements) == [[(0, 0)]]
    assert local_ranges([7], [3, 2], [2, 1], placements) == [[(6, 7)]]
    assert _by_torch([7], [3, 2], [2, 0], placements) == ((1,), (6,))
    assert _by_torch([7], [3, 2], [2, 1], placements) == ((0,), (7,))


def test_strided_rows_held_apart_are_separate_boxes_in_place():
    """_StridedShard(0, sf=2) alone on dp=2: rank 0 holds rows 0-1 and 4-5 of 8, its local rows 0-1 and 2-3."""
    ranges = local_ranges([8, 3], [2], [0], [Placement("strided", 0, 2)])
    assert ranges == [[(0, 2), (4, 6)], [(0, 3)]]
    assert range_pieces(ranges) == [(Box((0, 0), (2, 3)), Box((0, 0), (2, 3))),
                                    (Box((2, 0), (2, 3)), Box((4, 0), (2, 3)))]
    assert _by_torch([8, 3], [2], [0], [Placement("strided", 0, 2)]) == ((4, 3), (0, 0))  # torch: the first row


def test_column_ranges_are_cut_into_boxes_contiguous_in_the_local_tensor():
    ranges = local_ranges([3, 8], [2], [1], [Placement("strided", 1, 2)])
    assert ranges == [[(0, 3)], [(2, 4), (6, 8)]]
    pieces = range_pieces(ranges)
    assert len(pieces) == 6 and all(glob.sizes == (1, 2) for _, glob in pieces)
    assert [local.offsets for local, _ in pieces] == [(0, 0), (1, 0), (2, 0), (0, 2), (1, 2), (2, 2)]


def test_an_empty_rank_holds_no_piece():
    ranges = local_ranges([3], [4], [3], [Placement("shard", 0)])
    assert ranges == [[(0, 0)]] and local_shape(ranges) == (0,) and range_pieces(ranges) == []


def test_shard_order_applies_mesh_dims_in_the_order_recorded():
    """Tensor dim 0 sharded by mesh dim 1 then mesh dim 0 (a DTensorSpec's shard_order) vs left to right."""
    placements = [Placement("shard", 0), Placement("shard", 0)]
    assert local_ranges([8], [2, 2], [0, 1], placements) == [[(2, 4)]]
    assert local_ranges([8], [2, 2], [0, 1], placements, order=[(0, (1, 0))]) == [[(4, 6)]]
