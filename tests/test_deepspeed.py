"""The DeepSpeed reader: real DeepSpeed checkpoints (fixtures/make_deepspeed.py) merge to exactly the engine's
gathered fp32 master weights, load in transformers with equal logits, and every inconsistency stops the merge
with a message naming the file. DeepSpeed itself is not needed: the fixtures are committed."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, load_output, tree_digest
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import ckpttool
from ckpttool.readers.deepspeed import reader

CASES = ("zero2", "zero3", "bf16_zero1", "bf16_zero2", "pipe", "universal")
INPUT_IDS = torch.tensor([[1, 5, 17, 999, 1000, 42, 7, 3], [2, 640, 501, 500, 250, 251, 0, 9]])
STEP = "global_step2"


def fixture(case: str) -> Path:
    path = FIXTURES / f"deepspeed_{case}"
    assert (path / "checkpoint").is_dir(), f"fixture {path.name} missing: run fixtures/make_deepspeed.py"
    return path


@pytest.fixture(scope="module", params=CASES)
def merged(request, tmp_path_factory) -> tuple[str, Path]:
    case = request.param
    out = tmp_path_factory.mktemp(case) / "hf"
    before = tree_digest(fixture(case))
    result = ckpttool.merge(fixture(case) / "checkpoint", out)
    assert result.format == "deepspeed"
    assert tree_digest(fixture(case)) == before, "the source was modified"
    return case, out


def test_merge_equals_the_engines_gathered_fp32_weights_bit_for_bit(merged):
    case, out = merged
    got = load_output(out)
    want = load_output(fixture(case) / "reference")
    assert sorted(got) == sorted(want) and len(want) == 21
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype == torch.float32, name
        assert torch.equal(got[name], tensor), f"{case}: {name} differs"


def test_merged_model_gives_the_references_logits(merged):
    case, out = merged
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = AutoModelForCausalLM.from_pretrained(fixture(case) / "reference").eval()
    with torch.no_grad():
        assert torch.equal(ours(INPUT_IDS).logits, reference(INPUT_IDS).logits)  # tolerance: none, bit-equal


def test_training_moved_the_master_weights_away_from_the_module_weights_under_bf16():
    # what makes the master/module choice matter: bf16 modules hold rounded copies
    master = load_output(fixture("bf16_zero1") / "reference")
    module = load_file(fixture("bf16_zero1") / "module.safetensors")
    assert module["lm_head.weight"].dtype == torch.bfloat16
    assert not torch.equal(module["lm_head.weight"].float(), master["lm_head.weight"])


def test_a_straddling_parameter_is_cut_into_boxes_from_both_ranks():
    layout = ckpttool.read_layout(fixture("zero2") / "checkpoint")
    q = layout.tensors["model.layers.1.self_attn.q_proj.weight"]
    assert {dict(p.tags)["dp_rank"] for p in q.pieces} == {0, 1}
    assert sum(p.box.numel for p in q.pieces) == 32 * 32
    assert layout.parallel == {"tp": 1, "pp": 1, "dp": 2}


def test_zero3_every_parameter_is_split_over_both_ranks():
    layout = ckpttool.read_layout(fixture("zero3") / "checkpoint")
    embed = layout.tensors["model.embed_tokens.weight"]
    # 1001 x 32 = 32032 elements, 16016 per rank: rank 0 has rows 0..500 and half of row 500, rank 1 the rest
    per_rank = {r: sum(p.box.numel for p in embed.pieces if dict(p.tags)["dp_rank"] == r) for r in (0, 1)}
    assert per_rank == {0: 16016, 1: 16016}
    assert {p.file for p in embed.pieces} == {f"{STEP}/zero_pp_rank_0_mp_rank_00_optim_states.pt",
                                              f"{STEP}/zero_pp_rank_1_mp_rank_00_optim_states.pt"}
    assert sorted((p.box.offsets, p.box.sizes) for p in embed.pieces) == [
        ((0, 0), (500, 32)), ((500, 0), (1, 16)), ((500, 16), (1, 16)), ((501, 0), (500, 32))]


@pytest.mark.parametrize("case", ["zero2", "bf16_zero1"])
def test_the_global_step_directory_is_a_source_too(case, tmp_path):
    ckpttool.merge(fixture(case) / "checkpoint" / STEP, tmp_path / "hf")  # config.json one level up
    want = load_output(fixture(case) / "reference")
    got = load_output(tmp_path / "hf")
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_weights_module_fp32_zero2_is_the_module_state_dict(cli, tmp_path):
    result = cli("merge", fixture("zero2") / "checkpoint", tmp_path / "hf", "--weights", "module", "-q")
    assert result.exit_code == 0, result.output
    # the producer checked that the fp32 module equals the master weights (producer.json), so the reference
    assert "equal" in json.loads((fixture("zero2") / "producer.json").read_text())["module_weights"]
    got, want = load_output(tmp_path / "hf"), load_output(fixture("zero2") / "reference")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    layout = ckpttool.read_layout(fixture("zero2") / "checkpoint", weights="module")
    assert {p.file for t in layout.tensors.values() for p in t.pieces} == {f"{STEP}/mp_rank_00_model_states.pt"}


@pytest.mark.parametrize("case", ["bf16_zero1", "bf16_zero2"])
def test_weights_module_bf16_gives_the_modules_bf16_weights(case, tmp_path):
    ckpttool.merge(fixture(case) / "checkpoint", tmp_path / "hf", weights="module")
    got = load_output(tmp_path / "hf")
    want = load_file(fixture(case) / "module.safetensors")
    assert sorted(got) == sorted(want)
    assert all(got[k].dtype == torch.bfloat16 and torch.equal(got[k], want[k]) for k in want)


def test_weights_module_of_a_pipeline_reads_the_layer_files(tmp_path):
    layout = ckpttool.read_layout(fixture("pipe") / "checkpoint", weights="module")
    assert layout.tensors["model.norm.weight"].pieces[0].file == f"{STEP}/layer_03-model_states.pt"
    ckpttool.merge(fixture("pipe") / "checkpoint", tmp_path / "hf", weights="module")
    got, want = load_output(tmp_path / "hf"), load_output(fixture("pipe") / "reference")
    assert all(torch.equal(got[k], want[k]) for k in want)  # fp32 pipeline: the modules are the master weights


def test_weights_module_of_zero3_is_refused_with_the_reason(cli, tmp_path):
    result = cli("merge", fixture("zero3") / "checkpoint", tmp_path / "hf", "--weights", "module")
    assert_failed_cleanly(result, tmp_path / "hf", "zero_pp_rank_0_mp_rank_00_model_states.pt",
                          "placeholders", "use --weights master")


def test_dry_run_shows_format_parallel_layout_and_mapping(cli, tmp_path):
    result = cli("merge", fixture("pipe") / "checkpoint", tmp_path / "hf", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "(deepspeed)" in result.stdout
    assert "parallel: tp=1 pp=2 dp=1" in result.stdout
    assert "model.norm.weight  F32 [32]  <- model.norm.weight (1 piece)" in result.stdout
    assert not (tmp_path / "hf").exists()
    result = cli("merge", fixture("zero2") / "checkpoint", tmp_path / "hf", "--dry-run")
    assert "parallel: tp=1 pp=1 dp=2" in result.stdout
    assert "model.layers.1.self_attn.q_proj.weight  F32 [32x32]  <- model.layers.1.self_attn.q_proj.weight (3 pieces)" in result.stdout


@pytest.mark.parametrize(("case", "region"), [
    ("zero2", "'model.norm.weight': the whole tensor covered by no piece"),  # rank 1 held the end of the buffer
    ("zero2", "'model.layers.1.self_attn.q_proj.weight': rows 1..32 covered by no piece"),  # straddles the ranks
    ("zero3", "'lm_head.weight': rows 500..501 x columns 16..32 covered by no piece"),  # ZeRO-3: half of each
    ("zero3", "'lm_head.weight': rows 501..1001 covered by no piece"),
    ("bf16_zero1", "'model.norm.weight': the whole tensor covered by no piece"),
])
def test_missing_rank_file_names_it_and_the_region_it_held(case, region, cli, copy_fixture, tmp_path):
    src = copy_fixture(f"deepspeed_{case}")
    prefix = "bf16_" if case.startswith("bf16") else ""
    gone = f"{STEP}/{prefix}zero_pp_rank_1_mp_rank_00_optim_states.pt"
    (src / gone).unlink()
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"'{gone}', which is missing", region)


def test_an_extra_rank_file_contradicts_the_partition_count(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_zero2")
    shutil.copy(src / STEP / "zero_pp_rank_1_mp_rank_00_optim_states.pt", src / STEP / "zero_pp_rank_2_mp_rank_00_optim_states.pt")
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "partition_count is 2", "3 optimizer files were found",
                          "zero_pp_rank_2_mp_rank_00_optim_states.pt")


def test_rank_files_disagreeing_on_the_partition_count(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_zero2")
    # partition_count is [2]: the pickle's 'partition_count' key, then a list holding BININT1 2
    _patch_pickle(src / STEP / "zero_pp_rank_1_mp_rank_00_optim_states.pt", b"partition_count", b"K\x02", b"K\x03")
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "disagree on partition_count",
                          f"2 in '{STEP}/zero_pp_rank_0_mp_rank_00_optim_states.pt'",
                          f"3 in '{STEP}/zero_pp_rank_1_mp_rank_00_optim_states.pt'")


@pytest.mark.parametrize(("rows", "words", "numbers"), [
    (b"M\xe8\x03", "longer than the parameters", "need 82624 elements (with 0 alignment padding), the 2 'zero_pp_rank_*' files hold 82656"),
    (b"M\xea\x03", "short", "need 82688 elements (with 0 alignment padding), the 2 'zero_pp_rank_*' files hold 82656"),
])
def test_leftover_or_short_flat_buffer_zero2(rows, words, numbers, cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_zero2")
    # param_shapes says lm_head.weight is (1001, 32); make it 1000 (leftover) or 1002 rows (short)
    _patch_pickle(src / STEP / "mp_rank_00_model_states.pt", b"lm_head.weight", b"M\xe9\x03", rows, last=True)
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"the flat fp32 buffers are {words}", numbers)


def test_leftover_flat_buffer_bf16_optimizer_counts_the_recorded_padding(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_bf16_zero1")
    _patch_pickle(src / STEP / "mp_rank_00_model_states.pt", b"lm_head.weight", b"M\xe9\x03", b"M\xe8\x03", last=True)
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "longer than the parameters", "need 82624 elements",
                          "'bf16_zero_pp_rank_*' files hold 82656")


def test_short_flat_buffer_zero3(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_zero3")
    _patch_pickle(src / STEP / "zero_pp_rank_0_mp_rank_00_model_states.pt", b"lm_head.weight", b"M\xe9\x03", b"M\xed\x03", last=True)
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "the flat fp32 buffer is short", "need 41392 elements per rank",
                          "fp32_flat_groups hold 41328")


def test_a_class_outside_the_allow_list_is_refused_unread(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_zero2")
    _patch_pickle(src / STEP / "zero_pp_rank_0_mp_rank_00_optim_states.pt", b"deepspeed.runtime.fp16.loss_scaler",
                  b"loss_scaler", b"loss_scalex")
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "refused to unpickle", "deepspeed.runtime.fp16.loss_scalex.LossScaler")


def test_latest_names_the_checkpoint_and_a_bad_tag_is_an_error(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_zero2")
    assert reader.matches(src) and (src / "latest").read_text().strip() == STEP
    (src / "latest").write_text("global_step9")
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "latest' names the checkpoint 'global_step9'", "not a directory")


def test_the_universal_checkpoint_reads_only_fp32_files():
    layout = ckpttool.read_layout(fixture("universal") / "checkpoint")
    files = {p.file for t in layout.tensors.values() for p in t.pieces}
    assert files == {f"{STEP}_universal/zero/{name}/fp32.pt" for name in layout.tensors}


def test_missing_model_states_is_named(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_zero2")
    (src / STEP / "mp_rank_00_model_states.pt").unlink()
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"'{STEP}/mp_rank_00_model_states.pt': missing")


def _patch_pickle(path: Path, anchor: bytes, old: bytes, new: bytes, *, last: bool = False) -> None:
    """Replace the first ``old`` after ``anchor`` (its last occurrence when ``last``) in the archive's pickle,
    and write the archive again (stored entries, valid CRCs), as a damaged or edited checkpoint would be."""
    with zipfile.ZipFile(path) as archive:
        entries = [(info, archive.read(info)) for info in archive.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as archive:
        for info, data in entries:
            if info.filename.endswith("data.pkl"):
                at = data.rfind(anchor) if last else data.find(anchor)
                hit = data.index(old, at)
                assert at >= 0 and hit - at < 64, "the patch target moved"
                data = data[:hit] + new + data[hit + len(old):]
            archive.writestr(info.filename, data)


# ---- the layout rules on small hand-made checkpoints with DeepSpeed's keys: paddings the tiny Llama (82656
# elements, a multiple of every alignment) never needs, sub-groups, buffers, frozen and shared parameters

SHAPES = {"a": (3, 5), "b": (7,), "c": (2, 2)}
NAN = float("nan")


def _values() -> dict[str, torch.Tensor]:
    start, out = 0, {}
    for name, shape in SHAPES.items():
        n = torch.Size(shape).numel()
        out[name] = torch.arange(start, start + n, dtype=torch.float32).reshape(shape)
        start += n
    return out


def _model_states(extra: dict | None = None) -> dict:
    return {
        "module": {"a": torch.zeros(3, 5), "buf": torch.tensor([7.0, 8.0])},
        "buffer_names": ["buf"],
        "param_shapes": [{name: torch.Size(shape) for name, shape in SHAPES.items()}],
        "frozen_param_shapes": {"frozen": torch.Size([2])},
        "frozen_param_fragments": {"frozen": torch.tensor([5.0, 6.0])},
        "shared_params": {"tied": "a"},
        "ds_version": "0.19.8",
        **(extra or {}),
    }


def _write(root: Path, files: dict[str, dict]) -> Path:
    (root / STEP).mkdir(parents=True)
    (root / "latest").write_text(STEP)
    for name, obj in files.items():
        torch.save(obj, root / STEP / name)
    return root


def _merged(root: Path, tmp_path: Path) -> dict[str, torch.Tensor]:
    ckpttool.merge(root, tmp_path / "out", audit=False)
    return load_output(tmp_path / "out")


def test_zero2_alignment_paddings_and_stripped_group_padding(tmp_path):
    v = _values()
    # a (15) + 1 pad, b (7) + 1 pad, c (4): 28 elements, split 16 + 16 with 4 padding on rank 1, stripped on save
    flat = torch.cat([v["a"].flatten(), torch.tensor([NAN]), v["b"], torch.tensor([NAN]), v["c"].flatten()])
    optim = lambda part, pad: {"optimizer_state_dict": {
        "zero_stage": 2, "partition_count": [2], "single_partition_of_fp32_groups": [part],
        "group_paddings": [pad], "param_alignment_paddings": [[1, 1, 0]]}}
    root = _write(tmp_path / "ckpt", {
        "mp_rank_00_model_states.pt": _model_states(),
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": optim(flat[:16].clone(), 0),
        "zero_pp_rank_1_mp_rank_00_optim_states.pt": optim(flat[16:].clone(), 4),
    })
    got = _merged(root, tmp_path)
    assert sorted(got) == ["a", "b", "buf", "c", "frozen", "tied"]
    assert all(torch.equal(got[k], v[k]) for k in SHAPES)
    assert torch.equal(got["tied"], v["a"]) and torch.equal(got["buf"], torch.tensor([7.0, 8.0]))
    assert torch.equal(got["frozen"], torch.tensor([5.0, 6.0]))
    layout = ckpttool.read_layout(root)
    assert {n: {dict(p.tags)["dp_rank"] for p in layout.tensors[n].pieces} for n in SHAPES} == {
        "a": {0}, "b": {1}, "c": {1}}  # b starts at 16 (after a's 15 and 1 alignment element): rank 1


def test_bf16_optimizer_keeps_padding_on_the_last_rank(tmp_path):
    v = _values()
    # 26 elements back to back, aligned to 28: two slices of 14, saved whole; group_paddings 2 on the last rank
    flat = torch.cat([v["a"].flatten(), v["b"], v["c"].flatten(), torch.tensor([NAN, NAN])])
    optim = lambda part, pad: {"optimizer_state_dict": {
        "partition_count": [2], "single_partition_of_fp32_groups": [part], "group_paddings": [pad]}}
    root = _write(tmp_path / "ckpt", {
        "mp_rank_00_model_states.pt": _model_states(),
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": optim(flat[:14].clone(), 0),
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt": optim(flat[14:].clone(), 2),
    })
    got = _merged(root, tmp_path)
    assert all(torch.equal(got[k], v[k]) for k in SHAPES)
    a = ckpttool.read_layout(root).tensors["a"]  # elements 0..14 on rank 0, element 14 (row 2, column 4) on rank 1
    assert sorted((p.box.offsets, p.box.sizes, dict(p.tags)["dp_rank"]) for p in a.pieces) == [
        ((0, 0), (2, 5), 0), ((2, 0), (1, 4), 0), ((2, 4), (1, 1), 1)]


def test_bf16_optimizer_padding_that_does_not_add_up_is_an_error(tmp_path):
    v = _values()
    flat = torch.cat([v["a"].flatten(), v["b"], v["c"].flatten(), torch.tensor([NAN, NAN])])
    optim = lambda part, pad: {"optimizer_state_dict": {
        "partition_count": [2], "single_partition_of_fp32_groups": [part], "group_paddings": [pad]}}
    root = _write(tmp_path / "ckpt", {
        "mp_rank_00_model_states.pt": _model_states(),
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt": optim(flat[:14].clone(), 0),
        "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt": optim(flat[14:].clone(), 1),
    })
    with pytest.raises(ckpttool.SourceError, match="longer than the parameters: .* need 26 elements .* hold 27 after 1 padding"):
        ckpttool.read_layout(root)


def test_zero3_padded_partitions_across_sub_groups(tmp_path):
    v = _values()
    # per rank: a's share (8), b's (4), c's (2); rank 1's shares end with zero padding. Two flat sub-groups
    # per rank, cut inside b: a parameter may straddle them.
    def share(name: str, rank: int) -> torch.Tensor:
        flat = v[name].flatten()
        p = -(-flat.numel() // 2)
        return torch.cat([flat, torch.zeros(2 * p - flat.numel())])[rank * p:(rank + 1) * p]

    files = {}
    frozen = {0: torch.tensor([5.0, 6.0]), 1: torch.tensor([7.0, 0.0])}  # a frozen (3,): each rank's padded share
    for rank in (0, 1):
        buffer = torch.cat([share(n, rank) for n in SHAPES])
        states = _model_states({"module": {"a": torch.empty(0), "buf": torch.tensor([7.0, 8.0])},
                                "frozen_param_shapes": {"frozen": torch.Size([3])},
                                "frozen_param_fragments": {"frozen": frozen[rank]}})
        files[f"zero_pp_rank_{rank}_mp_rank_00_model_states.pt"] = states
        files[f"zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"] = {"optimizer_state_dict": {
            "zero_stage": 3, "partition_count": 2, "fp32_flat_groups": [buffer[:10].clone(), buffer[10:].clone()]}}
    root = _write(tmp_path / "ckpt", files)
    got = _merged(root, tmp_path)
    assert sorted(got) == ["a", "b", "buf", "c", "frozen", "tied"]
    assert all(torch.equal(got[k], v[k]) for k in SHAPES)
    assert torch.equal(got["tied"], v["a"]) and torch.equal(got["buf"], torch.tensor([7.0, 8.0]))
    assert torch.equal(got["frozen"], torch.tensor([5.0, 6.0, 7.0]))


def test_tensor_parallel_ranks_are_refused_with_the_way_out(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_zero2")
    shutil.copy(src / STEP / "mp_rank_00_model_states.pt", src / STEP / "mp_rank_01_model_states.pt")
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "model-parallel ranks [0, 1]", "ds_to_universal")


def test_no_optimizer_files_means_no_master_weights(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_zero2")
    for f in (src / STEP).glob("*_optim_states.pt"):
        f.unlink()
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "no *_optim_states.pt files", "--weights module")
    assert cli("merge", src, tmp_path / "hf", "--weights", "module", "-q").exit_code == 0


def test_several_checkpoints_without_latest_ask_which(cli, copy_fixture, tmp_path):
    src = copy_fixture("deepspeed_zero2")
    (src / "latest").unlink()
    shutil.copytree(src / STEP, src / "global_step1")
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", "2 checkpoints (global_step1, global_step2) and no 'latest' file")
    assert cli("merge", src / "global_step1", tmp_path / "hf", "-q").exit_code == 0
