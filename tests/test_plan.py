"""Plans: box geometry, coverage proofs, and that a checked plan reassembles the exact global tensor.

The plan is ckpttool's central promise: every target tensor is tiled by its copies exactly once, or the merge
stops with a message that names the tensor, the region, the files, and the likely cause.
"""

from __future__ import annotations

import math
import re
import tempfile
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from ckpttool.errors import CoverageError, SourceError
from ckpttool.execute.reference import PieceLoader, assemble
from ckpttool.layout.layout import RAW, Box, Fusion, Layout, Padding, Piece
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.plan.tiling import Copy, Slice, check_tiling
from ckpttool.plan.plan import TargetSpec, plan_merge
from ckpttool.layout.regions import uncovered
from ckpttool.io.safetensors_format import read_header
from conftest import HYPOTHESIS_EXAMPLES

ITEMSIZE = {"F32": 4, "F16": 2, "BF16": 2, "I64": 8}


# --------------------------------------------------------------------------------------------- helpers


def piece(file: str, offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: str = "F32", key: str = "w") -> Piece:
    """A RAW piece whose bytes would fill a whole (hypothetical) file; plans never read them."""
    return Piece(file, key, Box(offsets, sizes), dtype, RAW, 0, math.prod(sizes) * ITEMSIZE[dtype])


def layout_of(
    shape: tuple[int, ...],
    pieces: list[Piece],
    *,
    fqn: str = "w",
    dtype: str = "F32",
    padding: tuple[Padding, ...] = (),
    fusion: Fusion | None = None,
    absent: list[Piece] = (),
) -> Layout:
    builder = LayoutBuilder("/nonexistent", "test")
    builder.declare(fqn, shape, dtype, where="'test metadata'", padding=padding, fusion=fusion)
    for p in pieces:
        builder.add(fqn, p)
    for p in absent:
        builder.add(fqn, p, present=False)
    return builder.build()


def row_pieces(shape: tuple[int, ...], bounds: list[int], dtype: str = "F32") -> list[Piece]:
    """Pieces ``rank{i}.safetensors`` holding rows ``bounds[i]..bounds[i+1]`` of a tensor of ``shape``."""
    rest = tuple(shape[1:])
    return [
        piece(f"rank{i}.safetensors", (lo, *(0 for _ in rest)), (hi - lo, *rest), dtype)
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))
    ]


def save_pieces(root: Path, full: torch.Tensor, boxes: list[Box], key: str = "w") -> list[Piece]:
    """Write ``full[box]`` of every box as ``rank{i}.safetensors`` and describe it from the file's header."""
    pieces = []
    for i, box in enumerate(boxes):
        name = f"rank{i}.safetensors"
        index = tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))
        save_file({key: full[index].contiguous()}, str(root / name))
        entry = read_header(root / name).entries[key]
        pieces.append(Piece(name, key, box, entry.dtype, RAW, entry.begin, entry.end - entry.begin))
    return pieces


def region_words(dim: int, lo: int, hi: int, shape: tuple[int, ...]) -> str:
    """How a message names ``lo..hi`` along ``dim`` of a tensor of ``shape`` (all other dims whole).

    Written independently of ``Box.describe`` so the property test does not grade the code with itself.
    """
    if lo == 0 and hi == shape[dim]:
        return "the whole tensor"
    if len(shape) == 1:
        return f"elements {lo}..{hi}"
    name = {0: "rows", 1: "columns"}.get(dim, f"dim {dim} indices")
    return f"{name} {lo}..{hi}"


# --------------------------------------------------------------------------------------------- Box


def test_intersect_of_overlapping_boxes_is_their_common_region():
    a = Box((0, 0), (6, 4))
    b = Box((4, 2), (6, 6))
    assert a.intersect(b) == Box((4, 2), (2, 2))
    assert b.intersect(a) == Box((4, 2), (2, 2))


def test_boxes_that_only_touch_do_not_intersect():
    assert Box((0, 0), (4, 4)).intersect(Box((4, 0), (4, 4))) is None
    assert Box((0,), (3,)).intersect(Box((5,), (2,))) is None


def test_a_box_inside_another_intersects_as_itself():
    outer, inner = Box((0, 0, 0), (4, 4, 4)), Box((1, 2, 3), (2, 1, 1))
    assert outer.intersect(inner) == inner


