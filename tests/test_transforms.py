"""Transforms in the plan (ckpttool.plan.transforms): each map and its inverse, the tiling proof on the pre tensor,
the streaming executor writing transformed targets chunk by chunk, the dry-run peak, and both directions."""

from __future__ import annotations

import json
import os
import re

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttool import read_layout
from ckpttool.execute.buffers import buffer_sizes, chunks, piece_uses
from ckpttool.execute.digest import checks
from ckpttool.execute.reads import Reader
from ckpttool.execute.executor import file_digest, write_file
from ckpttool.execute.reference import PieceLoader, assemble
from ckpttool.io.safetensors_format import encode_header
from ckpttool.errors import ConfigError, CoverageError
from ckpttool.layout.layout import Box
from ckpttool.plan.plan import Dequantize, TargetSpec, identity_specs, plan_merge
from ckpttool.plan.tiling import Slice
from ckpttool.plan.transforms import Chain, Permute, Transpose, interleave, rope_halves, transform_tensor
from conftest import fixture_dir

LLAMA = "llama_tp2_dcp"
HEAD_DIM = 8  # fixtures/llama_tp2_dcp/config.json
Q, K = "model.layers.0.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight"
DOWN = "model.layers.0.mlp.down_proj.weight"


def hf_permute(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """HF's convert_llama_weights_to_hf.py ``permute`` (and torchtitan's ``_permute``), written out."""
    dim1, dim2 = w.shape
    return w.view(n_heads, dim1 // n_heads // 2, 2, dim2).transpose(1, 2).reshape(dim1, dim2)


def transformed_specs(layout, transforms: dict) -> list[TargetSpec]:
    """The identity specs of ``layout``, the ones named in ``transforms`` carrying that transform (their slices
    tile the pre tensor, the source tensor as it is)."""
    specs = []
    for spec in identity_specs(layout):
        t = transforms.get(spec.name)
        specs.append(spec if t is None else TargetSpec(spec.name, t.target_shape(spec.shape), spec.slices, transform=t))
    return specs


# ---- the maps ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("heads,head_dim,cols", [(1, 2, 1), (4, 8, 32), (2, 16, 5), (3, 64, 7)])
def test_rope_halves_is_the_hf_convert_script_permutation_and_its_inverse_undoes_it(heads, head_dim, cols):
    w = torch.randn(heads * head_dim, cols)
    halves = transform_tensor(rope_halves(head_dim), w)
    assert torch.equal(halves, hf_permute(w, heads))
    assert torch.equal(transform_tensor(rope_halves(head_dim).inverse(), halves), w)
    assert rope_halves(head_dim).inverse().inverse() == rope_halves(head_dim)


@pytest.mark.parametrize("shape,dim", [((3, 8), -1), ((8, 3), 0), ((2, 5, 12), 2), ((2, 6, 4), 1)])
def test_interleave_equals_stack_and_flatten_and_its_inverse_undoes_it(shape, dim):
    size = shape[dim]
    a, b = torch.randn(shape).chunk(2, dim)
    pre = torch.cat([a, b], dim)
    d = dim % len(shape)
    got = transform_tensor(interleave(2, size, dim), pre)
    assert torch.equal(got, torch.stack([a, b], d + 1).flatten(d, d + 1))
    assert torch.equal(transform_tensor(interleave(2, size, dim).inverse(), got), pre)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn, torch.int64, torch.bool])
def test_every_map_moves_bits_as_they_are_whatever_the_dtype(dtype):
    pre = torch.randint(0, 255, (4, 6, 2), dtype=torch.uint8).view(dtype) if dtype.itemsize == 1 \
        else torch.randn(4, 6, 2).to(dtype)
    for t in (Transpose(0, 1), Transpose(1, 2), rope_halves(2, dim=2), interleave(3, 6, dim=1),
              Chain((rope_halves(2), Transpose(0, 2))), Chain((Transpose(0, 1), interleave(2, 4, dim=1)))):
        out = transform_tensor(t, pre)
        back = transform_tensor(t.inverse(), out)
        assert back.view(torch.uint8).equal(pre.view(torch.uint8)), t.name


