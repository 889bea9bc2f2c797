"""DeepSpeed MoE checkpoints (deepspeed.moe.layer.MoE with expert parallelism; fixtures/make_deepspeed_moe.py): the
merge equals DeepSpeed's own fp32 master weights bit for bit, with every local expert renumbered to its global id,
loads as a Mixtral whose logits equal DeepSpeed's own forward, and every missing or inconsistent piece stops the
merge with a message naming the file. DeepSpeed itself is not needed: the fixtures are committed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, load_output, tree_digest
from safetensors.torch import load_file
from test_deepspeed import _patch_pickle, _write
from transformers import AutoModelForCausalLM

import ckpttool
from ckpttool.families.conventions import deepspeed_moe

CASES = ("zero2_ep2", "zero2_w4_ep2", "zero1_w4_ep2_de", "bf16_zero2_ep2", "bf16_zero1_ep2")
FP32 = ("zero2_ep2", "zero2_w4_ep2", "zero1_w4_ep2_de")
STEP = "global_step2"
EXPERT = "model.layers.{layer}.block_sparse_moe.deepspeed_moe.experts.deepspeed_experts.{expert}.{param}.weight"
ADAPTER = "mixtral (DeepSpeed MoE convention)"


def fixture(case: str) -> Path:
    path = FIXTURES / f"deepspeed_moe_{case}"
    assert (path / "checkpoint").is_dir(), f"fixture {path.name} missing: run fixtures/make_deepspeed_moe.py"
    return path


@pytest.fixture(scope="module", params=CASES)
def merged(request, tmp_path_factory) -> tuple[str, Path]:
    case = request.param
    out = tmp_path_factory.mktemp(case) / "hf"
    before = tree_digest(fixture(case))
    result = ckpttool.merge(fixture(case) / "checkpoint", out)
    assert result.format == "deepspeed-moe"
    assert tree_digest(fixture(case)) == before, "the source was modified"
    return case, out


def test_merge_equals_deepspeeds_gathered_fp32_master_weights_bit_for_bit(merged):
    # the reference is DeepSpeed's own: safe_get_full_fp32_param on every rank, experts renamed ep_rank * 2 + j,
    # gathered over the ranks (fixtures/make_deepspeed_moe.py)
    case, out = merged
    got, want = load_output(out), load_output(fixture(case) / "reference")
    assert sorted(got) == sorted(want) and len(want) == 41  # 17 dense, 4 experts x 3 x 2 layers
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(got[name], tensor), f"{case}: {name} differs"


def test_merged_model_loads_as_mixtral_with_the_references_logits(merged):
    # reference/ is an HF Mixtral holding DeepSpeed's gathered weights: equal logits prove every tensor of the merge
    # reached its module in transformers (no key missing, unexpected or reshaped on load), as the weights say
    case, out = merged
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = AutoModelForCausalLM.from_pretrained(fixture(case) / "reference").eval()
    ids = load_file(fixture("zero2_ep2") / "deepspeed_logits.safetensors")["input_ids"]
    with torch.no_grad():
        assert torch.equal(ours(ids).logits, reference(ids).logits)  # tolerance: none


@pytest.mark.parametrize("case", FP32)
def test_merged_mixtral_reproduces_deepspeeds_own_forward(case, tmp_path):
    # DeepSpeed's forward after the save (its TopKGate top-2, no noise, no token dropping; the all-to-all of the EP
    # group) against transformers' Mixtral forward on the merge: the same routing math, in another order of float
    # operations, so equal to rounding; the negative control below shows a misnumbering is far outside it
    ckpttool.merge(fixture(case) / "checkpoint", tmp_path / "hf")
    probe = load_file(fixture(case) / "deepspeed_logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    with torch.no_grad():
        logits = model(probe["input_ids"]).logits
    assert (logits - probe["logits"]).abs().max().item() < 1e-6  # 1.8e-7 at most on these fixtures


def test_negative_control_a_wrong_expert_numbering_changes_the_logits(tmp_path):
    # local j on EP rank e numbered j * ep_size + e (the other plausible rule) swaps experts 1 and 2 of each layer
    ckpttool.merge(fixture("zero2_ep2") / "checkpoint", tmp_path / "hf")
    weights = load_output(tmp_path / "hf")
    for layer in (0, 1):
        for param in ("w1", "w2", "w3"):
            one, two = (f"model.layers.{layer}.block_sparse_moe.experts.{e}.{param}.weight" for e in (1, 2))
            weights[one], weights[two] = weights[two], weights[one]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    model.load_state_dict(_in_memory(weights), strict=True)
    probe = load_file(fixture("zero2_ep2") / "deepspeed_logits.safetensors")
    with torch.no_grad():
        assert (model(probe["input_ids"]).logits - probe["logits"]).abs().max().item() > 1e-3


def _in_memory(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Mixtral's on-disk tensors stacked as transformers 5 holds them ([w1; w3] per expert, w2 per expert)."""
    out = {k.replace(".block_sparse_moe.gate.", ".mlp.gate."): v for k, v in weights.items() if ".experts." not in k}
    for layer in (0, 1):
        p = f"model.layers.{layer}.block_sparse_moe.experts"
        out[f"model.layers.{layer}.mlp.experts.gate_up_proj"] = torch.stack(
            [torch.cat([weights[f"{p}.{e}.w1.weight"], weights[f"{p}.{e}.w3.weight"]]) for e in range(4)])
        out[f"model.layers.{layer}.mlp.experts.down_proj"] = torch.stack([weights[f"{p}.{e}.w2.weight"] for e in range(4)])
    return out