def test_inside_accepts_boxes_within_the_shape_and_refuses_the_rest():
    assert Box((0, 0), (1001, 8)).inside((1001, 8))
    assert Box((753, 0), (248, 8)).inside((1001, 8))
    assert Box((5, 0), (0, 8)).inside((5, 8))  # an empty box at the very end
    assert not Box((753, 0), (251, 8)).inside((1001, 8))  # one row too far
    assert not Box((-1, 0), (1, 8)).inside((1001, 8))
    assert not Box((0,), (8,)).inside((1001, 8))  # wrong rank
    assert not Box((0, 0), (-1, 8)).inside((1001, 8))


def test_describe_names_rows_for_a_dim0_region_of_a_matrix():
    assert Box((501, 0), (500, 8)).describe((1001, 8)) == "rows 501..1001"


def test_describe_names_columns_for_a_dim1_region_of_a_matrix():
    assert Box((0, 3), (16, 2)).describe((16, 8)) == "columns 3..5"


def test_describe_names_elements_for_a_vector():
    assert Box((2,), (3,)).describe((8,)) == "elements 2..5"


def test_describe_names_higher_dims_by_number_and_joins_partial_dims():
    assert Box((0, 0, 2), (3, 4, 3)).describe((3, 4, 5)) == "dim 2 indices 2..5"
    assert Box((0, 2), (2, 2)).describe((4, 4)) == "rows 0..2 x columns 2..4"


def test_describe_of_a_full_box_is_the_whole_tensor():
    assert Box((0, 0), (4, 4)).describe((4, 4)) == "the whole tensor"


def test_describe_without_a_shape_names_every_dim():
    assert Box((0, 2), (4, 2)).describe() == "rows 0..4 x columns 2..4"


def test_box_with_mismatched_offsets_and_sizes_is_refused():
    with pytest.raises(SourceError, match=re.escape("box has 2 offsets but 1 sizes")):
        Box((0, 0), (4,))


# --------------------------------------------------------------------------------------------- uncovered


def test_uncovered_finds_the_exact_missing_rows():
    assert uncovered((1001, 8), [Box((0, 0), (501, 8))]) == [Box((501, 0), (500, 8))]


def test_uncovered_finds_a_missing_middle_slab():
    boxes = [Box((0, 0), (3, 4)), Box((9, 0), (3, 4))]
    assert uncovered((12, 4), boxes) == [Box((3, 0), (6, 4))]


def test_uncovered_finds_two_dimensional_gaps():
    # [A .]
    # [. B]
    boxes = [Box((0, 0), (2, 2)), Box((2, 2), (2, 2))]
    assert uncovered((4, 4), boxes) == [Box((0, 2), (2, 2)), Box((2, 0), (2, 2))]


def test_uncovered_finds_a_corner_gap():
    boxes = [Box((0, 0), (2, 4)), Box((2, 0), (2, 2))]
    assert uncovered((4, 4), boxes) == [Box((2, 2), (2, 2))]


def test_uncovered_finds_a_gap_along_the_last_dim_of_a_3d_tensor():
    assert uncovered((3, 4, 5), [Box((0, 0, 0), (3, 4, 2))]) == [Box((0, 0, 2), (3, 4, 3))]


def test_uncovered_is_empty_for_an_uneven_tiling():
    # 2-D grid with uneven cuts: rows 0..3 | 3..7, columns 0..1 | 1..5
    boxes = [Box((0, 0), (3, 1)), Box((0, 1), (3, 4)), Box((3, 0), (4, 1)), Box((3, 1), (4, 4))]
    assert uncovered((7, 5), boxes) == []


def test_uncovered_is_empty_for_overlapping_boxes_that_cover_everything():
    assert uncovered((10,), [Box((0,), (6,)), Box((4,), (6,))]) == []


def test_uncovered_of_nothing_is_the_whole_tensor():
    assert uncovered((3, 2), []) == [Box((0, 0), (3, 2))]


def test_zero_size_tensors_have_no_gaps():
    assert uncovered((0, 8), []) == []
    assert uncovered((5, 0), []) == []
    assert uncovered((0,), []) == []


def test_a_scalar_is_uncovered_until_a_box_covers_it():
    assert uncovered((), []) == [Box((), ())]
    assert uncovered((), [Box((), ())]) == []


