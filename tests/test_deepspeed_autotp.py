"""DeepSpeed AutoTP checkpoints (tensor_parallel.autotp_size): real AutoTP training runs (fixtures/
make_deepspeed_autotp.py, uneven cuts on heads, intermediate size and vocab) merge to exactly DeepSpeed's own gather
of the run and load in transformers with its logits; every split comes from what DeepSpeed recorded, and a tensor
whose split is not recorded, or a missing rank, stops the merge with names."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, load_output, tree_digest
from safetensors.torch import load_file
from test_deepspeed import STEP, _patch_pickle
from transformers import AutoModelForCausalLM

import ckpttool

CASES = ("zero1", "zero2")
INPUT_IDS = torch.tensor([[1, 5, 17, 299, 300, 42, 7, 3], [2, 140, 151, 150, 250, 149, 0, 9]])


def fixture(case: str) -> Path:
    path = FIXTURES / f"deepspeed_autotp_{case}"
    assert (path / "checkpoint").is_dir(), f"fixture {path.name} missing: run fixtures/make_deepspeed_autotp.py"
    return path


@pytest.fixture(scope="module", params=CASES)
def merged(request, tmp_path_factory) -> tuple[str, Path]:
    case = request.param
    out = tmp_path_factory.mktemp(case) / "hf"
    before = tree_digest(fixture(case))
    assert ckpttool.merge(fixture(case) / "checkpoint", out).format == "deepspeed"
    assert tree_digest(fixture(case)) == before, "the source was modified"
    return case, out


def _equal_to_reference(case: str, out: Path) -> None:
    got, want = load_output(out), load_output(fixture(case) / "reference")
    assert sorted(got) == sorted(want) and len(want) == 21
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(got[name], tensor), f"{case}: {name} differs"


def test_merge_equals_deepspeeds_own_gather_bit_for_bit(merged):
    _equal_to_reference(*merged)  # reference: engine._consolidated_16bit_state_dict(), = ds_to_universal (producer)


def test_merged_model_gives_the_references_logits_and_the_engines(merged):
    case, out = merged
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = AutoModelForCausalLM.from_pretrained(fixture(case) / "reference").eval()
    engine = load_file(fixture(case) / "logits.safetensors")["logits"]  # the TP engine's own forward
    with torch.no_grad():
        logits = ours(INPUT_IDS).logits
        assert torch.equal(logits, reference(INPUT_IDS).logits)
    torch.testing.assert_close(logits, engine, rtol=0, atol=1e-5)  # the TP all-reduce sums in another order


@pytest.mark.parametrize("case", CASES)
def test_weights_module_places_each_ranks_module_shard_the_same_way(case, tmp_path):
    # fp32 training: the module shards are the master weights (checked per rank by the producer)
    assert "equal" in json.loads((fixture(case) / "producer.json").read_text())["master_weights"]
    ckpttool.merge(fixture(case) / "checkpoint", tmp_path / "hf", weights="module")
    _equal_to_reference(case, tmp_path / "hf")
    layout = ckpttool.read_layout(fixture(case) / "checkpoint", weights="module")
    assert {p.file for t in layout.tensors.values() for p in t.pieces} == {
        f"{STEP}/mp_rank_00_model_states.pt", f"{STEP}/mp_rank_01_model_states.pt"}


def _by_rank(layout, name: str) -> dict[int, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    pieces: dict[int, list] = {}
    for p in layout.tensors[name].pieces:
        pieces.setdefault(dict(p.tags)["tp_rank"], []).append((p.box.offsets, p.box.sizes))
    return {r: sorted(v) for r, v in sorted(pieces.items())}


def test_each_tensor_sits_where_autotp_cut_it():
    # AutoTP's rule (tp_shard.get_shard_size): q/k/v/o by key/value heads, 3 over 2 ranks -> 2:1; gate/up/down by
    # grain 41/40; lm_head 151/150; embedding and norms whole on both ranks (read from rank 0)
    layout = ckpttool.read_layout(fixture("zero1") / "checkpoint")
    assert layout.parallel == {"tp": 2, "pp": 1, "dp": 1}
    layer = "model.layers.1."
    assert _by_rank(layout, "lm_head.weight") == {0: [((0, 0), (151, 48))], 1: [((151, 0), (150, 48))]}
    assert _by_rank(layout, layer + "self_attn.q_proj.weight") == {0: [((0, 0), (32, 48))], 1: [((32, 0), (16, 48))]}
    assert _by_rank(layout, layer + "self_attn.k_proj.weight") == {0: [((0, 0), (16, 48))], 1: [((16, 0), (8, 48))]}
    assert _by_rank(layout, layer + "self_attn.o_proj.weight") == {0: [((0, 0), (48, 32))], 1: [((0, 32), (48, 16))]}
    assert _by_rank(layout, layer + "mlp.gate_proj.weight") == {0: [((0, 0), (41, 48))], 1: [((41, 0), (40, 48))]}
    assert _by_rank(layout, layer + "mlp.down_proj.weight") == {0: [((0, 0), (48, 41))], 1: [((0, 41), (48, 40))]}
    assert _by_rank(layout, "model.embed_tokens.weight") == {0: [((0, 0), (301, 48))]}
    assert _by_rank(layout, "model.norm.weight") == {0: [((0,), (48,))]}
    # with ZeRO-2 over 2 dp ranks, a TP shard straddling the dp partitions is cut twice: tp and dp tags on each piece
    layout = ckpttool.read_layout(fixture("zero2") / "checkpoint")
    assert layout.parallel == {"tp": 2, "pp": 1, "dp": 2}
    tags = {tuple(sorted(dict(p.tags).items())) for t in layout.tensors.values() for p in t.pieces}
    assert tags == {(("dp_rank", d), ("tp_rank", r)) for d in (0, 1) for r in (0, 1)}


def test_dry_run_shows_the_autotp_split(cli):
    result = cli("merge", fixture("zero2") / "checkpoint", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "parallel: tp=2 pp=1 dp=2" in result.stdout
    assert (f"note: AutoTP over 2 tensor-parallel ranks, each tensor placed by the split DeepSpeed recorded "
            f"(universal_checkpoint_info in '{STEP}/mp_rank_00_model_states.pt'): 21 placed by their affine map"
            ) in result.stdout
    assert "lm_head.weight  F32 [301x48]  <- lm_head.weight (2 pieces)" in result.stdout


@pytest.mark.parametrize("case", CASES)
def test_without_affine_maps_the_recorded_categories_give_the_same_merge(case, copy_fixture, tmp_path):
    src = copy_fixture(f"deepspeed_autotp_{case}")
    # hide the maps (the key is renamed): what a checkpoint recording only ds_to_universal's categories holds
    _patch_pickle(src / STEP / "mp_rank_00_model_states.pt", b"affine_map", b"affine_map", b"affine_mXp")
    ckpttool.merge(src, tmp_path / "hf")
    _equal_to_reference(case, tmp_path / "hf")
    notes = ckpttool.read_layout(src).notes
    assert any(n.endswith(": 6 whole on every rank, 11 cut on dim 0 (recorded category), 4 cut on dim 1 (recorded "
                          "category)") for n in notes), notes


def test_a_missing_optimizer_file_of_a_tensor_parallel_rank_names_it_and_its_region(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_autotp_zero2")
    gone = f"{STEP}/zero_pp_rank_1_mp_rank_01_optim_states.pt"
    (src / gone).unlink()
    result = cli("merge", src, tmp_path / "hf")
    # rank 1's shard of lm_head is rows 151..301; its dp rank 1 held the end of the flat buffer
    assert_failed_cleanly(result, tmp_path / "hf", f"'{gone}', which is missing",
                          "'lm_head.weight': rows 151..301 covered by no piece")


def test_a_missing_tensor_parallel_rank_is_named(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_autotp_zero1")
    for name in ("mp_rank_01_model_states.pt", "zero_pp_rank_0_mp_rank_01_optim_states.pt"):
        (src / STEP / name).unlink()
    result = cli("merge", src, tmp_path / "hf")  # rank 0 alone must not pass for the model
    assert_failed_cleanly(result, tmp_path / "hf", f"'{STEP}/mp_rank_01_model_states.pt': missing: tensor-parallel "
                          f"rank 1 of the 2 AutoTP ranks '{STEP}/mp_rank_00_model_states.pt' records")


def test_a_tensor_parallel_rank_without_optimizer_files_is_named(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_autotp_zero1")
    (src / STEP / "zero_pp_rank_0_mp_rank_01_optim_states.pt").unlink()
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"'{STEP}/*zero_pp_rank_*_mp_rank_01_optim_states.pt': missing "
                          "(the fp32 master weights of tensor-parallel rank 1, held by no file)")


# ---- the rule on small hand-made AutoTP steps with DeepSpeed's keys: every way a split can be recorded, and
# every way it can fail to be

GLOBAL = {"col": torch.arange(15.0).reshape(5, 3), "row": torch.arange(100.0, 110.0).reshape(2, 5),
          "rep": torch.arange(200.0, 204.0), "fused": torch.arange(300.0, 312.0).reshape(2, 6)}
#: per tensor: (dim, per-rank sizes) of a contiguous cut, or "whole", or ("fused", dim, sub-sizes, widths)
CUTS = {"col": (0, [3, 2]), "row": (1, [3, 2]), "rep": "whole", "fused": ("fused", 1, [3, 3], [[2, 1], [2, 1]])}


def _strides(shape) -> list[int]:
    return [int(torch.Size(shape[d + 1:]).numel()) for d in range(len(shape))]


def _blocks(name: str) -> dict[int, list[tuple[list[int], list[int], list[int], list[int]]]]:
    """rank -> [(block shape, global offsets, shard offsets, holders)], as affine.py's maps describe them."""
    shape, cut = list(GLOBAL[name].shape), CUTS[name]
    if cut == "whole":
        return {r: [(shape, [0] * len(shape), [0] * len(shape), [0, 1])] for r in (0, 1)}
    if cut[0] == "fused":
        _, dim, subs, widths = cut
        out, start = {0: [], 1: []}, 0
        for i, (sub, per) in enumerate(zip(subs, widths)):
            for r in (0, 1):
                size = list(shape)
                size[dim] = per[r]
                at, local = [0] * len(shape), [0] * len(shape)
                at[dim], local[dim] = start + sum(per[:r]), sum(w[r] for w in widths[:i])
                out[r].append((size, at, local, [r]))
            start += sub
        return out
    dim, sizes = cut
    out = {}
    for r in (0, 1):
        size, at = list(shape), [0] * len(shape)
        size[dim], at[dim] = sizes[r], sum(sizes[:r])
        out[r] = [(size, at, [0] * len(shape), [r])]
    return out