@pytest.mark.parametrize(("case", "ranks"), [
    # E + D (default): EP groups of consecutive ranks, EP rank = rank % 2: EP rank 1 is ranks 1 (expert-DP 0), 3
    ("zero2_w4_ep2", {(0, 0): 0, (0, 2): 1, (1, 0): 2, (1, 2): 3}),
    # D + E (use_data_before_expert_parallelism): expert-DP groups of consecutive ranks, EP rank = rank // 2
    ("zero1_w4_ep2_de", {(0, 0): 0, (0, 2): 2, (1, 0): 1, (1, 2): 3}),
])
def test_each_ep_ranks_experts_come_from_its_expert_data_parallel_ranks(case, ranks):
    # the expert group's own partition count is 2 (of 4 ranks): layer 0's experts lie in expert-DP rank 0's half of
    # the group's flat buffer, layer 1's in rank 1's
    layout = ckpttool.read_layout(fixture(case) / "checkpoint")
    assert layout.format == "deepspeed-moe" and layout.parallel == {"tp": 1, "pp": 1, "dp": 4, "ep": 2}
    for (layer, expert), rank in ranks.items():
        for e in (expert, expert + 1):
            (piece,) = layout.tensors[EXPERT.format(layer=layer, expert=e, param="w2")].pieces
            assert piece.file == f"{STEP}/zero_pp_rank_{rank}_mp_rank_00_optim_states.pt", (layer, e)


def test_the_layout_keeps_deepspeeds_names_with_global_expert_ids():
    layout = ckpttool.read_layout(fixture("zero2_ep2") / "checkpoint")
    experts = sorted(n for n in layout.tensors if ".deepspeed_experts." in n)
    assert len(experts) == 24 and EXPERT.format(layer=1, expert=3, param="w3") in experts
    assert "model.layers.0.block_sparse_moe.deepspeed_moe.gate.wg.weight" in layout.tensors
    # expert 3 is EP rank 1's local expert 1: rank 1's file, after its local expert 0
    piece = layout.tensors[EXPERT.format(layer=0, expert=3, param="w1")].pieces[0]
    assert piece.file == f"{STEP}/zero_pp_rank_1_mp_rank_00_optim_states.pt"