@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None)
@given(
    shape=st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple),
    raw_boxes=st.lists(
        st.lists(st.tuples(st.integers(0, 5), st.integers(0, 5)), min_size=3, max_size=3), max_size=5
    ),
)
def test_uncovered_boxes_are_disjoint_and_exactly_the_complement(shape, raw_boxes):
    boxes = []
    for dims in raw_boxes:
        offsets, sizes = [], []
        for n, (a, b) in zip(shape, dims):
            lo, hi = sorted((min(a, n), min(b, n)))
            offsets.append(lo)
            sizes.append(hi - lo)
        boxes.append(Box(tuple(offsets), tuple(sizes)))
    covered = torch.zeros(shape, dtype=torch.int64)
    for b in boxes:
        covered[tuple(slice(o, o + s) for o, s in zip(b.offsets, b.sizes))] = 1
    gaps = uncovered(shape, boxes)
    counted = torch.zeros(shape, dtype=torch.int64)
    for g in gaps:
        assert g.inside(shape) and g.numel > 0
        counted[tuple(slice(o, o + s) for o, s in zip(g.offsets, g.sizes))] += 1
    assert torch.equal(counted, 1 - covered)  # disjoint (no 2s) and exactly the uncovered elements


# --------------------------------------------------------------------------------------------- plan_merge


def test_tiled_tensor_plans_one_copy_per_piece():
    layout = layout_of((1001, 8), row_pieces((1001, 8), [0, 501, 1001]))
    plan = plan_merge(layout)
    (target,) = plan.targets
    assert (target.name, target.shape, target.dtype) == ("w", (1001, 8), "F32")
    assert [(c.piece.file, c.src, c.dst) for c in target.copies] == [
        ("rank0.safetensors", Box((0, 0), (501, 8)), Box((0, 0), (501, 8))),
        ("rank1.safetensors", Box((0, 0), (500, 8)), Box((501, 0), (500, 8))),
    ]


def test_gap_names_tensor_region_files_found_and_likely_cause():
    layout = layout_of((1001, 8), [piece("rank0.safetensors", (0, 0), (501, 8))])
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(layout)
    assert excinfo.value.problems == (
        "'w': rows 501..1001 covered by no piece (shape [1001, 8]; found 1 piece in 'rank0.safetensors'). "
        "Is a rank's file missing, or the checkpoint incomplete?",
    )
    assert str(excinfo.value).startswith("the checkpoint does not cover its tensors exactly (1 problem):\n  - 'w':")


def test_gap_with_no_piece_at_all_says_so():
    builder = LayoutBuilder("/nonexistent", "test")
    builder.declare("w", (4,), "F32", where="'test metadata'")
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(builder.build())
    assert excinfo.value.problems == (
        "'w': the whole tensor covered by no piece (shape [4]; found no piece at all). "
        "Is a rank's file missing, or the checkpoint incomplete?",
    )


def test_gap_covered_by_an_absent_piece_names_the_missing_file():
    present = row_pieces((1001, 8), [0, 501])
    absent = [piece("rank1.safetensors", (501, 0), (500, 8))]
    layout = layout_of((1001, 8), present, absent=absent)
    assert layout.missing == ("rank1.safetensors",)
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(layout)
    assert excinfo.value.problems == (
        "'w': rows 501..1001 covered by no piece (shape [1001, 8]; found 1 piece in 'rank0.safetensors'). "
        "The metadata places them in 'rank1.safetensors', which is missing. Restore that file.",
    )


def test_each_gap_names_only_the_missing_file_that_holds_it():
    pieces = row_pieces((12, 4), [0, 3, 6, 9, 12])
    present = [pieces[0], pieces[2]]
    absent = [pieces[1], pieces[3]]  # rows 3..6 in rank1, rows 9..12 in rank3
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(layout_of((12, 4), present, absent=absent))
    first, second = excinfo.value.problems
    assert first.startswith("'w': rows 3..6 covered by no piece")
    assert "The metadata places them in 'rank1.safetensors', which is missing." in first
    assert "rank3.safetensors" not in first
    assert second.startswith("'w': rows 9..12 covered by no piece")
    assert "The metadata places them in 'rank3.safetensors', which is missing." in second
    assert "rank1.safetensors" not in second


def test_gap_lists_files_the_layout_knows_are_missing():
    layout = Layout(
        root="/nonexistent",
        format="test",
        tensors=layout_of((6,), [piece("rank0.safetensors", (0,), (3,))]).tensors,
        missing=("rank-00001-of-00002.ckpttool.json",),
    )
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(layout)
    assert excinfo.value.problems == (
        "'w': elements 3..6 covered by no piece (shape [6]; found 1 piece in 'rank0.safetensors'). "
        "These files of the checkpoint are missing: 'rank-00001-of-00002.ckpttool.json'. Restore them.",
    )


