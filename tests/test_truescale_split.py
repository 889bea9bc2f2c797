"""``split --to megatron --dry-run`` at true scale (issue 31): the shortcuts its plan takes give what the plain way
gives. A chunk of one HF tensor stored whole is composed in plain arithmetic (:func:`ckpttool.plan.compose.compose`'s
one-copy path), against the general path; every rank's local shape is computed once per coordinate that cuts the
tensor (:meth:`Sharding.local_shapes`), against one rank at a time; a tensor archive's geometry is cached by dtype
and shape, against its own bytes. The whole plan's hash before and after, at 4 and 61 layers, is
benchmarks/split_plan_hash.py's business (no files here)."""

from __future__ import annotations

import itertools
import random

import pytest

from ckpttool.commands.meshes import REPLICATE, Sharding
from ckpttool.layout.layout import Box, Piece
from ckpttool.layout.placements import Placement
from ckpttool.plan.compose import SliceIndex, compose
from ckpttool.plan.plan import Target
from ckpttool.plan.tiling import Copy, Slice
from ckpttool.writers.torch_archive import TensorArchive, object_archive


def _target(name: str, shape: tuple[int, ...], copies: int = 1) -> Target:
    """A planned HF tensor: one piece holding it whole, or ``copies`` row slabs of it from as many pieces."""
    if copies == 1:
        piece = Piece("model.safetensors", name, Box.whole(shape), "BF16")
        return Target(name, shape, "BF16", "BF16", (Copy(piece, Box.whole(shape), Box.whole(shape)),),
                      ("model.safetensors",))
    rows = shape[0] // copies
    slabs = []
    for i in range(copies):
        box = Box((i * rows, *(0,) * (len(shape) - 1)), (rows, *shape[1:]))
        slabs.append(Copy(Piece(f"part-{i}.safetensors", name, box, "BF16"), Box.whole(box.sizes), box))
    return Target(name, shape, "BF16", "BF16", tuple(slabs), tuple(f"part-{i}.safetensors" for i in range(copies)))


def _stacked(experts: int, rows: int, cols: int) -> tuple[list[Slice], dict[str, Target]]:
    """A Megatron ``(experts, 2 * rows, cols)`` fc1: each expert's gate and up HF tensors, in a shuffled order."""
    slices, targets = [], {}
    for e in [(5 * e) % experts for e in range(experts)]:
        for half, kind in enumerate(("gate", "up")):
            name = f"model.layers.3.mlp.experts.{e}.{kind}_proj.weight"
            targets[name] = _target(name, (rows, cols))
            slices.append(Slice(name, Box((0, 0), (rows, cols)), Box((e, half * rows, 0), (1, rows, cols))))
    return slices, targets


def _general(name: str, box: Box, slices: list[Slice], targets: dict[str, Target]):
    """compose's general path: a second slice that misses the box keeps it off the one-copy path."""
    far = Slice("far", Box((0, 0), (1, 1)), Box(tuple(o + n for o, n in zip(box.offsets, box.sizes)), (1,) * len(box.sizes)))
    return compose(name, box, [*slices, far], {**targets, "far": _target("far", (1, 1))})


def test_a_chunk_of_one_whole_tensor_is_composed_as_the_general_path_composes_it():
    slices, targets = _stacked(8, 6, 4)
    index = SliceIndex(slices, targets)
    rng = random.Random(31)
    boxes = [Box((e, h * 6 + r * 3, 0), (1, 3, 4)) for e in range(8) for h in range(2) for r in range(2)]
    boxes += [Box((rng.randrange(8), rng.randrange(0, 6), rng.randrange(0, 4)), (1, 1, 1)) for _ in range(20)]
    for box in boxes:
        meeting = index.meeting(box)
        assert len(meeting) == 1  # only the slice the box lies in: the one-copy path
        fast, problems = compose("decoder.layers.3.mlp.experts.experts.linear_fc1.weight", box, meeting, targets)
        general, general_problems = _general("decoder.layers.3.mlp.experts.experts.linear_fc1.weight", box,
                                             list(meeting), targets)
        assert problems == general_problems == []
        assert fast == general


def test_a_chunk_across_two_tensors_or_of_a_cut_piece_takes_the_general_path_with_the_same_answer():
    slices, targets = _stacked(4, 6, 4)
    across = Box((1, 3, 0), (1, 6, 4))  # the lower half of expert 1's gate and the upper half of its up
    meeting = SliceIndex(slices, targets).meeting(across)
    target, problems = compose("fc1", across, meeting, targets)
    assert problems == [] and [c.piece.key for c in target.copies] == [s.source for s in meeting]
    # a target of two slabs (a sharded source): the chunk reads both pieces, as the general path does
    shard = {"w": _target("w", (8, 4), copies=2)}
    one = [Slice("w", Box((0, 0), (8, 4)), Box((0, 0), (8, 4)))]
    target, problems = compose("w", Box((2, 0), (4, 4)), one, shard)
    assert problems == [] and target == _general("w", Box((2, 0), (4, 4)), one, shard)[0]
    assert [c.piece.file for c in target.copies] == ["part-0.safetensors", "part-1.safetensors"]