def _shard(name: str, rank: int) -> torch.Tensor:
    blocks = _blocks(name)[rank]
    dim = next((d for d in range(GLOBAL[name].dim()) if blocks[0][0][d] != GLOBAL[name].shape[d]), 0)
    parts = [GLOBAL[name][tuple(slice(a, a + s) for a, s in zip(at, size))] for size, at, _, _ in blocks]
    return torch.cat(parts, dim=dim)


def _map(name: str, **changes) -> dict:
    shape = list(GLOBAL[name].shape)
    ranks = {}
    for r, blocks in _blocks(name).items():
        shard = list(_shard(name, r).shape)
        ranks[r] = {"shard_shape": shard, "pieces": [
            {"shape": size, "source": [sum(a * s for a, s in zip(at, _strides(shape))), _strides(shape)],
             "dest": [sum(a * s for a, s in zip(local, _strides(shard))), _strides(shard)], "locations": holders}
            for size, at, local, holders in blocks]}
    entry = {"logical_shape": shape, "ranks": ranks}
    for key, value in changes.items():  # "ranks.0.pieces.0.scale" = 0.5
        *path, last = key.split(".")
        target = entry
        for part in path:
            target = target[int(part) if part.isdigit() else part]
        target[int(last) if last.isdigit() else last] = value
    return entry