def test_partial_overlap_names_both_files_and_the_shared_rows():
    pieces = [piece("rank0.safetensors", (0, 0), (6, 4)), piece("rank1.safetensors", (4, 0), (6, 4))]
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(layout_of((10, 4), pieces))
    assert excinfo.value.problems == (
        "'w': rows 4..6 covered twice, by 'rank0.safetensors' and 'rank1.safetensors'. "
        "Are two checkpoints mixed in one directory?",
    )


def test_overlap_message_carries_the_pieces_parallel_coordinates():
    a = Piece("a.safetensors", "w", Box((0,), (4,)), "F32", RAW, 0, 16, (("tp_rank", 0),))
    b = Piece("b.safetensors", "w", Box((2,), (4,)), "F32", RAW, 0, 16, (("tp_rank", 1),))
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(layout_of((6,), [a, b]))
    assert excinfo.value.problems == (
        "'w': elements 2..4 covered twice, by 'a.safetensors' (tp_rank=0) and 'b.safetensors' (tp_rank=1). "
        "Are two checkpoints mixed in one directory?",
    )


def test_every_problem_of_every_tensor_is_reported_at_once():
    builder = LayoutBuilder("/nonexistent", "test")
    builder.declare("a", (4,), "F32", where="'m'")
    builder.declare("b", (4,), "F32", where="'m'")
    builder.add("a", piece("rank0.safetensors", (0,), (2,), key="a"))
    builder.add("b", piece("rank0.safetensors", (0,), (3,), key="b"))
    builder.add("b", piece("rank1.safetensors", (2,), (2,), key="b"))
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(builder.build())
    problems = excinfo.value.problems
    assert len(problems) == 2
    assert problems[0].startswith("'a': elements 2..4 covered by no piece")
    assert problems[1].startswith("'b': elements 2..3 covered twice, by 'rank0.safetensors' and 'rank1.safetensors'")
    assert str(excinfo.value).startswith("the checkpoint does not cover its tensors exactly (2 problems):")


def test_identical_replicas_are_accepted_and_only_one_copy_is_used():
    replicas = [piece(f"rank{r}.safetensors", (0,), (8,)) for r in range(4)]
    plan = plan_merge(layout_of((8,), replicas))
    (target,) = plan.targets
    assert len(target.copies) == 1
    assert target.copies[0].piece.file == "rank0.safetensors"
    assert target.copies[0].dst == Box((0,), (8,))


def test_replicated_row_blocks_use_one_copy_each():
    # data parallel replicas of a TP2 split: two copies of each half
    pieces = row_pieces((10, 2), [0, 5, 10]) + [
        piece("dp1-rank0.safetensors", (0, 0), (5, 2)),
        piece("dp1-rank1.safetensors", (5, 0), (5, 2)),
    ]
    (target,) = plan_merge(layout_of((10, 2), pieces)).targets
    assert [c.dst for c in target.copies] == [Box((0, 0), (5, 2)), Box((5, 0), (5, 2))]


def test_piece_outside_the_global_shape_is_refused_with_tensor_and_file():
    builder = LayoutBuilder("/nonexistent", "test")
    builder.declare("model.embed_tokens.weight", (1001, 8), "F32", where="'m'")
    builder.add("model.embed_tokens.weight", piece("rank3.safetensors", (753, 0), (251, 8)))
    with pytest.raises(SourceError) as excinfo:
        builder.build()
    assert str(excinfo.value) == (
        "the checkpoint's metadata is inconsistent:\n"
        "  - 'model.embed_tokens.weight': piece in 'rank3.safetensors' at offsets [753, 0] with sizes [251, 8] "
        "lies outside the global shape [1001, 8]"
    )


def test_pieces_disagreeing_on_the_global_shape_name_both_places():
    builder = LayoutBuilder("/nonexistent", "test")
    assert builder.declare("w", (1004, 8), "F32", where="'rank0.json'")
    assert not builder.declare("w", (1001, 8), "F32", where="'rank1.json'")
    with pytest.raises(SourceError) as excinfo:
        builder.build()
    assert str(excinfo.value) == (
        "the checkpoint's metadata is inconsistent:\n"
        "  - 'w': pieces disagree on the global shape: [1004, 8] in 'rank0.json' but [1001, 8] in 'rank1.json'"
    )


def test_pieces_disagreeing_on_the_dtype_name_both_places():
    builder = LayoutBuilder("/nonexistent", "test")
    builder.declare("w", (8,), "F32", where="'rank0.json'")
    assert not builder.declare("w", (8,), "BF16", where="'rank1.json'")
    with pytest.raises(SourceError) as excinfo:
        builder.build()
    assert str(excinfo.value) == (
        "the checkpoint's metadata is inconsistent:\n"
        "  - 'w': pieces disagree on the dtype: F32 in 'rank0.json' but BF16 in 'rank1.json'"
    )


