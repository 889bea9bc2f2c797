"""What a new user tries first: ``--dtype`` choices, ``--dry-run`` without OUT, sizes in binary units, a
folder of checkpoints, DeepSpeed's universal form, the top-level help, and API errors that name API arguments."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, fixture_dir, load_output
from safetensors import safe_open
from safetensors.torch import save_file
from test_deepspeed import STEP, _model_states, _write

import ckpttool
from ckpttool.io.dtypes import cast_dtype
from ckpttool.commands.finish import config_dtype
from ckpttool.writers.hf import parse_size

LLAMA = fixture_dir("llama_tp2_dcp") / "checkpoint"
CHOICES = "'bfloat16', 'float16', 'float32', 'bf16', 'fp16', 'fp32'"


def dtypes_written(out: Path) -> dict[str, str]:
    with safe_open(out / "model.safetensors", "pt") as f:
        return {k: f.get_slice(k).get_dtype() for k in f.keys()}


# ------------------------------------------------------------------------------------------------- --dtype


def test_dtype_choices_are_shown_in_the_help(cli):
    result = cli("merge", "--help")
    assert result.exit_code == 0
    assert "--dtype [bfloat16|float16|float32|bf16|fp16|fp32]" in result.stdout


@pytest.mark.parametrize("dtype", ["int8", "fp8", "float8_e4m3fn", "float64", "bool"])
def test_a_dtype_that_would_destroy_the_weights_is_a_usage_error(cli, tmp_path, dtype):
    out = tmp_path / "hf"
    result = cli("merge", LLAMA, out, "--dtype", dtype)
    assert result.exit_code == 2, result.output
    assert f"Invalid value for '--dtype': '{dtype}' is not one of {CHOICES}." in result.stderr
    assert not out.exists()


@pytest.mark.parametrize(("given", "written", "config"), [("bf16", "BF16", "bfloat16"), ("FP16", "F16", "float16"),
                                                          ("float32", "F32", "float32")])
def test_a_dtype_alias_casts_and_the_config_names_it(cli, tmp_path, given, written, config):
    out = tmp_path / "hf"
    result = cli("merge", LLAMA, out, "--dtype", given, "-q")
    assert result.exit_code == 0, result.output
    assert set(dtypes_written(out).values()) == {written}
    assert json.loads((out / "config.json").read_text())["dtype"] == config


@pytest.mark.parametrize("dtype", ["int8", "fp8", "F8_E4M3", torch.int8, torch.float64])
def test_the_api_refuses_a_dtype_naming_the_argument(tmp_path, dtype):
    with pytest.raises(ckpttool.ArgumentError) as excinfo:
        ckpttool.merge(LLAMA, tmp_path / "hf", dtype=dtype)
    assert str(excinfo.value) == (
        f"dtype={dtype!r} is not a dtype ckpttool casts to: choose bfloat16, float16 or float32 (aliases bf16, fp16, "
        "fp32), or dtype=None to keep the source's dtypes; integer tensors are never cast")
    assert isinstance(excinfo.value, ValueError)
    assert not (tmp_path / "hf").exists()


def test_save_hf_refuses_a_dtype_before_any_collective(tmp_path):
    from ckpttool.live import save_hf

    with pytest.raises(ckpttool.ArgumentError, match=r"^dtype='int8' is not a dtype ckpttool casts to"):
        save_hf({"w": torch.ones(2)}, tmp_path / "hf", dtype="int8")
    assert not (tmp_path / "hf").exists()


def test_cast_dtype_spellings():
    assert [cast_dtype(v) for v in ("bfloat16", "BF16", "torch.float16", torch.float32, None)] == [
        "BF16", "BF16", "F16", "F32", None]


def test_integer_and_bool_tensors_are_never_cast(cli, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    save_file({"w": torch.ones(3, 2), "ids": torch.arange(4), "mask": torch.tensor([True, False]),
               "codes": torch.tensor([1, 2], dtype=torch.int8)}, str(src / "model.safetensors"))
    out = tmp_path / "hf"
    result = cli("merge", src, out, "--dtype", "bf16", "-q")
    assert result.exit_code == 0, result.output
    assert dtypes_written(out) == {"w": "BF16", "ids": "I64", "mask": "BOOL", "codes": "I8"}
    got = load_output(out)
    assert torch.equal(got["ids"], torch.arange(4)) and torch.equal(got["codes"], torch.tensor([1, 2], dtype=torch.int8))


def test_module_weights_of_a_bf16_deepspeed_checkpoint_get_a_bf16_config(cli, tmp_path):
    src = fixture_dir("deepspeed_bf16_zero2") / "checkpoint"
    assert json.loads((src / "config.json").read_text())["dtype"] == "float32"
    out = tmp_path / "hf"
    result = cli("merge", src, out, "--weights", "module", "-q")
    assert result.exit_code == 0, result.output
    assert set(dtypes_written(out).values()) == {"BF16"}
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    audited = cli("audit", out, "--json")
    assert audited.exit_code == 0 and "config-dtype" not in audited.stdout
    master = tmp_path / "master"
    assert cli("merge", src, master, "-q").exit_code == 0  # the fp32 master weights: the config already says so
    assert json.loads((master / "config.json").read_text())["dtype"] == "float32"


def test_config_dtype_follows_the_prevailing_floating_dtype_written():
    plan = ckpttool.plan_merge(ckpttool.read_layout(LLAMA), dtype="BF16")
    assert config_dtype({"torch_dtype": "float32"}, plan, cast=True) == "BF16"
    assert config_dtype({"dtype": "bfloat16"}, plan, cast=True) is None  # already right
    assert config_dtype({"dtype": "torch.float32"}, plan, cast=False) == "BF16"
    assert config_dtype({"dtype": "auto"}, plan, cast=False) is None
    assert config_dtype({}, plan, cast=False) is None and config_dtype({}, plan, cast=True) == "BF16"
    assert config_dtype(None, plan, cast=True) is None


# ------------------------------------------------------------------------------------------------ --dry-run


def test_dry_run_needs_no_out(cli):
    result = cli("merge", LLAMA, "--dry-run")
    assert result.exit_code == 0, result.output
    assert "output:   (none given) (would write 322.9 KiB in 1 file)" in result.stdout
    doc = json.loads(cli("merge", LLAMA, "--dry-run", "--json").stdout)
    assert doc["output"] is None and doc["dry_run"] is True and doc["tensors"] == 21


def test_out_is_required_without_dry_run(cli):
    result = cli("merge", LLAMA)
    assert result.exit_code == 2
    assert "Error: Missing argument 'OUT' (only --dry-run runs without one)." in result.stderr
    assert "Usage: main merge [OPTIONS] SRC [OUT]" in result.stderr


def test_the_api_needs_out_unless_dry_run():
    assert ckpttool.merge(LLAMA, dry_run=True).output is None
    with pytest.raises(ckpttool.ArgumentError, match=r"^out=None: give the destination directory \(only a dry run"):
        ckpttool.merge(LLAMA)


# ----------------------------------------------------------------------------------------- --max-shard-size


@pytest.mark.parametrize(("text", "size"), [("5GB", 5 * 10**9), ("5GiB", 5 * 2**30), ("500MiB", 500 * 2**20),
                                            ("500mb", 500 * 10**6), ("1.5 KiB", 1536), ("123", 123)])
def test_sizes_in_decimal_and_binary_units(text, size):
    assert parse_size(text) == size


def test_binary_max_shard_size_on_the_command_line(cli):
    decimal = json.loads(cli("merge", LLAMA, "--dry-run", "--json", "--max-shard-size", "200KB").stdout)
    binary = json.loads(cli("merge", LLAMA, "--dry-run", "--json", "--max-shard-size", "200KiB").stdout)
    assert max(f["bytes"] for f in decimal["files"]) <= 200_000
    assert max(f["bytes"] for f in binary["files"]) <= 204_800
    assert max(f["bytes"] for f in binary["files"]) > 200_000  # the binary limit is used as such


def test_a_bad_size_lists_the_units(cli, tmp_path):
    result = cli("merge", LLAMA, tmp_path / "hf", "--max-shard-size", "5XB")
    assert result.exit_code == 2
    assert ("Invalid value for '--max-shard-size': invalid size '5XB': give bytes, or a number with KB, MB, GB, TB "
            "(decimal) or KiB, MiB, GiB, TiB (binary), e.g. 5GB or 500MiB") in result.stderr
    with pytest.raises(ckpttool.ArgumentError, match=r"^max_shard_size='lots' is not a size: give bytes"):
        ckpttool.merge(LLAMA, tmp_path / "hf", max_shard_size="lots")
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------------- where checkpoints are


def test_a_folder_of_checkpoints_names_the_subfolders_that_work(cli):
    root = FIXTURES / "megatron_tp2_pp2"
    result = cli("merge", root, "--dry-run")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.startswith(
        f"Error: '{root}': no checkpoint here, but these subfolders hold one; give one of them as the source:\n")
    assert f"  - '{root / 'legacy'}' (megatron-legacy)\n" in result.stderr
    assert f"  - '{root / 'torch_dist'}' (megatron-dist)\n" in result.stderr
    assert cli("merge", root / "torch_dist", "--dry-run").exit_code == 0
    audit = cli("audit", root, "--no-data")
    assert audit.exit_code == 1 and f"'{root / 'legacy'}' (megatron-legacy)" in audit.stderr


def test_two_deepspeed_steps_without_latest_are_named(cli, tmp_path):
    src = tmp_path / "ds"
    shutil.copytree(FIXTURES / "deepspeed_zero2" / "checkpoint", src)
    shutil.copytree(FIXTURES / "deepspeed_universal" / "checkpoint" / f"{STEP}_universal", src / f"{STEP}_universal")
    (src / "latest").unlink()
    result = cli("merge", src, "--dry-run")
    assert result.exit_code == 1
    assert f"2 checkpoints ({STEP}, {STEP}_universal) and no 'latest' file; give the directory" in result.stderr


def tensor_parallel_deepspeed(tmp_path: Path, tag_file: bool, of_the_step: bool = False) -> Path:
    src = tmp_path / "ds"
    shutil.copytree(FIXTURES / "deepspeed_zero2" / "checkpoint", src)
    shutil.copy(src / STEP / "mp_rank_00_model_states.pt", src / STEP / "mp_rank_01_model_states.pt")
    shutil.copytree(FIXTURES / "deepspeed_universal" / "checkpoint" / f"{STEP}_universal", src / f"{STEP}_universal")
    if of_the_step:  # ds_to_universal copies every model states file of the step it converts
        shutil.copy(src / STEP / "mp_rank_01_model_states.pt", src / f"{STEP}_universal")
    if tag_file:
        (src / "latest_universal").write_text(f"{STEP}_universal")
    return src


@pytest.mark.parametrize("tag_file", [True, False])
def test_a_tensor_parallel_step_is_merged_from_its_universal_checkpoint(cli, tmp_path, tag_file):
    src = tensor_parallel_deepspeed(tmp_path, tag_file, of_the_step=True)
    universal = src / f"{STEP}_universal"
    for source in (src, src / STEP):
        result = cli("merge", source, "--dry-run")
        assert result.exit_code == 0, result.output
        assert f"read the universal checkpoint '{universal}' (ds_to_universal's output of '{STEP}'" in result.stdout


def test_a_tensor_parallel_step_names_the_universal_checkpoint_beside_it(cli, tmp_path):
    src = tensor_parallel_deepspeed(tmp_path, tag_file=False)  # its model states are not all the step's
    universal = src / f"{STEP}_universal"
    for source in (src, src / STEP):
        result = cli("merge", source, tmp_path / "hf")
        assert result.exit_code == 1 and "Traceback" not in result.output
        assert ("': model-parallel ranks [0, 1] (tensor parallelism): these files do not record how each "
                "tensor is split; beside it, universal checkpoints (ds_to_universal's output) not known to be of this "
                f"step: '{universal}' (converted from another step: its model states differ from this step's); merge "
                "the one of this step, or convert the step again") in result.stderr
    assert cli("merge", universal, "--dry-run").exit_code == 0  # the advice works


def test_an_moe_step_names_its_universal_checkpoint(cli, tmp_path):
    optim = {"optimizer_state_dict": {"zero_stage": 2, "partition_count": [2, 1],
                                      "single_partition_of_fp32_groups": [torch.zeros(4)], "group_paddings": [0]}}
    src = _write(tmp_path / "ds", {"mp_rank_00_model_states.pt": _model_states(),
                                   "zero_pp_rank_0_mp_rank_00_optim_states.pt": optim,
                                   "zero_pp_rank_1_mp_rank_00_optim_states.pt": optim})
    shutil.copytree(FIXTURES / "deepspeed_universal" / "checkpoint" / f"{STEP}_universal", src / f"{STEP}_universal")
    result = cli("merge", src, tmp_path / "hf")
    assert result.exit_code == 1
    assert "partition_count [2, 1] differs between param groups" in result.stderr
    assert ("; beside it, universal checkpoints (ds_to_universal's output) not known to be of this step: "
            f"'{src / (STEP + '_universal')}' (converted from another step: its model states differ from this "
            "step's)") in result.stderr


# -------------------------------------------------------------------------------------------- help, naming


def test_top_level_help_shows_each_summary_uncut(cli):
    from ckpttool.cli import main

    result = cli("--help")
    assert result.exit_code == 0
    text = " ".join(result.stdout.split("Commands:")[1].split())
    assert "..." not in text
    for name, command in main.commands.items():
        summary = " ".join((command.help or "").split("\n\n")[0].split()).split(". ")[0]
        assert f"{name} {summary}" in text, (name, summary)


def test_api_errors_name_api_arguments_and_the_cli_its_flags(cli, tmp_path):
    with pytest.raises(ckpttool.SourceError) as excinfo:
        ckpttool.read_layout(LLAMA, weights="module")
    assert str(excinfo.value) == f"'{LLAMA}': weights='module' does not apply to the dcp format"
    zero3 = FIXTURES / "deepspeed_zero3" / "checkpoint"
    with pytest.raises(ckpttool.SourceError, match=r"use weights='master'$"):
        ckpttool.read_layout(zero3, weights="module")
    result = cli("merge", zero3, tmp_path / "hf", "--weights", "module")
    assert result.exit_code == 1 and result.stderr.rstrip().endswith("use --weights master")
    with pytest.raises(ckpttool.FormatNotDetectedError, match=r"Pass format='NAME' to name one\.$"):
        ckpttool.read_layout(tmp_path)


def test_an_audit_error_from_the_api_names_audit_false(tmp_path):
    from test_audit import reference, write_hf

    tensors, config = reference("llama_fsdp2_dcp")
    tensors["model.norm.weight"] = tensors["model.norm.weight"].to(torch.bfloat16)
    src = write_hf(tmp_path / "src", tensors, config)
    with pytest.raises(ckpttool.AuditError) as excinfo:
        ckpttool.merge(src, tmp_path / "hf")
    assert str(excinfo.value).endswith("\nPass audit=False to publish it anyway.")