def test_a_transpose_and_a_chain_map_shapes_both_ways_and_name_themselves():
    chain = Chain((rope_halves(4), Transpose(0, 1)))
    assert chain.target_shape((8, 3)) == (3, 8) and chain.source_shape((3, 8)) == (8, 3)
    assert chain.name == "RoPE pairs to halves (head_dim 4), then transpose dims 0 and 1"
    assert chain.inverse().name == "transpose dims 0 and 1, then RoPE halves to pairs (head_dim 4)"
    w = torch.randn(8, 3)
    assert torch.equal(transform_tensor(chain, w), hf_permute(w, 2).T)
    assert Permute(1, 2, (1, 0)).name == "permute dim 1 in blocks of 2 as [1, 0]"
    assert Permute(1, 2, (1, 0)).inverse().name == "inverse of permute dim 1 in blocks of 2 as [1, 0]"


@pytest.mark.parametrize("rows", [1, 3, 8, 24])
def test_chunks_of_target_rows_computed_from_their_pre_rows_give_the_whole(rows):
    """What the executor does: target rows a..b from pre rows pre_rows(a, b), whatever the chunk boundaries."""
    pre = torch.randn(24, 4, 3)
    for t in (rope_halves(8), Transpose(1, 2), Transpose(0, 2), Chain((interleave(2, 4, 1), rope_halves(4)))):
        shape = t.target_shape(tuple(pre.shape))
        bound = t.bound(shape, "w")
        whole = transform_tensor(t, pre)
        per = bound.align(shape, rows)
        for a in range(0, shape[0], per):
            b = min(a + per, shape[0])
            pa, pb = bound.pre_rows(shape, a, b)
            got = bound.apply(pre[pa:pb], shape, a, b, "F32", lambda _, s, d: torch.empty(s))
            assert torch.equal(got, whole[a:b]), (t.name, a, b)


def test_unaligned_rows_of_a_row_permutation_take_their_whole_blocks():
    pre = torch.randn(16, 2)
    bound = rope_halves(8).bound((16, 2), "w")
    assert bound.align((16, 2), 3) == 8 and bound.pre_rows((16, 2), 3, 10) == (0, 16)
    got = bound.apply(pre, (16, 2), 3, 10, "F32", lambda _, s, d: torch.empty(s))
    assert torch.equal(got, hf_permute(pre, 2)[3:10])
    assert bound.scratch_bytes((16, 2), 3, 10, 4) == {"transform": 7 * 2 * 4, "transform.blocks": 16 * 2 * 4}


def test_a_transpose_of_dim_0_needs_every_pre_row_and_the_whole_tensor_per_chunk():
    bound = Transpose(1, 0).bound((5, 3), "w")
    assert bound == Transpose(0, 1)
    assert bound.align((5, 3), 1) == 5 and bound.pre_rows((5, 3), 1, 2) == (0, 3)


# ---- bad arguments ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("transform,shape,message", [
    (Permute(0, 5, (0, 1, 2, 3, 4)), (32, 4), "'w': permute dim 0 in blocks of 5 as [0, 1, 2, 3, 4] needs blocks of 5 "
     "along dim 0, which does not divide its size 32 (shape [32, 4])"),
    (rope_halves(16), (24, 4), "'w': RoPE pairs to halves (head_dim 16) needs blocks of 16 along dim 0, which does not "
     "divide its size 24 (shape [24, 4])"),
    (Permute(1, 3, (0, 0, 2)), (2, 3), "'w': permute dim 1 in blocks of 3 as [0, 0, 2]: the order [0, 0, 2] is not a "
     "permutation of 0..2"),
    (Permute(1, 3, (0, 1)), (2, 3), "'w': permute dim 1 in blocks of 3 as [0, 1]: the order [0, 1] is not a "
     "permutation of 0..2"),
    (Permute(2, 2, (1, 0)), (2, 4), "'w': permute dim 2 in blocks of 2 as [1, 0] works on dim 2, out of range for the "
     "target's shape [2, 4]"),
    (Transpose(0, 2), (3, 4), "'w': transpose dims 0 and 2 works on dim 2, out of range for the target's shape [3, 4]"),
    (Transpose(1, -1), (3, 4), "'w': transpose dims 1 and -1 swaps a dim with itself (shape [3, 4]); name two dims"),
    (Transpose(0, 1), (), "'w': transpose dims 0 and 1 works on dim 0, out of range for the target's shape []"),
    (Chain(()), (3, 4), "'w': a chain of transforms needs at least one step"),
    (Chain((Transpose(0, 1), interleave(2, 4, dim=0))), (3, 4), "'w': interleave 2 parts of 2 along dim 0 needs blocks "
     "of 4 along dim 0, which does not divide its size 3 (shape [3, 4])"),
])
def test_a_transform_that_does_not_fit_its_target_is_refused_naming_it(transform, shape, message):
    with pytest.raises(ConfigError) as e:
        transform.bound(shape, "w")
    assert str(e.value) == message