def test_piece_with_another_dtype_than_its_tensor_is_refused():
    builder = LayoutBuilder("/nonexistent", "test")
    builder.declare("w", (8,), "F32", where="'m'")
    builder.add("w", piece("rank1.safetensors", (0,), (8,), dtype="F16"))
    with pytest.raises(SourceError, match=re.escape(
        "'w': piece in 'rank1.safetensors' has dtype F16, the tensor is F32"
    )):
        builder.build()


def test_padding_that_does_not_fit_the_shape_is_refused():
    builder = LayoutBuilder("/nonexistent", "test")
    builder.declare("w", (1004, 8), "F32", where="'rank0.json'", padding=(Padding(0, 1005),))
    with pytest.raises(SourceError, match=re.escape(
        "'w': padding record (dim 0, true size 1005) does not fit the global shape [1004, 8] in 'rank0.json'"
    )):
        builder.build()


def test_padding_is_stripped_and_no_copy_reaches_past_the_true_size():
    layout = layout_of((1004, 8), row_pieces((1004, 8), [0, 251, 502, 753, 1004]), padding=(Padding(0, 1001),))
    (target,) = plan_merge(layout).targets
    assert target.shape == (1001, 8)
    assert [(c.piece.file, c.src, c.dst) for c in target.copies] == [
        ("rank0.safetensors", Box((0, 0), (251, 8)), Box((0, 0), (251, 8))),
        ("rank1.safetensors", Box((0, 0), (251, 8)), Box((251, 0), (251, 8))),
        ("rank2.safetensors", Box((0, 0), (251, 8)), Box((502, 0), (251, 8))),
        ("rank3.safetensors", Box((0, 0), (248, 8)), Box((753, 0), (248, 8))),
    ]
    assert all(c.dst.inside((1001, 8)) for c in target.copies)


def test_piece_entirely_in_the_padding_contributes_nothing():
    # true size 5, padded to 8 in pieces of 2: rows 6..8 are all padding
    layout = layout_of((8, 3), row_pieces((8, 3), [0, 2, 4, 6, 8]), padding=(Padding(0, 5),))
    (target,) = plan_merge(layout).targets
    assert target.shape == (5, 3)
    assert [c.piece.file for c in target.copies] == ["rank0.safetensors", "rank1.safetensors", "rank2.safetensors"]
    assert target.copies[-1].src == Box((0, 0), (1, 3))


def test_missing_piece_in_the_padding_is_not_a_gap():
    layout = layout_of((8, 3), row_pieces((8, 3), [0, 2, 4, 6]), padding=(Padding(0, 5),))
    assert plan_merge(layout).targets[0].shape == (5, 3)


def test_fused_tensor_is_split_into_its_parts():
    # qkv fused along dim 0 as [q (4 rows); k (2 rows); v (2 rows)], saved by two ranks at rows 0..3 | 3..8
    fusion = Fusion(0, (("q.weight", 4), ("k.weight", 2), ("v.weight", 2)))
    layout = layout_of((8, 5), row_pieces((8, 5), [0, 3, 8]), fqn="qkv.weight", fusion=fusion)
    plan = plan_merge(layout)
    assert [(t.name, t.shape) for t in plan.targets] == [
        ("q.weight", (4, 5)), ("k.weight", (2, 5)), ("v.weight", (2, 5)),
    ]
    q, k, v = plan.targets
    assert [(c.piece.file, c.src, c.dst) for c in q.copies] == [
        ("rank0.safetensors", Box((0, 0), (3, 5)), Box((0, 0), (3, 5))),
        ("rank1.safetensors", Box((0, 0), (1, 5)), Box((3, 0), (1, 5))),
    ]
    assert [(c.piece.file, c.src, c.dst) for c in k.copies] == [
        ("rank1.safetensors", Box((1, 0), (2, 5)), Box((0, 0), (2, 5))),
    ]
    assert [(c.piece.file, c.src, c.dst) for c in v.copies] == [
        ("rank1.safetensors", Box((3, 0), (2, 5)), Box((0, 0), (2, 5))),
    ]
    assert all(t.sources == ("qkv.weight",) for t in plan.targets)