def _uc(maps: bool = True, **extra) -> dict:
    uc = {"universal_checkpoint_version": 0.4, "parameter_with_row_parallelism_patterns": ["^row$"],
          "tp_replicated_parameter_patterns": ["^rep$"], "vocabulary_parameter_patterns": [],
          "parameter_with_sub_params": [], "autotp_unsupported_parameter_patterns": {}}
    if maps:
        uc["affine_map"] = {"version": 1, "params": {f"^{re.escape(n)}$": _map(n) for n in GLOBAL}}
    uc.update(extra)
    return uc


def _autotp_step(root: Path, uc: dict, names=tuple(GLOBAL)) -> Path:
    (root / STEP).mkdir(parents=True)
    (root / "latest").write_text(STEP)
    for r in (0, 1):
        shards = {n: _shard(n, r) for n in names}
        torch.save({"module": {n: t.clone() for n, t in shards.items()}, "buffer_names": [],
                    "param_shapes": [{n: t.shape for n, t in shards.items()}], "shared_params": {},
                    "ds_config": {"tensor_parallel": {"autotp_size": 2}},
                    "checkpoint_parallel_dimensions": {"pp_degree": 1, "tp_degree": 2},
                    "universal_checkpoint_info": uc}, root / STEP / f"mp_rank_{r:02d}_model_states.pt")
        flat = torch.cat([t.flatten() for t in shards.values()])
        torch.save({"optimizer_state_dict": {"zero_stage": 1, "partition_count": [1], "group_paddings": [0],
                                             "single_partition_of_fp32_groups": [flat]}},
                   root / STEP / f"zero_pp_rank_0_mp_rank_{r:02d}_optim_states.pt")
    return root