def test_a_chunk_past_its_slice_is_refused_with_the_general_paths_message():
    slices = [Slice("w", Box((0, 0), (4, 4)), Box((0, 0), (4, 4)))]
    targets = {"w": _target("w", (4, 4))}
    found, problems = compose("decoder.w", Box((2, 0), (4, 4)), slices, targets)
    assert found is None
    assert problems == ["'decoder.w': rows 2..4 covered by no piece (shape [4, 4]; found 1 piece in "
                        "'model.safetensors'). Is a rank's file missing, or the checkpoint incomplete?"]


def test_slices_of_a_quantized_target_are_all_given_so_compose_picks_the_one_box():
    slices, targets = _stacked(8, 6, 4)
    name = slices[0].source
    targets[name] = Target(name, (6, 4), "BF16", "BF16", targets[name].copies, targets[name].sources,
                           dequant=object())  # type: ignore[arg-type]
    index = SliceIndex(slices, targets)
    expert = slices[0].dst.offsets[0]
    assert len(index.meeting(Box((expert, 0, 0), (1, 3, 4)))) == 2  # gate and up: the rows of the expert


MESHES = [
    (("pp", 2), ("ep", 4), ("tp", 2)),
    (("pp", 4), ("ep", 2), ("tp", 8)),
    (("dp", 3), ("fsdp", 2), ("tp", 2)),
]
PLACEMENTS = [Placement("shard", 0), Placement("shard", 1), Placement("strided", 0, 2), REPLICATE]


@pytest.mark.parametrize("dims", MESHES)
def test_every_ranks_local_shape_is_the_one_computed_rank_by_rank(dims):
    world = 1
    for _, n in dims:
        world *= n
    for placements in itertools.product(PLACEMENTS, repeat=3):
        for ranks in (None, (0, world // dims[0][1]), (world // dims[0][1], 2 * world // dims[0][1])):
            sharding = Sharding("t", (16, 12, 6), dims, placements, ranks)
            assert sharding.local_shapes() == [sharding.local_shape(r) for r in range(world)]


@pytest.mark.parametrize("dtype,shape", [("BF16", (1, 2048, 7168)), ("F32", (7,)), ("F8_E4M3", (3, 5)),
                                         ("BF16", ()), ("BF16", (129280, 7168)), ("F32", (5, 2**30 + 7))])
def test_an_archives_cached_geometry_is_that_of_its_bytes(dtype, shape):
    archive = TensorArchive(dtype, shape, f"item@{list(shape)}")
    head, tail = archive.head(), archive.tail(0)
    assert len(head) == archive.data_offset
    assert archive.length == len(head) + archive.nbytes + len(tail)
    other = TensorArchive(dtype, shape, "another item")
    assert other.length == archive.length and other.head() == head and other.tail(0) != tail  # its own id


def test_object_archives_framed_once_differ_only_by_their_serialization_id():
    import io
    import pickle
    import zipfile

    empty = pickle.dumps([None], protocol=2)
    first, second = object_archive(empty, "a/shard_0_1"), object_archive(empty, "b/shard_0_1")
    assert len(first) == len(second) and first != second
    for data in (first, second, object_archive(pickle.dumps({"k": 1}, protocol=2), "c")):
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            assert archive.testzip() is None
            assert archive.namelist()[-1] == "archive/.data/serialization_id"


def _result(mesh, tensors):
    from ckpttool.commands.split_result import SplitResult
    from ckpttool.plan.plan import Plan

    return SplitResult(source="src", output=None, format="hf", to="megatron", mesh=mesh, plan=Plan("src", "hf", ()),
                       files=(), tensors=tuple(tensors), config=None, adapter="test", dry_run=True)


def test_above_1024_ranks_the_json_gives_each_tensors_local_shapes_as_runs_of_ranks():
    """8192 ranks x ~1,000 tensors would be ~400 MB of JSON: consecutive ranks of one shape are one run."""
    from ckpttool.commands.meshes import MegatronMesh
    from ckpttool.commands.split_result import LOCAL_SHAPES_MOST

    dims = (("pp", 16), ("ep", 64), ("tp", 8))
    norm = Sharding("decoder.layers.5.input_layernorm.weight", (7168,), dims, (REPLICATE,) * 3, (512, 1024))
    fc1 = Sharding("decoder.layers.5.mlp.experts.experts.linear_fc1.weight", (256, 4096, 7168), dims,
                   (REPLICATE, Placement("shard", 0), Placement("strided", 1, 2)), (512, 1024))
    big = _result(MegatronMesh(tp=8, pp=16, ep=64), [norm, fc1]).to_json()["tensors"]
    assert [t.get("local_shapes") for t in big] == [None, None]
    assert big[0]["local_shape_runs"] == [[[0], 512], [[7168], 512], [[0], 7168]]
    assert big[1]["local_shape_runs"] == [[[0, 0, 0], 512], [[4, 512, 7168], 512], [[0, 0, 0], 7168]]
    assert sum(n for _, n in big[1]["local_shape_runs"]) == 8192 > LOCAL_SHAPES_MOST
    small_dims = (("pp", 2), ("ep", 4), ("tp", 2))
    small = Sharding("decoder.layers.0.input_layernorm.weight", (8,), small_dims, (REPLICATE,) * 3, (0, 8))
    (entry,) = _result(MegatronMesh(tp=2, pp=2, ep=4), [small]).to_json()["tensors"]
    assert "local_shape_runs" not in entry and entry["local_shapes"] == [[8]] * 8 + [[0]] * 8