def test_fused_parts_along_columns_reassemble_exactly(tmp_path):
    full = torch.arange(3 * 7, dtype=torch.float32).reshape(3, 7)
    pieces = save_pieces(tmp_path, full, [Box((0, 0), (3, 4)), Box((0, 4), (3, 3))])
    builder = LayoutBuilder(str(tmp_path), "test")
    builder.declare("gate_up", (3, 7), "F32", where="'m'", fusion=Fusion(1, (("gate", 2), ("up", 5))))
    for p in pieces:
        builder.add("gate_up", p)
    plan = plan_merge(builder.build())
    loader = PieceLoader(tmp_path)
    gate, up = (assemble(t, loader) for t in plan.targets)
    assert torch.equal(gate, full[:, :2])
    assert torch.equal(up, full[:, 2:])


def test_dtype_casts_only_floating_point_tensors():
    builder = LayoutBuilder("/nonexistent", "test")
    builder.declare("weight", (4,), "F32", where="'m'")
    builder.declare("steps", (4,), "I64", where="'m'")
    builder.add("weight", piece("rank0.safetensors", (0,), (4,), key="weight"))
    builder.add("steps", piece("rank0.safetensors", (0,), (4,), dtype="I64", key="steps"))
    plan = plan_merge(builder.build(), dtype="BF16")
    assert {t.name: (t.source_dtype, t.dtype) for t in plan.targets} == {
        "weight": ("F32", "BF16"),
        "steps": ("I64", "I64"),
    }
    assert plan.nbytes == 4 * 2 + 4 * 8


def test_dtype_cast_is_applied_by_the_executor(tmp_path):
    full = torch.arange(6, dtype=torch.float32) + 0.5
    pieces = save_pieces(tmp_path, full, [Box((0,), (2,)), Box((2,), (4,))])
    builder = LayoutBuilder(str(tmp_path), "test")
    builder.declare("w", (6,), "F32", where="'m'")
    for p in pieces:
        builder.add("w", p)
    (target,) = plan_merge(builder.build(), dtype="F16").targets
    out = assemble(target, PieceLoader(tmp_path))
    assert out.dtype == torch.float16
    assert torch.equal(out, full.to(torch.float16))


def test_target_whose_source_is_not_in_the_checkpoint_is_named():
    layout = layout_of((4,), [piece("rank0.safetensors", (0,), (4,))])
    spec = TargetSpec("lm_head.weight", (4,), (Slice("output.weight", Box((0,), (4,)), Box((0,), (4,))),))
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(layout, [spec])
    assert excinfo.value.problems == ("'lm_head.weight': its source tensor 'output.weight' is not in the checkpoint",)


def test_slice_outside_the_source_shape_is_named():
    layout = layout_of((4,), [piece("rank0.safetensors", (0,), (4,))])
    spec = TargetSpec("t", (6,), (Slice("w", Box((0,), (6,)), Box((0,), (6,))),))
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(layout, [spec])
    assert excinfo.value.problems == ("'t': needs elements 0..6 of 'w', outside its global shape [4]",)


def test_copy_outside_the_target_shape_is_named():
    layout = layout_of((6,), [piece("rank0.safetensors", (0,), (6,))])
    spec = TargetSpec("t", (4,), (Slice("w", Box((0,), (6,)), Box((0,), (6,))),))
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(layout, [spec])
    assert excinfo.value.problems[0] == (
        "'t': piece in 'rank0.safetensors' writes offsets [0] sizes [6], outside the tensor's shape [4]"
    )


def test_sources_with_different_dtypes_cannot_share_a_target():
    builder = LayoutBuilder("/nonexistent", "test")
    builder.declare("a", (2,), "F32", where="'m'")
    builder.declare("b", (2,), "F16", where="'m'")
    builder.add("a", piece("r.safetensors", (0,), (2,), key="a"))
    builder.add("b", piece("r.safetensors", (0,), (2,), dtype="F16", key="b"))
    spec = TargetSpec("ab", (4,), (
        Slice("a", Box((0,), (2,)), Box((0,), (2,))),
        Slice("b", Box((0,), (2,)), Box((2,), (2,))),
    ))
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(builder.build(), [spec])
    assert excinfo.value.problems == ("'ab': its sources have different dtypes ['F16', 'F32']",)


def test_target_with_no_slices_is_a_coverage_error():
    layout = layout_of((4,), [piece("rank0.safetensors", (0,), (4,))])
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(layout, [TargetSpec("t", (4,), ())])
    assert "'t': the whole tensor covered by no piece" in str(excinfo.value)


