"""Every real-producer fixture merges to exactly the producer's full weights and loads with equal logits."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import ckpttool
from conftest import FIXTURE_NAMES, fixture_dir, load_output, tree_digest

INPUT_IDS = torch.tensor([[1, 5, 17, 999, 1000, 42, 7, 3], [2, 640, 501, 500, 250, 251, 0, 9]])


@pytest.fixture(scope="module", params=FIXTURE_NAMES)
def merged(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    out = tmp_path_factory.mktemp(name) / "hf"
    before = tree_digest(fixture_dir(name))
    ckpttool.merge(fixture_dir(name) / "checkpoint", out)
    assert tree_digest(fixture_dir(name)) == before, "the source was modified"
    return name, out


def test_every_tensor_is_bit_identical_to_the_producers_full_weights(merged):
    name, out = merged
    got = load_output(out)
    want = load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype, key
        assert got[key].shape == tensor.shape, key
        assert torch.equal(got[key], tensor), f"{name}: {key} differs"


def test_output_loads_in_transformers_with_equal_logits(merged):
    name, out = merged
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir(name) / "reference").eval()
    with torch.no_grad():
        assert torch.equal(ours(INPUT_IDS).logits, reference(INPUT_IDS).logits)


def test_output_is_transformers_on_disk_format(merged):
    name, out = merged
    assert (out / "config.json").is_file()
    header = json.loads((out / "model.safetensors").read_bytes()[8:][: int.from_bytes((out / "model.safetensors").read_bytes()[:8], "little")])
    assert header["__metadata__"] == {"format": "pt"}
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == load_output(out)["model.embed_tokens.weight"].shape[0]


def test_tokenizer_files_are_copied_when_present(tmp_path):
    out = tmp_path / "hf"
    result = ckpttool.merge(fixture_dir("llama_fsdp2_dcp") / "checkpoint", out)
    assert {"tokenizer.json", "tokenizer_config.json"} <= set(result.extras)
    src = fixture_dir("llama_fsdp2_dcp") / "checkpoint" / "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == src.read_bytes()


def test_config_next_to_the_checkpoint_is_found(tmp_path):
    # llama_tp2_dcp keeps config.json beside checkpoint/, not inside it
    assert not (fixture_dir("llama_tp2_dcp") / "checkpoint" / "config.json").exists()
    result = ckpttool.merge(fixture_dir("llama_tp2_dcp") / "checkpoint", tmp_path / "hf")
    assert result.config == str(fixture_dir("llama_tp2_dcp") / "config.json")


def test_uneven_vocab_split_is_recorded_not_inferred():
    layout = ckpttool.read_layout(fixture_dir("llama_tp2_dcp") / "checkpoint")
    embed = layout.tensors["model.embed_tokens.weight"]
    assert embed.global_shape == (1001, 32)
    assert sorted(p.box.sizes[0] for p in embed.pieces) == [500, 501]


@pytest.mark.parametrize("name", [n for n in FIXTURE_NAMES if n.startswith("mixtral")])
def test_mixtral_stacked_experts_become_per_expert_tensors(name, tmp_path):
    ckpttool.merge(fixture_dir(name) / "checkpoint", tmp_path / "hf")
    got = load_output(tmp_path / "hf")
    assert "model.layers.0.mlp.experts.gate_up_proj" not in got
    assert got["model.layers.1.block_sparse_moe.experts.3.w1.weight"].shape == (48, 32)
    assert got["model.layers.1.block_sparse_moe.experts.3.w2.weight"].shape == (32, 48)


def test_sharded_output_with_index(tmp_path):
    out = tmp_path / "hf"
    result = ckpttool.merge(fixture_dir("mixtral_fsdp2_dcp") / "checkpoint", out, max_shard_size="100KB")
    names = sorted(p.name for p in out.glob("*.safetensors"))
    assert len(names) == len(result.files) > 1
    assert names[0] == f"model-00001-of-{len(names):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert index["metadata"]["total_size"] == result.plan.nbytes
    assert set(index["weight_map"].values()) == set(names)
    assert all(f.nbytes <= 100_000 for f in result.files if len(f.targets) > 1)
    model = AutoModelForCausalLM.from_pretrained(out)
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir("mixtral_fsdp2_dcp") / "reference")
    with torch.no_grad():
        assert torch.equal(model(INPUT_IDS).logits, reference(INPUT_IDS).logits)


def test_dtype_cast_updates_tensors_and_config(tmp_path):
    out = tmp_path / "hf"
    ckpttool.merge(fixture_dir("llama_tp2_dcp") / "checkpoint", out, dtype="bfloat16")
    got = load_output(out)
    want = load_output(fixture_dir("llama_tp2_dcp") / "reference")
    assert all(t.dtype == torch.bfloat16 for t in got.values())
    assert torch.equal(got["lm_head.weight"], want["lm_head.weight"].to(torch.bfloat16))
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_hf_input_round_trips(tmp_path):
    first, second = tmp_path / "a", tmp_path / "b"
    ckpttool.merge(fixture_dir("mixtral_hf_tp2_ep2") / "checkpoint", first, max_shard_size="150KB")
    result = ckpttool.merge(first, second)
    assert result.format == "hf"
    assert len(result.files) == 1
    want = load_output(fixture_dir("mixtral_hf_tp2_ep2") / "reference")
    got = load_output(second)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_generic_merge_without_config_keeps_source_names(tmp_path):
    result = ckpttool.merge(fixture_dir("mixtral_fsdp2_dcp") / "checkpoint", tmp_path / "hf", config=None, format="dcp")
    # config.json sits in checkpoint/, so it is found; a generic merge needs the source without it
    assert result.config is not None
    src = tmp_path / "bare"
    src.mkdir()
    for f in (fixture_dir("mixtral_fsdp2_dcp") / "checkpoint").iterdir():
        if f.name != "config.json":
            (src / f.name).write_bytes(f.read_bytes())
    generic = ckpttool.merge(src, tmp_path / "generic")
    assert any("generic merge" in n for n in generic.plan.notes)
    got = load_output(tmp_path / "generic")
    assert got["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 96, 32)
    per_expert = load_output(fixture_dir("mixtral_fsdp2_dcp") / "reference")
    assert torch.equal(got["model.layers.0.mlp.experts.gate_up_proj"][2, :48], per_expert["model.layers.0.block_sparse_moe.experts.2.w1.weight"])
    assert torch.equal(got["model.layers.0.mlp.experts.gate_up_proj"][2, 48:], per_expert["model.layers.0.block_sparse_moe.experts.2.w3.weight"])