def test_weights_module_reads_the_per_expert_files(tmp_path):
    ckpttool.merge(fixture("bf16_zero2_ep2") / "checkpoint", tmp_path / "hf", weights="module")
    got, want = load_output(tmp_path / "hf"), load_file(fixture("bf16_zero2_ep2") / "module.safetensors")
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)
    layout = ckpttool.read_layout(fixture("bf16_zero2_ep2") / "checkpoint", weights="module")
    files = {p.file for t in layout.tensors.values() for p in t.pieces}
    assert files == {f"{STEP}/mp_rank_00_model_states.pt"} | {
        f"{STEP}/layer_{layer}_expert_{e}_mp_rank_00_model_states.pt" for layer in (0, 1) for e in range(4)}


def test_dry_run_and_audit_show_the_adapter_and_the_renames(cli, tmp_path):
    src = fixture("zero2_ep2") / "checkpoint"
    dry = cli("merge", src, tmp_path / "hf", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "(deepspeed-moe)" in dry.stdout and "parallel: tp=1 pp=1 dp=2 ep=2" in dry.stdout
    assert f"family:   {ADAPTER}" in dry.stdout
    assert ("model.layers.1.block_sparse_moe.experts.3.w2.weight  F32 [32x48]  <- "
            "model.layers.1.block_sparse_moe.deepspeed_moe.experts.deepspeed_experts.3.w2.weight (1 piece)") in dry.stdout
    assert ("model.layers.0.block_sparse_moe.gate.weight  F32 [4x32]  <- "
            "model.layers.0.block_sparse_moe.deepspeed_moe.gate.wg.weight (1 piece)") in dry.stdout
    assert "'.deepspeed_moe.gate.wg.weight' -> '.gate.weight' (26 tensors)" in dry.stdout
    assert json.loads(cli("merge", src, "--dry-run", "--json").stdout)["adapter"] == ADAPTER
    assert json.loads(cli("audit", src, "--no-data", "--json").stdout)["summary"]["adapter"] == ADAPTER
    assert f"family: {ADAPTER}" in cli("audit", src, "--no-data").stdout


def test_deepspeeds_own_zero_to_fp32_does_not_read_moe_checkpoints():
    # recorded by the producer: why a reader of its own is needed
    for case in CASES:
        said = json.loads((fixture(case) / "producer.json").read_text())["zero_to_fp32"]
        assert said.startswith("refuses: ValueError") and "layer_0_expert_0" in said


# ---- missing and inconsistent pieces, on copies of the real fixtures


@pytest.mark.parametrize(("case", "gone", "regions"), [
    # world 2, EP 2: rank 1 held the dense buffer's second half and all of EP rank 1's experts (2 and 3)
    ("zero2_ep2", 1, ["'model.layers.0.block_sparse_moe.experts.2.w1.weight': the whole tensor covered by no piece",
                      "'model.layers.1.block_sparse_moe.experts.3.w3.weight': the whole tensor covered by no piece",
                      "'lm_head.weight': the whole tensor covered by no piece"]),
    # world 4, EP 2, expert DP 2: rank 3 held EP rank 1's second half of the expert buffer (layer 1's experts)
    ("zero2_w4_ep2", 3, ["'model.layers.1.block_sparse_moe.experts.2.w1.weight': the whole tensor covered by no piece",
                         "'lm_head.weight': rows 75..251 covered by no piece"]),
])
def test_a_missing_rank_file_is_named_with_the_experts_it_held(case, gone, regions, cli, copy_fixture, tmp_path):
    src = copy_fixture(f"deepspeed_moe_{case}")
    name = f"{STEP}/zero_pp_rank_{gone}_mp_rank_00_optim_states.pt"
    (src / name).unlink()
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"'{name}', which is missing", *regions)
    assert "experts.0." not in result.stderr  # EP rank 0's experts are whole