def test_factories_refuse_arguments_that_make_no_permutation():
    with pytest.raises(ConfigError, match=re.escape("rope_halves: head_dim 7 is not a positive even number; RoPE "
                                                    "rotates pairs")):
        rope_halves(7)
    with pytest.raises(ConfigError, match=re.escape("interleave: 3 parts do not divide a dim of 8; each part needs "
                                                    "the same size")):
        interleave(3, 8)


# ---- the plan ---------------------------------------------------------------------------------------------------

def test_a_transformed_spec_over_tp_pieces_tiles_its_pre_tensor():
    layout = read_layout(fixture_dir(LLAMA) / "checkpoint")
    plan = plan_merge(layout, transformed_specs(layout, {Q: rope_halves(HEAD_DIM), DOWN: Transpose(0, -1)}))
    targets = {t.name: t for t in plan.targets}
    assert targets[Q].transform == rope_halves(HEAD_DIM) and len(targets[Q].copies) == 2
    assert targets[Q].shape == targets[Q].filled_shape == (32, 32)
    assert targets[DOWN].transform == Transpose(0, 1)  # bound: dims plain
    assert targets[DOWN].shape == (64, 32) and targets[DOWN].filled_shape == (32, 64)
    assert targets[K].transform is None


def test_a_gap_or_an_overlap_in_the_pre_tensor_is_reported_as_usual():
    layout = read_layout(fixture_dir(LLAMA) / "checkpoint")
    whole = Box((0, 0), (64, 32))
    half = Box((0, 0), (32, 32))
    gap = TargetSpec("t", (64, 32), (Slice(DOWN, half, half),), transform=Transpose(0, 1))  # pre: (32, 64)
    with pytest.raises(CoverageError) as e:
        plan_merge(layout, [gap])
    assert "'t': columns 32..64 covered by no piece (shape [32, 64]" in str(e.value)
    twice = TargetSpec("t", (64, 32), (Slice("model.layers.0.mlp.up_proj.weight", whole, whole),
                                       Slice("model.layers.0.mlp.up_proj.weight", whole, whole)),
                       transform=rope_halves(HEAD_DIM))
    with pytest.raises(CoverageError) as e:
        plan_merge(layout, [twice])
    assert "'t': rows 0..32 covered twice" in str(e.value)


def test_a_target_both_dequantized_and_transformed_is_refused_at_plan_time():
    layout = read_layout(fixture_dir(LLAMA) / "checkpoint")
    whole = Box((0, 0), (32, 32))
    spec = TargetSpec(Q, (32, 32), (Slice(Q, whole, whole),), Dequantize("fp8", (), (32, 32), None),
                      rope_halves(HEAD_DIM))
    with pytest.raises(ConfigError) as e:
        plan_merge(layout, [spec], dtype="BF16")
    assert str(e.value) == (
        f"'{Q}': is both dequantized (fp8) and transformed (RoPE pairs to halves (head_dim 8)); a target does one or "
        "the other for now. Merge the quantized checkpoint without a dtype (or dequantize it first with a merge), "
        "then transform that output")


# ---- streaming --------------------------------------------------------------------------------------------------

def stream(plan, path, chunk_bytes: int, workers: int = 1) -> None:
    """Every target of ``plan`` written to one safetensors file in chunks of at most ``chunk_bytes``, its digest
    computed again from the file."""
    prefix, offsets = encode_header({t.name: (t.dtype, t.shape) for t in plan.targets}, {"format": "pt"})
    chunk_list = [c for t in plan.targets for c in chunks(t, offsets[t.name][0], chunk_bytes)]
    reader = Reader(plan.root, piece_uses(chunk_list), buffer_sizes(chunk_list))
    try:
        digest = write_file(path, prefix, chunk_list, reader, workers)
        assert file_digest(path, len(prefix), checks(chunk_list, reader)) == digest
    finally:
        reader.close()