@pytest.mark.parametrize("weights", ["master", "module"])
def test_affine_maps_place_contiguous_replicated_and_fused_blocks(weights, tmp_path):
    root = _autotp_step(tmp_path / "ckpt", _uc())
    ckpttool.merge(root, tmp_path / "out", audit=False, weights=weights)
    got = load_output(tmp_path / "out")
    assert sorted(got) == sorted(GLOBAL) and all(torch.equal(got[n], GLOBAL[n]) for n in GLOBAL)
    # fused along dim 1: rank 0's shard [2 x 4] is columns 0..2 and 3..5, cut into rows where it is not contiguous
    fused = ckpttool.read_layout(root, weights=weights).tensors["fused"]
    assert sorted(p.box.offsets for p in fused.pieces if dict(p.tags)["tp_rank"] == 0) == [
        (0, 0), (0, 3), (1, 0), (1, 3)]


def test_without_maps_the_categories_place_row_replicated_and_the_rest_on_dim_0(tmp_path):
    root = _autotp_step(tmp_path / "ckpt", _uc(maps=False), names=("col", "row", "rep"))
    ckpttool.merge(root, tmp_path / "out", audit=False)
    got = load_output(tmp_path / "out")
    assert all(torch.equal(got[n], GLOBAL[n]) for n in ("col", "row", "rep"))


RANK0, RANK1 = f"'{STEP}/mp_rank_00_model_states.pt'", f"'{STEP}/mp_rank_01_model_states.pt'"
UC = f"'fused' (universal_checkpoint_info in {RANK0})"


def _with_map(**changes) -> dict:
    return _uc(affine_map={"version": 1, "params": {"^fused$": _map("fused", **changes)}})