@pytest.mark.parametrize("weights", ["master", "module"])
def test_a_missing_expert_file_is_named(weights, cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_moe_zero2_ep2")
    (src / STEP / "layer_1_expert_3_mp_rank_00_model_states.pt").unlink()
    result = cli("merge", src, tmp_path / "hf", "--weights", weights)
    assert_failed_cleanly(result, tmp_path / "hf", "1 per-expert file missing",
                          f"'{STEP}/layer_1_expert_3_mp_rank_00_model_states.pt' (expert 3 of the 4 of MoE layer 1, "
                          "'model.layers.1.block_sparse_moe')", "is the checkpoint complete?")


def test_no_expert_files_at_all_is_named_by_the_partition_counts(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_moe_zero2_ep2")
    for f in (src / STEP).glob("layer_*_expert_*"):
        f.unlink()
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "partition_count [2, 1] differs between param groups",
                          "a DeepSpeed MoE checkpoint", "no per-expert files")


def test_an_expert_file_holding_another_expert_is_refused(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_moe_zero2_ep2")
    one, two = (src / STEP / f"layer_0_expert_{e}_mp_rank_00_model_states.pt" for e in (1, 2))
    one.rename(tmp_path / "x")
    two.rename(one)
    (tmp_path / "x").rename(two)
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"'{STEP}/layer_0_expert_1_mp_rank_00_model_states.pt'",
                          "deepspeed_experts.2.w1.weight' is not a tensor of expert 1")


@pytest.mark.parametrize(("name", "needle"), [
    ("layer_1_expert_4_mp_rank_00_model_states.pt", "an expert file beyond the experts"),
    ("layer_2_expert_0_mp_rank_00_model_states.pt", "num_experts [4, 4]: 2 MoE layers"),
    ("layer_0_expert_0_mp_rank_01_model_states.pt", "expert files of model-parallel rank 1"),
    ("layer_03-model_states.pt", "a DeepSpeed MoE checkpoint with pipeline layer files"),
])
def test_a_stray_file_beside_the_experts_is_refused(name, needle, cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_moe_zero2_ep2")
    shutil.copy(src / STEP / "layer_0_expert_0_mp_rank_00_model_states.pt", src / STEP / name)
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", needle)


def test_a_group_name_contradicting_the_partition_counts_is_refused(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_moe_zero2_ep2")
    _patch_pickle(src / STEP / "zero_pp_rank_0_mp_rank_00_optim_states.pt", b"ep_size_2", b"ep_size_2", b"ep_size_4")
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "param group 1 is named 'ep_size_4'",
                          "partition_count [2, 1] gives an expert-parallel size of 2 / 1 = 2")


def test_optimizer_files_disagreeing_on_partition_count_are_refused(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_moe_zero2_ep2")
    # partition_count [2, 1]: BININT1 2 then BININT1 1 after the key
    _patch_pickle(src / STEP / "zero_pp_rank_1_mp_rank_00_optim_states.pt", b"partition_count", b"K\x01", b"K\x02")
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "disagree on partition_count",
                          f"[2, 1] in '{STEP}/zero_pp_rank_0_mp_rank_00_optim_states.pt'",
                          f"[2, 2] in '{STEP}/zero_pp_rank_1_mp_rank_00_optim_states.pt'")


def test_no_optimizer_files_means_no_master_weights(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_moe_zero2_ep2")
    for f in (src / STEP).glob("*_optim_states.pt"):
        f.unlink()
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "no *_optim_states.pt files", "--weights module")
    assert cli("merge", src, tmp_path / "hf", "--weights", "module", "-q").exit_code == 0


# ---- the rules on a small hand-made checkpoint with DeepSpeed's keys: 2 ranks, EP 2, one MoE module with one local
# expert per rank; every error path the real fixtures cannot reach without editing a pickle

MOE = "moe.deepspeed_moe"
LOCAL = f"{MOE}.experts.deepspeed_experts.0.w"


def _expert(ep_rank: int) -> torch.Tensor:
    return (100 * (ep_rank + 1) + torch.arange(6, dtype=torch.float32)).reshape(2, 3)


def _files() -> dict[str, object]:
    dense = torch.arange(10, dtype=torch.float32)  # embed.weight (3, 2), then the router (2, 2)
    states = {
        "module": {"embed.weight": dense[:6].reshape(3, 2), f"{MOE}.gate.wg.weight": dense[6:].reshape(2, 2)},
        "param_shapes": [{"embed.weight": torch.Size([3, 2]), f"{MOE}.gate.wg.weight": torch.Size([2, 2])},
                         {LOCAL: torch.Size([2, 3])}],
        "buffer_names": [], "num_experts": [2], "ds_config": {}, "ds_version": "0.19.8",
    }
    files: dict[str, object] = {"mp_rank_00_model_states.pt": states}
    for e in (0, 1):
        files[f"layer_0_expert_{e}_mp_rank_00_model_states.pt"] = {
            f"{MOE}.experts.deepspeed_experts.{e}.w": _expert(e)}
    for rank in (0, 1):
        files[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = {"optimizer_state_dict": {
            "zero_stage": 2, "partition_count": [2, 1], "group_paddings": [0, 0],
            "single_partition_of_fp32_groups": [dense[5 * rank:5 * rank + 5].clone(), _expert(rank).flatten()],
            "base_optimizer_state": {"param_groups": [{"name": "parameters"}, {"name": "ep_size_2", "moe": True}]},
        }}
    return files


def test_hand_made_checkpoint_merges_with_global_expert_ids(tmp_path):
    root = _write(tmp_path / "ckpt", _files())
    ckpttool.merge(root, tmp_path / "out", audit=False, raw_names=True)
    got = load_output(tmp_path / "out")  # no config: DeepSpeed's names, as the reader reports them
    assert sorted(got) == ["embed.weight", f"{MOE}.experts.deepspeed_experts.0.w",
                           f"{MOE}.experts.deepspeed_experts.1.w", f"{MOE}.gate.wg.weight"]
    assert torch.equal(got[f"{MOE}.experts.deepspeed_experts.1.w"], _expert(1))
    assert torch.equal(got["embed.weight"], torch.arange(6.0).reshape(3, 2))


def test_the_convention_drops_deepspeeds_wrappers_and_keeps_every_other_name(tmp_path):
    layout = ckpttool.read_layout(_write(tmp_path / "ckpt", _files()))
    specs, notes, problems = deepspeed_moe.to_hf(layout, None)  # the names, whatever the family
    assert sorted(s.name for s in specs) == ["embed.weight", "moe.experts.0.w", "moe.experts.1.w", "moe.gate.weight"]
    assert problems == [] and notes[0].endswith("(3 tensors)")


def test_an_experts_buffer_comes_from_its_expert_file(tmp_path):
    files = _files()
    for e in (0, 1):  # a buffer of every expert: in the expert files only, no optimizer state
        files[f"layer_0_expert_{e}_mp_rank_00_model_states.pt"][f"{MOE}.experts.deepspeed_experts.{e}.buf"] = (
            torch.full((2,), float(e)))
    layout = ckpttool.read_layout(_write(tmp_path / "ckpt", files))
    (piece,) = layout.tensors[f"{MOE}.experts.deepspeed_experts.1.buf"].pieces
    assert piece.file == f"{STEP}/layer_0_expert_1_mp_rank_00_model_states.pt"
    assert "2 expert tensors without optimizer state taken from the per-expert files" in layout.notes


def _osd(files: dict, rank: int) -> dict:
    return files[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"]["optimizer_state_dict"]


def _set_all(key: str, value: object):
    return lambda f: [_osd(f, r).__setitem__(key, value) for r in (0, 1)]


@pytest.mark.parametrize(("edit", "needles"), [
    (lambda f: f["mp_rank_00_model_states.pt"]["param_shapes"][1].__setitem__("other.weight", torch.Size([1])),
     ["param group 1 mixes expert and other parameters"]),
    (lambda f: [_osd(f, r)["base_optimizer_state"]["param_groups"][1].pop("moe") for r in (0, 1)],
     ["param group 1 is not marked moe, but its parameters", "are experts"]),
    (lambda f: f["mp_rank_00_model_states.pt"]["param_shapes"].__setitem__(
        1, {f"{MOE}.experts.deepspeed_experts.1.w": torch.Size([2, 3])}),
     ["the local experts of 'moe' are [1]; expected 0..0"]),
    (_set_all("partition_count", [2]), ["partition_count [2] for 2 param groups"]),
    (_set_all("partition_count", [1, 1]), ["partition_count is [1, 1]", "a data-parallel size of 1",
                                           "is rank 1. Is it a mix of two checkpoints?"]),
    (_set_all("partition_count", [1, 2]), ["partition_count [1, 2]: param group 0, which holds no experts, is partitioned over 1 ranks"]),
    (_set_all("partition_count", [2, 2]), ["param group 1 is named 'ep_size_2'",
                                           "partition_count [2, 2] gives an expert-parallel size of 2 / 2 = 1"]),
    (_set_all("partition_count", [3, 2]), ["the expert group 1's 2 does not divide the data-parallel size 3"]),
    (_set_all("zero_stage", 3), ["zero_stage 3", "ZeRO-1/2 or BF16_Optimizer partitions"]),
    (lambda f: _osd(f, 1).__setitem__("single_partition_of_fp32_groups", [torch.zeros(5)]),
     ["zero_pp_rank_1_mp_rank_00_optim_states.pt'", "do not hold the 2 param groups"]),
    (lambda f: _osd(f, 1)["single_partition_of_fp32_groups"].__setitem__(1, torch.zeros(6, dtype=torch.float16)),
     ["single_partition_of_fp32_groups[1] is not a flat fp32 tensor"]),
    (lambda f: f.__setitem__("bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt",
                             f.pop("zero_pp_rank_1_mp_rank_00_optim_states.pt")),
     ["optimizer files of different kinds (fp32, bf16_)"]),
    (lambda f: f["mp_rank_00_model_states.pt"].__setitem__("frozen_param_shapes", {LOCAL: torch.Size([2, 3])}),
     ["frozen expert parameters", "use --weights module"]),
    (lambda f: f.__setitem__("layer_0_expert_1_mp_rank_00_model_states.pt",
                             {f"{MOE}.experts.deepspeed_experts.1.v": _expert(1)}),
     ["renumbered to global ids, are not all in the per-expert files",
      "'moe.deepspeed_moe.experts.deepspeed_experts.1.w'"]),
    (lambda f: f.__setitem__("layer_0_expert_1_mp_rank_00_model_states.pt", [1, 2]),
     ["layer_0_expert_1_mp_rank_00_model_states.pt': not a DeepSpeed expert state dict"]),
    (lambda f: f.__setitem__("layer_0_expert_1_mp_rank_00_model_states.pt",
                             {"other.deepspeed_moe.experts.deepspeed_experts.1.w": _expert(1)}),
     ["'other.deepspeed_moe.experts.deepspeed_experts.1.w' belongs to 'other', the layer's other experts to 'moe'"]),
    (lambda f: f.__setitem__("zero_pp_rank_0_mp_rank_00_model_states.pt", {}),
     ["a DeepSpeed MoE checkpoint with ZeRO-3 model states"]),
    (lambda f: (f["mp_rank_00_model_states.pt"].__setitem__("num_experts", [3]),
                f.__setitem__("layer_0_expert_2_mp_rank_00_model_states.pt",
                              {f"{MOE}.experts.deepspeed_experts.2.w": _expert(2)})),
     ["expert 2 of 'moe' has a per-expert file but no fp32 master weights in any optimizer file",
      "the optimizer holds 2 experts, the files 3"]),
])
def test_hand_made_checkpoint_inconsistencies_are_refused(edit, needles, cli, tmp_path):
    files = _files()
    edit(files)
    root = _write(tmp_path / "ckpt", files)
    result = cli("merge", root, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", *needles)