def llama_transforms(config: dict) -> dict:
    """rope_halves on every Q and K (Meta order to HF), a transpose of one 2-D tensor and a chain on another."""
    head_dim = config["head_dim"]
    found = {}
    for layer in range(config["num_hidden_layers"]):
        for proj in ("q_proj", "k_proj"):
            found[f"model.layers.{layer}.self_attn.{proj}.weight"] = rope_halves(head_dim)
    found[DOWN] = Transpose(0, 1)
    found["model.layers.1.mlp.up_proj.weight"] = Chain((interleave(2, 64), Transpose(1, 0)))
    return found


@pytest.mark.parametrize(("chunk_bytes", "workers"), [(200, 1), (1000, 3), (2**25, 2)])
def test_a_transformed_merge_streams_bit_for_bit_what_torch_computes(chunk_bytes, workers, tmp_path):
    layout = read_layout(fixture_dir(LLAMA) / "checkpoint")
    config = json.loads((fixture_dir(LLAMA) / "config.json").read_text())
    transforms = llama_transforms(config)
    plan = plan_merge(layout, transformed_specs(layout, transforms))
    stream(plan, tmp_path / "out.safetensors", chunk_bytes, workers)
    written = load_file(tmp_path / "out.safetensors")
    reference = load_file(fixture_dir(LLAMA) / "reference" / "model.safetensors")
    for name, tensor in reference.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            expected = hf_permute(tensor, tensor.shape[0] // HEAD_DIM)
        elif name == DOWN:
            expected = tensor.T
        elif name == "model.layers.1.mlp.up_proj.weight":
            expected = torch.stack(tensor.chunk(2, 0), 1).flatten(0, 1).T
        else:
            expected = tensor
        assert torch.equal(written[name], expected), name
    loader = PieceLoader(plan.root)
    for target in plan.targets:  # the reference executor agrees
        assert torch.equal(written[target.name], assemble(target, loader)), target.name


def test_thread_buffers_stay_within_the_predicted_sizes_of_a_transformed_plan(tmp_path):
    """The prediction (--dry-run's peak) counts the pre rows a chunk gathers and the transform's own buffers: a
    thread never makes a buffer it does not predict, nor one larger."""
    layout = read_layout(fixture_dir(LLAMA) / "checkpoint")
    config = json.loads((fixture_dir(LLAMA) / "config.json").read_text())
    plan = plan_merge(layout, transformed_specs(layout, llama_transforms(config)))
    chunk_list = [c for t in plan.targets for c in chunks(t, 0, 300)]
    sizes = buffer_sizes(chunk_list)
    # the transposed down_proj is one chunk (dim 0 swapped): its 32x64 pre tensor gathered whole, 8 KiB
    assert sizes["transform"] == sizes["chunk"] == 64 * 32 * 4
    assert sizes["transform.0"] == 64 * 32 * 4  # the chain's first step (the interleave), before its transpose
    reader = Reader(plan.root, piece_uses(chunk_list), sizes)
    try:
        write_file(tmp_path / "out.safetensors", b"", chunk_list, reader)
        buffers = reader._local.buffers
        assert {"chunk", "transform", "transform.0"} <= set(buffers) <= set(sizes)
        for name, buffer in buffers.items():
            assert len(buffer) == sizes[name], name
    finally:
        reader.close()
    rope_only = plan_merge(layout, transformed_specs(layout, {Q: rope_halves(HEAD_DIM)}))
    q = [c for t in rope_only.targets if t.name == Q for c in chunks(t, 0, 300)]
    assert [(c.start, c.stop) for c in q] == [(0, 8), (8, 16), (16, 24), (24, 32)]  # whole heads, not whole tensors
    assert buffer_sizes(q)["transform"] == 8 * 32 * 4


PEAK = """
import json, sys
import torch
from ckpttool import read_layout
from ckpttool.plan.plan import TargetSpec, identity_specs, plan_merge
from ckpttool.plan.transforms import Transpose, rope_halves
from ckpttool.execute.buffers import buffer_sizes, chunks, piece_uses, predict_peak_bytes
from ckpttool.execute.executor import write_file
from ckpttool.execute.reads import Reader
src, out, kind = sys.argv[1], sys.argv[2], sys.argv[3]
layout = read_layout(src)
t = rope_halves(128) if kind == "rope" else Transpose(0, 1)
plan = plan_merge(layout, [TargetSpec("w", (2048, 2048), s.slices, transform=t) for s in identity_specs(layout)])
chunk_list = [c for target in plan.targets for c in chunks(target, 0, 2**20)]
predicted = predict_peak_bytes(chunk_list)
torch.empty(8).index_select(0, torch.tensor([0]))  # torch's own first-use costs, before the baseline
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # the high-water mark starts again from here
base = status("VmRSS")
reader = Reader(plan.root, piece_uses(chunk_list), buffer_sizes(chunk_list))
write_file(__import__("pathlib").Path(out), b"", chunk_list, reader)
peak = status("VmHWM")
print(json.dumps({"predicted": predicted, "measured": peak - base}))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="resets the high-water mark of Linux's /proc")
@pytest.mark.parametrize("kind", ["rope", "transpose"])
def test_the_predicted_peak_bounds_the_measured_one_of_a_transformed_merge(kind, tmp_path):
    """In a fresh process: the resident memory a 16 MiB transformed tensor's merge adds stays under the dry run's
    prediction (chunks of whole heads of 1 MiB; a transpose of dim 0 gathers the tensor whole, and predicts so)."""
    import subprocess
    import sys

    (tmp_path / "src").mkdir()
    save_file({"w": torch.randn(2048, 2048)}, tmp_path / "src" / "model.safetensors")  # 16 MiB, made here
    env = {**os.environ, "PYTHONPATH": str(fixture_dir(LLAMA).parent.parent)}
    done = subprocess.run([sys.executable, "-c", PEAK, str(tmp_path / "src"), str(tmp_path / "out"), kind],
                          capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout)
    print(kind, found)
    assert found["measured"] <= found["predicted"]
    if kind == "rope":
        assert found["predicted"] < 16 * 2**20  # never the whole tensor
    else:
        assert found["predicted"] > 3 * 16 * 2**20  # the pre tensor, the transposed one, and the read


# ---- both directions --------------------------------------------------------------------------------------------

#: maps that keep every shape (a split reads the merged output against the model's config)
SQUARE = {Q: rope_halves(HEAD_DIM), K: rope_halves(HEAD_DIM), "model.layers.0.self_attn.o_proj.weight": Transpose(0, 1),
          "model.layers.1.mlp.gate_proj.weight": Chain((interleave(2, 32, dim=1), rope_halves(HEAD_DIM)))}


def merged_with(transforms: dict, out) -> None:
    """The llama fixture merged through ``transforms`` into ``out`` (an HF directory with its config)."""
    layout = read_layout(fixture_dir(LLAMA) / "checkpoint")
    out.mkdir()
    stream(plan_merge(layout, transformed_specs(layout, transforms)), out / "model.safetensors", 300)
    (out / "config.json").write_text((fixture_dir(LLAMA) / "config.json").read_text())


def test_a_second_plan_over_the_merged_output_with_the_inverse_maps_gives_the_original_bytes(tmp_path):
    merged_with(SQUARE, tmp_path / "hf")
    layout = read_layout(tmp_path / "hf")
    back = plan_merge(layout, transformed_specs(layout, {n: t.inverse() for n, t in SQUARE.items()}))
    stream(back, tmp_path / "back.safetensors", 200, workers=2)
    reference = fixture_dir(LLAMA) / "reference" / "model.safetensors"
    assert load_file(tmp_path / "back.safetensors").keys() == load_file(reference).keys()
    for name, tensor in load_file(reference).items():
        assert torch.equal(load_file(tmp_path / "back.safetensors")[name], tensor), name


def test_split_writes_the_inverse_maps_per_rank_and_gives_the_original_bytes_back(tmp_path, monkeypatch):
    """split --to dcp of the transformed merge, the model's in-memory tensors declared as the inverse maps of the
    on-disk ones (what a family adapter says, e.g. torchtitan's Meta RoPE order): every rank's box is the same map
    of a box of the pre tensor, and merging the DCP again gives the fixture's own tensors."""
    from dataclasses import replace

    import ckpttool
    from ckpttool.commands import split_dcp

    merged_with(SQUARE, tmp_path / "hf")
    real = split_dcp.map_from_hf
    inverse = {n: t.inverse() for n, t in SQUARE.items()}
    monkeypatch.setattr(split_dcp, "map_from_hf",
                        lambda info: [replace(m, transform=inverse.get(m.name)) for m in real(info)])
    dry = ckpttool.split(tmp_path / "hf", None, to="dcp", fsdp=2, dry_run=True)
    assert dry.transforms()[Q] == "RoPE halves to pairs (head_dim 8)"
    assert "RoPE halves to pairs (head_dim 8)" in "\n".join(dry.lines())
    tensors = {t["name"]: t for t in dry.to_json()["tensors"]}
    assert tensors["model.layers.0.self_attn.o_proj.weight"]["transform"] == "transpose dims 0 and 1"
    assert "transform" not in tensors["model.layers.0.self_attn.v_proj.weight"]
    ckpttool.split(tmp_path / "hf", tmp_path / "dcp", to="dcp", fsdp=2)
    back = plan_merge(read_layout(tmp_path / "dcp"))
    stream(back, tmp_path / "back.safetensors", 10**6)
    written = load_file(tmp_path / "back.safetensors")
    for name, tensor in load_file(fixture_dir(LLAMA) / "reference" / "model.safetensors").items():
        assert torch.equal(written[name], tensor), name


def test_a_rank_box_that_cuts_through_a_transforms_blocks_is_refused(tmp_path, monkeypatch):
    import ckpttool
    from ckpttool.commands import split_dcp

    merged_with({}, tmp_path / "hf")
    real = split_dcp.map_from_hf
    bad = interleave(2, 64)  # one block of all 64 rows of gate_proj: fsdp=2 cuts it in two
    name = "model.layers.1.mlp.gate_proj.weight"
    monkeypatch.setattr(split_dcp, "map_from_hf", lambda info: [
        replace_transform(m, bad if m.name == name else None) for m in real(info)])
    with pytest.raises(CoverageError) as e:
        ckpttool.split(tmp_path / "hf", tmp_path / "dcp", to="dcp", fsdp=2)
    assert (f"'{name}': rows 0..32 cuts through the blocks of interleave 2 parts of 32 along dim 0, which must stay "
            "whole in one chunk; shard it along another dim, or in whole blocks") in str(e.value)
    assert not (tmp_path / "dcp").exists()


def replace_transform(memory, transform):
    from dataclasses import replace

    return replace(memory, transform=transform)


def test_a_dry_run_lists_each_transformed_target_with_its_map(capsys):
    from ckpttool.cli.show import print_result
    from ckpttool.commands.merge_result import MergeResult

    layout = read_layout(fixture_dir(LLAMA) / "checkpoint")
    plan = plan_merge(layout, transformed_specs(layout, {Q: rope_halves(HEAD_DIM), DOWN: Transpose(0, 1)}))
    result = MergeResult(str(layout.root), None, layout.format, plan, (), (), None, True)
    print_result(result, 0)
    out = capsys.readouterr().out
    assert f"  {Q}  F32 [32x32]  <- {Q} (2 pieces, RoPE pairs to halves (head_dim 8))" in out
    assert f"  {DOWN}  F32 [64x32]  <- {DOWN} (2 pieces, transpose dims 0 and 1)" in out
    assert f"  {K}  F32 [16x32]  <- {K} (2 pieces)" in out
    targets = {t["name"]: t for t in result.to_json()["targets"]}
    assert targets[Q]["transform"] == "RoPE pairs to halves (head_dim 8)" and "transform" not in targets[K]


def test_a_box_of_a_whole_transformed_target_is_carried_through_compose_and_part_of_one_is_refused():
    from ckpttool.plan.compose import compose

    layout = read_layout(fixture_dir(LLAMA) / "checkpoint")
    plan = plan_merge(layout, transformed_specs(layout, {Q: rope_halves(HEAD_DIM), DOWN: Transpose(0, 1)}))
    targets = {t.name: t for t in plan.targets}
    reference = load_file(fixture_dir(LLAMA) / "reference" / "model.safetensors")
    loader = PieceLoader(plan.root)
    for name, box, expected in [(Q, Box((8, 0), (16, 32)), hf_permute(reference[Q], 4)[8:24]),
                                (DOWN, Box((16, 0), (16, 32)), reference[DOWN].T[16:32])]:
        whole = Box.whole(targets[name].shape)
        target, problems = compose("m", box, [Slice(name, whole, whole)], targets)
        assert not problems and target.transform is not None and target.shape == box.sizes
        assert torch.equal(assemble(target, loader), expected), name
    half = Box((0, 0), (16, 32))
    target, problems = compose("m", half, [Slice(Q, half, half)], targets)
    assert target is None and problems == [
        f"'m': is made of '{Q}', which is transformed (RoPE pairs to halves (head_dim 8)) and has a transform of its "
        "own, or is one of several parts: only a whole transformed tensor is carried through, as it is; merge it "
        "first, then use that output"]


def test_a_large_transformed_chunk_is_built_and_hashed_never_copied_file_to_file(tmp_path):
    """A chunk of a one-piece tensor would be copied file to file or read in place; transformed, its bytes are not
    the source's, so it is built, its CRC-32 is its digest token, and the journal's plan identity tells it apart."""
    from ckpttool.execute.copies import COPY_BYTES, copied
    from ckpttool.execute.assembly import direct_offset
    from ckpttool.writers.hf import assign_files
    from ckpttool.writers.journal import plan_id

    (tmp_path / "src").mkdir()
    w = torch.randn(2048, 256)  # 2 MiB: one chunk, above COPY_BYTES
    save_file({"w": w}, tmp_path / "src" / "model.safetensors")
    layout = read_layout(tmp_path / "src")
    plain = plan_merge(layout)
    plan = plan_merge(layout, transformed_specs(layout, {"w": rope_halves(128)}))
    (chunk,) = chunks(plan.targets[0], 0)
    assert chunk.nbytes >= COPY_BYTES and copied(chunk) is None and direct_offset(chunk) is None
    (untransformed,) = chunks(plain.targets[0], 0)
    assert copied(untransformed) is not None and direct_offset(untransformed) is not None
    stream(plan, tmp_path / "out.safetensors", 2**25)  # its digest computed again from the file agrees
    assert torch.equal(load_file(tmp_path / "out.safetensors")["w"], hf_permute(w, 16))
    assert plan_id(plan, assign_files(plan)) != plan_id(plain, assign_files(plain))


def test_a_transformed_target_of_no_rows_has_no_chunk():
    from ckpttool.layout.layout import Piece
    from ckpttool.plan.tiling import Copy
    from ckpttool.plan.plan import Target

    piece = Piece("f.safetensors", "w", Box((0, 0), (0, 4)), "F32")
    for t in (rope_halves(2, dim=1), Transpose(0, 1)):
        shape = t.target_shape((0, 4))
        target = Target("w", shape, "F32", "F32", (Copy(piece, piece.box, piece.box),), ("w",), transform=t)
        assert chunks(target, 0, 8) == [] or all(c.nbytes == 0 for c in chunks(target, 0, 8))


def test_split_to_megatron_refuses_vocab_padding_below_a_transformed_tensor():
    from ckpttool.commands.split_megatron import _compose

    layout = read_layout(fixture_dir(LLAMA) / "checkpoint")
    embed = "model.embed_tokens.weight"
    plan = plan_merge(layout, transformed_specs(layout, {embed: interleave(2, 32, dim=1)}))
    targets = {t.name: t for t in plan.targets}
    whole = Box.whole((1001, 32))
    target, problems = _compose(embed, Box((0, 0), (1024, 32)), [Slice(embed, whole, whole)], targets, 1001)
    assert target is None and problems == [
        f"'{embed}': vocab padding rows below a transformed tensor (interleave 2 parts of 16 along dim 1) are not "
        "written yet; merge it first, then split that output"]
    target, problems = _compose(embed, Box((0, 0), (512, 32)), [Slice(embed, whole, whole)], targets, 1001)
    assert not problems and target.transform == interleave(2, 32, dim=1)  # rows above the padding: carried