@pytest.mark.parametrize(("uc", "says"), [
    (_uc(autotp_unsupported_parameter_patterns={"^fused$": "uneven fused QKV of a Yuan model"}),
     (f"{UC}: DeepSpeed recorded that AutoTP's split of this tensor cannot be converted: uneven fused QKV of a Yuan "
      "model")),
    (_uc(maps=False, parameter_with_sub_params=[{"patterns": ["^fused$"], "shape": [2, [3, 3]], "partition_dim": 1}]),
     f"{UC}: fused sub-parameters with no affine map: the cut of each sub-parameter is not recorded"),
    (_uc(maps=False),
     (f"{UC}: recorded as cut on dim 0, but tensor-parallel rank 1 holds [2, 2] in {RANK1} and rank 0 [2, 4] in "
      f"{RANK0}")),
    (_with_map(**{"ranks.1.pieces.0.scale": 0.5}),
     f"'fused': the affine map in {RANK0} stores rank 1's block scaled by 0.5"),
    (_with_map(**{"ranks.0.pieces.1.dest": [2, [1, 4]]}),
     (f"'fused': the affine map in {RANK0} places a block of rank 0 with strides, not as a box of the global tensor "
      "[2, 6] and the shard [2, 4]; ckpttool cannot express that split")),
    (_with_map(**{"ranks.1.shard_shape": [2, 3]}),
     f"'fused': tensor-parallel rank 1 holds [2, 2] in {RANK1}, but the affine map in {RANK0} gives it [2, 3]"),
    (_uc(affine_map={"version": 2, "params": {}}),
     f"{RANK0}: universal_checkpoint_info records affine maps of format version 2; ckpttool reads version 1"),
], ids=["unsupported", "fused-without-map", "shapes-contradict-the-category", "scaled", "strided", "shard-shape",
        "map-version"])
def test_a_split_that_is_not_recorded_is_refused_with_the_tensor_and_the_file(uc, says, cli, tmp_path):
    root = _autotp_step(tmp_path / "ckpt", uc)
    result = cli("merge", root, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", says)


def test_autotp_without_autotps_record_is_refused(cli, tmp_path):
    root = _autotp_step(tmp_path / "ckpt", {"universal_checkpoint_version": 0.2})  # no AutoTP keys: nothing to go by
    result = cli("merge", root, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"{RANK0}: saved with AutoTP (tensor_parallel.autotp_size), but "
                          "without the universal_checkpoint_info AutoTP writes (an older DeepSpeed): these files do not "
                          "record how each tensor is split; convert the checkpoint with DeepSpeed's ds_to_universal")


def test_more_ranks_than_recorded_are_refused(cli, tmp_path):
    root = _autotp_step(tmp_path / "ckpt", _uc())
    shutil.copy(root / STEP / "mp_rank_01_model_states.pt", root / STEP / "mp_rank_02_model_states.pt")
    result = cli("merge", root, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"'{STEP}/mp_rank_02_model_states.pt': tensor-parallel rank 2, "
                          f"but {RANK0} records 2 ranks (checkpoint_parallel_dimensions.tp_degree). Is it a mix of "
                          "two checkpoints?")


def test_replicated_shards_that_differ_in_shape_are_refused(cli, tmp_path):
    uc = _uc(maps=False, tp_replicated_parameter_patterns=["^rep$", "^col$"])
    root = _autotp_step(tmp_path / "ckpt", uc, names=("col", "rep"))
    result = cli("merge", root, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", "'col': recorded as whole on every tensor-parallel rank, but the "
                          "ranks hold [3, 3] in 'global_step2/mp_rank_00_model_states.pt', [2, 3] in "
                          "'global_step2/mp_rank_01_model_states.pt'")


def test_megatron_style_ranks_stay_refused_even_when_one_is_missing(cli, copy_fixture, tmp_path):
    # not AutoTP (no autotp_size, no AutoTP keys): the split is not recorded; a rank missing altogether is caught by
    # the recorded tp_degree, not taken for the whole model
    src = copy_fixture("deepspeed_zero2")
    _patch_pickle(src / STEP / "mp_rank_00_model_states.pt", b"tp_degree", b"K\x01", b"K\x02")
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "model-parallel ranks [0] (tensor parallelism, of 2 recorded): "
                          "these files do not record how each tensor is split")
    shutil.copy(src / STEP / "mp_rank_00_model_states.pt", src / STEP / "mp_rank_01_model_states.pt")
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "model-parallel ranks [0, 1] (tensor parallelism): these files "
                          "do not record how each tensor is split")