def test_slice_refuses_boxes_of_different_sizes():
    with pytest.raises(SourceError, match=re.escape("slice of 'w' maps sizes [1, 3, 5] onto [4, 5]")):
        Slice("w", Box((0, 0, 0), (1, 3, 5)), Box((0, 0), (4, 5)))


def test_check_tiling_reports_scalars_covered_twice():
    p = piece("rank0.safetensors", (), ())
    copies = [Copy(p, Box((), ()), Box((), ())), Copy(p, Box((), ()), Box((), ()))]
    assert check_tiling("s", (), copies) == ["'s': the scalar is covered 2 times"]
    assert check_tiling("s", (), copies[:1]) == []


def test_zero_size_tensor_plans_with_no_copies(tmp_path):
    layout = layout_of((0, 8), [piece("rank0.safetensors", (0, 0), (0, 8))])
    (target,) = plan_merge(layout).targets
    assert target.shape == (0, 8) and target.copies == ()
    assert assemble(target, PieceLoader(tmp_path)).shape == (0, 8)


# --------------------------------------------------------------------------------------------- experts


def test_stacked_experts_split_over_ep_and_tp_become_per_expert_tensors(tmp_path):
    experts, inter, hidden = 4, 3, 6
    stacked = torch.arange(experts * 2 * inter * hidden, dtype=torch.float32).reshape(experts, 2 * inter, hidden)
    # EP2 along dim 0 (experts 0..2 | 2..4) x TP2 along dim 2 (hidden 0..2 | 2..6, uneven)
    boxes = [
        Box((e0, 0, h0), (2, 2 * inter, hn))
        for e0 in (0, 2)
        for h0, hn in ((0, 2), (2, 4))
    ]
    pieces = save_pieces(tmp_path, stacked, boxes, key="mlp.experts.gate_up_proj")
    builder = LayoutBuilder(str(tmp_path), "test")
    builder.declare("mlp.experts.gate_up_proj", stacked.shape, "F32", where="'m'")
    for p in pieces:
        builder.add("mlp.experts.gate_up_proj", p)
    specs = [
        TargetSpec(
            f"experts.{e}.{part}.weight",
            (inter, hidden),
            (Slice("mlp.experts.gate_up_proj", Box((e, i * inter, 0), (1, inter, hidden)), Box.whole((inter, hidden))),),
        )
        for e in range(experts)
        for i, part in enumerate(("gate_proj", "up_proj"))
    ]
    plan = plan_merge(builder.build(), specs)
    assert [t.name for t in plan.targets] == [s.name for s in specs]
    loader = PieceLoader(tmp_path)
    for e in range(experts):
        gate, up = plan.targets[2 * e], plan.targets[2 * e + 1]
        # each expert lives in one EP rank's two TP files
        assert {c.piece.file for c in gate.copies} == {f"rank{2 * (e // 2)}.safetensors", f"rank{2 * (e // 2) + 1}.safetensors"}
        assert torch.equal(assemble(gate, loader), stacked[e, :inter])
        assert torch.equal(assemble(up, loader), stacked[e, inter:])


def test_missing_ep_rank_names_the_experts_rows_it_held():
    experts, rows, hidden = 4, 6, 2
    pieces = [piece("ep0.safetensors", (0, 0, 0), (2, rows, hidden))]
    builder = LayoutBuilder("/nonexistent", "test")
    builder.declare("stack", (experts, rows, hidden), "F32", where="'m'")
    for p in pieces:
        builder.add("stack", p)
    spec = TargetSpec("experts.3.w", (rows, hidden), (Slice("stack", Box((3, 0, 0), (1, rows, hidden)), Box.whole((rows, hidden))),))
    with pytest.raises(CoverageError) as excinfo:
        plan_merge(builder.build(), [spec])
    assert excinfo.value.problems == (
        "'experts.3.w': the whole tensor covered by no piece (shape [6, 2]; found no piece at all). "
        "Is a rank's file missing, or the checkpoint incomplete?",
    )


# --------------------------------------------------------------------------------------------- property


DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64}


@st.composite
def sharded(draw):
    """A global tensor split unevenly along one dim, maybe padded, plus a shifted duplicate candidate."""
    ndim = draw(st.integers(1, 3))
    dim = draw(st.integers(0, ndim - 1))
    true = draw(st.integers(1, 12))
    pad = draw(st.integers(0, 4))
    shape = [draw(st.integers(0, 4)) for _ in range(ndim)]
    shape[dim] = true + pad
    count = draw(st.integers(1, 5))
    cuts = sorted(draw(st.lists(st.integers(0, true + pad), min_size=count - 1, max_size=count - 1)))
    return {
        "dim": dim,
        "true": true,
        "padded": pad > 0,
        "shape": tuple(shape),
        "bounds": [0, *cuts, true + pad],
        "dtype": draw(st.sampled_from(sorted(DTYPES))),
        "pick": draw(st.integers(0, 10**6)),
    }


