"""Detection when several readers recognise a directory: one format holding another is that format; two
checkpoints of different formats in one folder are refused, naming both and what was found."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckpttool.errors import SourceError
from ckpttool.readers import detect_format
from ckpttool.io.sidecar import PieceSpec, save_shard
from conftest import FIXTURES, fixture_dir

EXPECTED = {
    "colossalai_": "colossalai", "deepspeed_v0_": "deepspeed",  # deepspeed_v0_<minor>_*: older releases
    "deepspeed_": "deepspeed", "llama_fsdp2_dcp": "dcp", "llama_tp2_dcp": "dcp",
    "llama_tp2_fsdp2_dcp": "dcp", "mixtral_fsdp2_dcp": "dcp", "mixtral_fsdp8_dcp_zero_chunk": "dcp",
    "llama_hf_tp2": "hf-distributed", "accelerate_": "dcp", "mixtral_hf_tp2_ep2": "hf-distributed", "verl_": "verl",
    "qwen2moe_fsdp2_dcp": "dcp", "deepseek_v3_fsdp2_dcp": "dcp", "deepseek_v3_hf_tp2_ep2": "hf-distributed",
    "deepseek_v3_hf_mtp": "hf", "quantized_": "hf", "hf_bin_": "hf", "incident_": "hf", "qwen2_5_vl_fsdp2_dcp": "dcp", "torch_v2_": "dcp",
    "gemma3_vl_fsdp2_dcp": "dcp", "qwen3_vl_": "dcp", "qwen2_5_vl_hf_tp2": "hf-distributed",
    "glm4v_hf_tp2": "hf-distributed", "llama4_hf_tp2": "hf-distributed",
    "hf_tf4_": "hf", "hf_accelerate_": "hf", "gpt_oss_fsdp2_dcp": "dcp", "gpt_oss_hf_ep2": "hf-distributed",
    "megatron_v": "megatron-dist",  # megatron_v<major>_<minor>_<case>: torch_dist/ (and legacy/), no checkpoint/
    "torchtitan_": "dcp", "lora_": "hf", "peft_": "dcp", "lightning_": "lightning",
    "qwen3_next_fsdp2_dcp": "dcp", "qwen3_next_hf_tp2": "hf-distributed", "nemotron_h_fsdp2_dcp": "dcp",
    "falcon_h1_fsdp2_dcp": "dcp",
    "qwen3_5_fsdp2_dcp": "dcp", "qwen3_5_hf_tp2": "hf-distributed", "qwen3_5_moe_fsdp2_dcp": "dcp",
    "nemotron_h_moe_fsdp2_dcp": "dcp", "nemotron_h_moe_hf_tp2": "hf-distributed",
}


def _expected(name: str) -> str:
    return next(fmt for prefix, fmt in EXPECTED.items() if name.startswith(prefix))


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.iterdir() if (p / "checkpoint").is_dir()))
def test_every_fixture_is_one_format(name):
    assert detect_format(fixture_dir(name) / "checkpoint") == _expected(name)
    if not name.startswith("quantized_"):  # quantized fixtures are their own reference (checked against torch's reader)
        assert detect_format(fixture_dir(name) / "reference") == "hf"


@pytest.mark.parametrize("name", sorted(p.name for p in FIXTURES.glob("megatron_*") if (p / "torch_dist").is_dir()))
def test_a_torch_dist_iteration_is_megatron_not_two_formats(name):
    """A torch_dist iteration directory is a DCP directory plus Megatron's metadata.json and common.pt."""
    iteration = next((FIXTURES / name / "torch_dist").glob("iter_*"))
    assert (iteration / ".metadata").is_file()
    assert detect_format(iteration) == "megatron-dist"
    if (FIXTURES / name / "legacy").is_dir():
        assert detect_format(FIXTURES / name / "legacy") == "megatron-legacy"


def test_a_colossalai_index_is_colossalai_not_huggingface():
    src = fixture_dir("colossalai_llama_tp2_vocab_piece") / "checkpoint"
    assert (src / "model.safetensors.index.json").is_file()
    assert detect_format(src) == "colossalai"


def test_huggingface_files_beside_a_checkpoint_are_not_a_second_checkpoint(tmp_path):
    """verl's huggingface/ folder, tokenizer and config files, an audit report: none is a checkpoint."""
    src = tmp_path / "verl"
    shutil.copytree(fixture_dir("verl_llama_dp2_tp2") / "checkpoint", src)
    shutil.copytree(fixture_dir("verl_llama_dp2_tp2") / "reference", src / "huggingface", dirs_exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "ckpttool-audit.json"):
        (src / name).write_text("{}")
    assert detect_format(src) == "verl"


def _two_formats(tmp_path: Path) -> Path:
    src = tmp_path / "both"
    shutil.copytree(fixture_dir("llama_tp2_dcp") / "checkpoint", src)
    for rank in range(2):
        save_shard({"embed": torch.arange(24.0).reshape(6, 4)}, {"embed": PieceSpec.split((12, 4), dim=0, index=rank, count=2)},
                   src, rank=rank, world_size=2)
    return src


def test_a_dcp_and_a_sidecar_checkpoint_in_one_folder_are_refused(tmp_path):
    src = _two_formats(tmp_path)
    with pytest.raises(SourceError) as excinfo:
        detect_format(src)
    assert str(excinfo.value) == (
        f"'{src}': holds checkpoints of 2 formats:\n"
        "  - sidecar: 'rank-00000-of-00002.ckpttool.json', 'rank-00001-of-00002.ckpttool.json'\n"
        "  - dcp: '.metadata', '__0_0.distcp', '__1_0.distcp'\n"
        "Merging one would silently leave out the other. Pass format='NAME' with the one you mean (sidecar or dcp), "
        "or move the other checkpoint to a folder of its own."
    )


def test_the_audit_refuses_two_formats_too_and_format_picks_one(cli, tmp_path):
    src = _two_formats(tmp_path)
    result = cli("audit", src, "--no-data")
    assert result.exit_code == 1, result.output
    assert "holds checkpoints of 2 formats" in result.stderr and "Pass --format NAME" in result.stderr
    merged = cli("merge", src, tmp_path / "out", "--format", "dcp", "--config", FIXTURES / "llama_tp2_dcp" / "config.json")
    assert merged.exit_code == 0, merged.output
    assert (tmp_path / "out" / "model.safetensors").is_file()
    generic = cli("merge", src, tmp_path / "side", "--format", "sidecar", "--json")
    assert generic.exit_code == 0, generic.output
    assert [t["name"] for t in json.loads(generic.stdout)["targets"]] == ["embed"]


def test_huggingface_weights_beside_deepspeed_steps_are_two_checkpoints(tmp_path):
    """A trainer's folder with global_stepN/ and a model.safetensors: which one is meant is the user's call."""
    src = tmp_path / "trainer"
    shutil.copytree(fixture_dir("deepspeed_zero2") / "checkpoint", src)
    shutil.copy(fixture_dir("deepspeed_zero2") / "reference" / "model.safetensors", src / "model.safetensors")
    with pytest.raises(SourceError, match=r"holds checkpoints of 2 formats:\n"
                                          r"  - deepspeed: 'global_step2/', 'latest'\n"
                                          r"  - hf: 'model.safetensors'\n"):
        detect_format(src)
