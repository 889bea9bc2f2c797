"""ColossalAI sharded model outputs (HybridParallelCheckpointIO, MoECheckpointIO), as its source writes them
(``fixtures/make_colossalai.py``): merged bit for bit, the seed incident refused with its diagnosis."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_failed_cleanly, fixture_dir, load_output, tree_digest

import ckpttool
from ckpttool.readers import colossalai, detect_format

GOOD = ("colossalai_llama_pp2_bin", "colossalai_llama_pp2_unmerged", "colossalai_mixtral_pp2_ep2",
        "colossalai_mixtral_ep2_unmerged")
INPUT_IDS = torch.tensor([[1, 5, 9, 42, 100, 999, 1000, 7]])


def config_of(name: str) -> Path | None:
    """An interrupted save has no config.json (ColossalAI writes it after merging the indexes)."""
    return None if (fixture_dir(name) / "checkpoint" / "config.json").is_file() else fixture_dir(name) / "reference"


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    outs = {}
    for name in GOOD:
        out = tmp_path_factory.mktemp(name) / "out"
        src = fixture_dir(name) / "checkpoint"
        before = tree_digest(src)
        ckpttool.merge(src, out, config=config_of(name))
        assert tree_digest(src) == before
        outs[name] = out
    return outs


@pytest.mark.parametrize("name", GOOD)
def test_merge_is_bit_identical_to_the_full_model(merged, name):
    got, want = load_output(merged[name]), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("name", ("colossalai_llama_pp2_bin", "colossalai_mixtral_pp2_ep2"))
def test_output_loads_with_the_reference_logits(merged, name):
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(merged[name]).eval()
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir(name) / "reference").eval()
    with torch.no_grad():
        assert torch.equal(ours(INPUT_IDS).logits, reference(INPUT_IDS).logits)  # tolerance 0: identical


def test_dry_run_shows_format_parallel_and_expert_mapping(cli, tmp_path):
    src = fixture_dir("colossalai_mixtral_pp2_ep2") / "checkpoint"
    result = cli("merge", src, tmp_path / "out", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "(colossalai)" in result.stdout
    assert "parallel: pp=2 ep=2" in result.stdout
    assert ("model.layers.1.block_sparse_moe.experts.3.w2.weight  F32 [32x48]  <- "
            "model.layers.1.block_sparse_moe.experts.3.w2.weight (1 piece)") in result.stdout
    assert "hold only copies of indexed tensors" in result.stdout
    assert not (tmp_path / "out").exists()


def test_experts_come_from_their_ep_rank_files_under_global_ids():
    layout = ckpttool.read_layout(fixture_dir("colossalai_mixtral_ep2_unmerged") / "checkpoint")
    for expert in range(4):
        piece, = layout.tensors[f"model.layers.0.block_sparse_moe.experts.{expert}.w1.weight"].pieces
        assert f"-00001-{expert // 2 + 1:05d}-shard-" in piece.file
        assert ("ep_rank", expert // 2) in piece.tags
    assert layout.parallel == {"pp": 1, "ep": 2}
    assert any("merged the 2 stage indexes" in n for n in layout.notes)


def test_detection_takes_colossalai_names_and_leaves_huggingface_directories(tmp_path):
    for name in (*GOOD, "colossalai_llama_tp2_vocab_piece"):
        assert detect_format(fixture_dir(name) / "checkpoint") == "colossalai", name
    assert detect_format(fixture_dir("llama_fsdp2_dcp") / "reference") == "hf"
    # a sharded HuggingFace directory (save_pretrained names its shards -0000k-of-0000n)
    hf = tmp_path / "hf"
    shutil.copytree(fixture_dir("colossalai_llama_tp2_vocab_piece") / "checkpoint", hf)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    for old in sorted(set(index["weight_map"].values())):
        new = old.replace(".safetensors", "-of-00003.safetensors")
        (hf / old).rename(hf / new)
        index["weight_map"] = {k: new if v == old else v for k, v in index["weight_map"].items()}
    (hf / "model.safetensors.index.json").write_text(json.dumps(index))
    assert not colossalai.matches(hf)
    assert detect_format(hf) == "hf"


def test_one_tp_piece_of_a_padded_vocab_is_refused_with_the_diagnosis(cli, tmp_path):
    """The seed incident in small: embed_tokens is tp rank 0's [512, 32] of a vocab of 1001 padded to 1024."""
    src = fixture_dir("colossalai_llama_tp2_vocab_piece") / "checkpoint"
    out = tmp_path / "out"
    assert_failed_cleanly(
        cli("merge", src, out), out,
        "'model.embed_tokens.weight': shape [512, 32], but the config gives [1001, 32]",
        "512 rows is one of 2 TP pieces of a vocab padded to 1024", "the other piece is missing",
    )


# ------------------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------------------
def test_missing_shard_names_the_file_and_tensor(cli, copy_fixture, tmp_path):
    src = copy_fixture("colossalai_llama_pp2_bin")
    (src / "pytorch_model-stage-00002-shard-00001.bin").unlink()
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "'pytorch_model.bin.index.json' puts 'model.layers.1.",
                          "(and 9 more tensors) in 'pytorch_model-stage-00002-shard-00001.bin' (pipeline stage 2), which does not exist")