def _slab(shape: tuple[int, ...], dim: int, lo: int, hi: int) -> Box:
    return Box(
        tuple(lo if d == dim else 0 for d in range(len(shape))),
        tuple(hi - lo if d == dim else n for d, n in enumerate(shape)),
    )


@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None)
@given(case=sharded())
def test_any_uneven_split_reassembles_exactly_and_any_defect_is_caught(case):
    dim, true, shape, bounds = case["dim"], case["true"], case["shape"], case["bounds"]
    true_shape = tuple(true if d == dim else n for d, n in enumerate(shape))
    dtype = DTYPES[case["dtype"]]
    original = torch.arange(math.prod(true_shape)).reshape(true_shape).to(dtype)
    pad_shape = tuple(n - true if d == dim else n for d, n in enumerate(shape))
    full = torch.cat([original, torch.full(pad_shape, -1).to(dtype)], dim=dim)  # padding rows hold -1
    padding = (Padding(dim, true),) if case["padded"] else ()
    boxes = [_slab(shape, dim, lo, hi) for lo, hi in zip(bounds, bounds[1:])]

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        pieces = save_pieces(root, full, boxes)

        def build(ps: list[Piece]) -> Layout:
            builder = LayoutBuilder(str(root), "test")
            builder.declare("w", shape, case["dtype"], where="'m'", padding=padding)
            for p in ps:
                builder.add("w", p)
            return builder.build()

        # 1. the split reassembles exactly, padding stripped
        (target,) = plan_merge(build(pieces)).targets
        assert target.shape == true_shape
        assert all(c.dst.inside(true_shape) for c in target.copies)
        out = assemble(target, PieceLoader(root))
        assert out.dtype == dtype
        assert torch.equal(out, original)

        # 2. losing any piece that holds real (unpadded) data leaves exactly its rows uncovered
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            gap_hi = min(hi, true)
            if math.prod(pieces[i].box.sizes) == 0 or gap_hi <= lo:
                continue
            with pytest.raises(CoverageError) as excinfo:
                plan_merge(build(pieces[:i] + pieces[i + 1:]))
            (problem,) = excinfo.value.problems
            assert problem.startswith(
                f"'w': {region_words(dim, lo, gap_hi, true_shape)} covered by no piece (shape {list(true_shape)}; "
            )
            assert problem.endswith("Is a rank's file missing, or the checkpoint incomplete?")

        # 3. the same bytes claimed again at a shifted offset overlapping real data are caught
        candidates = []
        for i, p in enumerate(pieces):
            size = p.box.sizes[dim]
            if p.box.numel == 0:
                continue
            for offset in range(0, shape[dim] - size + 1):
                moved = _slab(shape, dim, offset, offset + size)
                if moved not in boxes and offset < true:
                    candidates.append((i, moved))
        if candidates:
            i, moved = candidates[case["pick"] % len(candidates)]
            dup = Piece(pieces[i].file, "w", moved, pieces[i].dtype, RAW, pieces[i].byte_offset, pieces[i].byte_length)
            with pytest.raises(CoverageError) as excinfo:
                plan_merge(build(pieces + [dup]))
            lo, hi = moved.offsets[dim], min(moved.ends[dim], true)
            expected = set()
            for p in pieces:
                a, b = max(lo, p.box.offsets[dim]), min(hi, p.box.ends[dim])
                if a < b:
                    expected.add(region_words(dim, a, b, true_shape))
            found = set()
            for problem in excinfo.value.problems:
                assert problem.endswith("Are two checkpoints mixed in one directory?")
                assert f"'{pieces[i].file}'" in problem  # the duplicate is always one of the two named
                match = re.fullmatch(r"'w': (.*) covered twice, by .*", problem)
                assert match is not None, problem
                found.add(match.group(1))
            assert found == expected


def test_a_cast_to_a_non_floating_dtype_is_refused():
    from ckpttool.errors import ArgumentError
    from ckpttool.readers import read_layout
    from conftest import fixture_dir

    layout = read_layout(fixture_dir("llama_tp2_dcp") / "checkpoint")
    with pytest.raises(ArgumentError, match=r"dtype='I8': floating-point tensors are cast only to BF16, F16, F32, F64"):
        plan_merge(layout, dtype="I8")