def test_missing_ep_rank_file_names_the_file_and_expert(cli, copy_fixture, tmp_path):
    src = copy_fixture("colossalai_mixtral_pp2_ep2")
    (src / "pytorch_model-stage-00002-00002-shard-00001.bin").unlink()
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "(and 13 more tensors) in "
                          "'pytorch_model-stage-00002-00002-shard-00001.bin' (pipeline stage 2, EP rank 2: experts 2, 3), "
                          "which does not exist")


def test_missing_stage_index_of_an_unfinished_save(cli, copy_fixture, tmp_path):
    src = copy_fixture("colossalai_llama_pp2_unmerged")
    (src / "tmp_index_files" / "model.safetensors.index-stage-00002.json").unlink()
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out, "--config", fixture_dir("colossalai_llama_pp2_unmerged") / "reference"),
                          out, "'tmp_index_files/model.safetensors.index-stage-00002.json' is missing",
                          "pipeline stage 2", "'model-stage-00002-shard-00001.safetensors'", "expected 2 stages")


def test_missing_ep_rank_index_of_an_unfinished_save(cli, copy_fixture, tmp_path):
    src = copy_fixture("colossalai_mixtral_ep2_unmerged")
    (src / "tmp_index_files" / "model.safetensors.index-stage-00001-00002.json").unlink()
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out, "--config", fixture_dir("colossalai_mixtral_ep2_unmerged") / "reference"),
                          out, "'tmp_index_files/model.safetensors.index-stage-00001-00002.json' is missing",
                          "pipeline stage 1, EP rank 2", "expected 1 stage x 2 EP ranks")


def test_total_size_disagreeing_with_the_shards(cli, copy_fixture, tmp_path):
    src = copy_fixture("colossalai_llama_pp2_bin")
    path = src / "pytorch_model.bin.index.json"
    index = json.loads(path.read_text())
    real = index["metadata"]["total_size"]
    index["metadata"]["total_size"] = real / 2
    path.write_text(json.dumps(index))
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, f"(expected {real}, found {real / 2})")


def test_index_naming_the_wrong_shard(cli, copy_fixture, tmp_path):
    src = copy_fixture("colossalai_llama_pp2_bin")
    path = src / "pytorch_model.bin.index.json"
    index = json.loads(path.read_text())
    index["weight_map"]["lm_head.weight"] = "pytorch_model-stage-00001-shard-00001.bin"
    del index["metadata"]
    path.write_text(json.dumps(index))
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "puts 'lm_head.weight' in 'pytorch_model-stage-00001-shard-00001.bin'",
                          "expected 'lm_head.weight' in 'pytorch_model-stage-00001-shard-00001.bin', found 1 other")


def test_experts_in_the_wrong_ep_rank_file(cli, copy_fixture, tmp_path):
    """EP rank files swapped consistently (names and indexes): expert ids no longer match the EP rank."""
    src = copy_fixture("colossalai_mixtral_ep2_unmerged")
    swap = {"-00001-00001": "-00001-00002", "-00001-00002": "-00001-00001"}
    for path in sorted([*src.glob("*.safetensors"), *(src / "tmp_index_files").glob("*.json")]):
        for old, new in swap.items():
            if old in path.name:
                path.rename(path.with_name(path.name.replace(old, new) + ".swapped"))
                break
    for path in [*src.glob("*.swapped"), *(src / "tmp_index_files").glob("*.swapped")]:
        final = path.with_name(path.name[: -len(".swapped")])
        path.rename(final)
        if final.suffix == ".json":
            text = final.read_text()
            for old, new in swap.items():
                text = text.replace(old, "@" + new[1:])
            final.write_text(text.replace("@", "-"))
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out, "--config", fixture_dir("colossalai_mixtral_ep2_unmerged") / "reference"),
                          out, "expert 2 belongs to EP rank 2: expected experts 0..1 in that file")


def test_stray_shard_holding_unindexed_tensors(cli, copy_fixture, tmp_path):
    src = copy_fixture("colossalai_llama_pp2_bin")
    from safetensors.torch import save_file

    save_file({"model.layers.7.mlp.up_proj.weight": torch.zeros(2, 2)}, str(src / "model-stage-00003-shard-00001.safetensors"))
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out,
                          "'model-stage-00003-shard-00001.safetensors' holds 'model.layers.7.mlp.up_proj.weight'",
                          "which no index names")


def test_optimizer_shards_saved_alongside_are_not_the_model(copy_fixture, tmp_path):
    src = copy_fixture("colossalai_llama_pp2_bin")
    shutil.copy(src / "pytorch_model-stage-00001-shard-00002.bin", src / "pytorch_optim-stage-00001-shard-00001.bin")
    (src / "tmp_index_files").mkdir()
    (src / "tmp_index_files" / "pytorch_optim.bin.index-stage-00001.json").write_text(
        json.dumps({"metadata": {"total_size": 0}, "weight_map": {"0": "pytorch_optim-stage-00001-shard-00001.bin"}}))
    layout = ckpttool.read_layout(src)
    assert layout.format == "colossalai" and len(layout.tensors) == 21
    assert not any("optim" in p.file for t in layout.tensors.values() for p in t.pieces)
