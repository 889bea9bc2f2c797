"""Model families: the merge writes exactly what transformers' save_pretrained writes, and loads with equal logits.

Each test builds a tiny model from a transformers config with a fixed seed, saves the reference with
``save_pretrained``, and writes the same weights in a sharded form a training loop would produce.
"""

from __future__ import annotations

import json
import warnings
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config, Qwen2MoeConfig

import ckpttool
from ckpttool.layout.layout import Fusion
from ckpttool.io.sidecar import PieceSpec, save_shard
from conftest import load_output

SMALL = dict(vocab_size=1001, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=64)
INPUT_IDS = torch.tensor([[1, 5, 17, 999, 1000, 42, 7, 3]])


def build(config) -> torch.nn.Module:
    """A model whose every tensor is distinct random data (norms too), so misplaced pieces show."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            noise = 0.05 * torch.randn(tensor.shape, generator=g)
            tensor.copy_(1 + noise if name.endswith("norm.weight") else noise)
    return model


def reference(model, tmp_path: Path) -> Path:
    ref = tmp_path / "reference"
    model.save_pretrained(ref)
    return ref


def assert_same_model(out: Path, ref: Path) -> None:
    got, want = load_output(out), load_output(ref)
    assert sorted(got) == sorted(want)
    for key in want:
        assert torch.equal(got[key], want[key]), key
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    theirs = AutoModelForCausalLM.from_pretrained(ref).eval()
    with torch.no_grad():
        assert torch.equal(ours(INPUT_IDS).logits, theirs(INPUT_IDS).logits)


def dcp_save(model, directory: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save(model.state_dict(), checkpoint_id=str(directory))
    model.config.to_json_file(directory / "config.json")


FAMILIES = {
    "llama-tied": LlamaConfig(intermediate_size=64, tie_word_embeddings=True, **SMALL),
    "mistral": MistralConfig(intermediate_size=64, tie_word_embeddings=False, **SMALL),
    "qwen2": Qwen2Config(intermediate_size=64, tie_word_embeddings=False, **SMALL),
    "qwen2_moe": Qwen2MoeConfig(intermediate_size=64, moe_intermediate_size=24, shared_expert_intermediate_size=40,
                                num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False, **SMALL),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_dcp_of_in_memory_names_merges_to_save_pretrained_format(family, tmp_path):
    model = build(FAMILIES[family])
    ref = reference(model, tmp_path)
    src = tmp_path / "dcp"
    dcp_save(model, src)
    result = ckpttool.merge(src, tmp_path / "out")
    assert_same_model(tmp_path / "out", ref)
    if family == "llama-tied":
        assert any("dropped lm_head.weight" in n for n in result.plan.notes)
    if family == "qwen2_moe":
        assert "model.layers.1.mlp.experts.3.up_proj.weight" in load_output(tmp_path / "out")


def test_wrapper_prefix_of_a_training_loop_is_stripped(tmp_path):
    model = build(FAMILIES["qwen2"])
    ref = reference(model, tmp_path)
    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": model.state_dict()}, checkpoint_id=str(src))
    model.config.to_json_file(src / "config.json")
    result = ckpttool.merge(src, tmp_path / "out")
    assert any("stripped the prefix 'model.'" in n for n in result.plan.notes)
    assert_same_model(tmp_path / "out", ref)


COLUMN_PARALLEL = ("q_proj.weight", "k_proj.weight", "v_proj.weight", "gate_proj.weight", "up_proj.weight")
ROW_PARALLEL = ("o_proj.weight", "down_proj.weight")


def _tp_piece(name: str, full: torch.Tensor, rank: int, tp: int, padded_vocab: int) -> tuple[torch.Tensor, PieceSpec]:
    """Megatron-style TP: vocab and column-parallel weights split on dim 0, row-parallel on dim 1, the rest
    replicated; the vocab is padded to ``padded_vocab`` rows of garbage that the merge must strip."""
    shape = tuple(full.shape)
    if name.endswith(("embed_tokens.weight", "lm_head.weight")):
        padded = torch.full((padded_vocab, shape[1]), 7.0)
        padded[: shape[0]] = full
        spec = PieceSpec.split(tuple(padded.shape), dim=0, index=rank, count=tp, true_size=shape[0], tp_rank=rank)
        return padded.chunk(tp, dim=0)[rank].clone(), spec
    if name.endswith(COLUMN_PARALLEL + ROW_PARALLEL):
        dim = 1 if name.endswith(ROW_PARALLEL) else 0
        return full.chunk(tp, dim=dim)[rank].clone(), PieceSpec.split(shape, dim=dim, index=rank, count=tp, tp_rank=rank)
    return full, PieceSpec.replicated(shape, tp_rank=rank)


def test_sidecar_seed_case_padded_vocab_split_tp4(tmp_path):
    """The incident at tiny scale: vocab 1001 padded to 1004 for tp=4, every rank's piece recorded."""
    model = build(LlamaConfig(intermediate_size=64, tie_word_embeddings=False, **SMALL))
    ref = reference(model, tmp_path)
    src = tmp_path / "sidecar"
    for rank in range(4):
        pieces = {name: _tp_piece(name, full, rank, 4, 1004) for name, full in model.state_dict().items()}
        save_shard({n: t for n, (t, _) in pieces.items()}, {n: s for n, (_, s) in pieces.items()}, src, rank=rank, world_size=4)
    model.config.to_json_file(src / "config.json")
    layout = ckpttool.read_layout(src)
    embed = layout.tensors["model.embed_tokens.weight"]
    assert embed.global_shape == (1004, 32) and embed.true_shape == (1001, 32)
    assert [p.box.sizes[0] for p in embed.pieces] == [251] * 4
    ckpttool.merge(src, tmp_path / "out")
    assert_same_model(tmp_path / "out", ref)


def test_sidecar_fused_gate_up_is_split_into_its_parts(tmp_path):
    model = build(LlamaConfig(intermediate_size=64, tie_word_embeddings=False, **SMALL))
    ref = reference(model, tmp_path)
    state = model.state_dict()
    src = tmp_path / "sidecar"
    for rank in range(2):
        tensors, specs = {}, {}
        for name, full in state.items():
            if name.endswith("up_proj.weight"):
                continue
            if name.endswith("gate_proj.weight"):
                prefix = name.removesuffix("gate_proj.weight")
                fused = torch.cat([full, state[prefix + "up_proj.weight"]])  # [gate; up], (128, 32)
                fusion = Fusion(0, ((prefix + "gate_proj.weight", 64), (prefix + "up_proj.weight", 64)))
                spec = PieceSpec.split(tuple(fused.shape), dim=0, index=rank, count=2, fusion=fusion, tp_rank=rank)
                tensors[prefix + "gate_up_proj.weight"] = fused[rank * 64:(rank + 1) * 64].clone()
                specs[prefix + "gate_up_proj.weight"] = spec
            else:
                tensors[name], specs[name] = full, PieceSpec.replicated(tuple(full.shape))
        save_shard(tensors, specs, src, rank=rank, world_size=2)
    model.config.to_json_file(src / "config.json")
    ckpttool.merge(src, tmp_path / "out")
    assert_same_model(tmp_path / "out", ref)


def test_unknown_architecture_merges_generically(tmp_path):
    src = tmp_path / "dcp"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"encoder.w": torch.arange(6.0).reshape(2, 3)}, checkpoint_id=str(src))
    (src / "config.json").write_text(json.dumps({"model_type": "not-a-real-model", "vocab_size": 3}))
    result = ckpttool.merge(src, tmp_path / "out")
    assert any("generic merge (transformers has no causal LM for model_type 'not-a-real-model')" in n for n in result.plan.notes)
    assert torch.equal(load_output(tmp_path / "out")["encoder.w"], torch.arange(6.0).reshape(2, 3))


def test_model_descriptions_are_cached_by_config_and_transformers_version(tmp_path, monkeypatch):
    import ckpttool.model.architecture as models

    monkeypatch.setenv("CKPTTOOL_CACHE", str(tmp_path / "cache"))
    config = json.loads((Path(__file__).resolve().parent.parent / "fixtures" / "mixtral_fsdp2_dcp" / "reference" / "config.json").read_text())
    built = models.model_info(config)
    assert len(list((tmp_path / "cache" / "models").glob("*.json"))) == 1

    def no_transformers(*args, **kwargs):
        raise AssertionError("the cached description was not used")

    monkeypatch.setattr(models, "_build", no_transformers)
    assert models.model_info(config) == built
    with pytest.raises(AssertionError):
        models.model_info({**config, "num_hidden_layers": 3})  # another config: another entry


def test_a_damaged_or_unwritable_cache_is_ignored(tmp_path, monkeypatch):
    import ckpttool.model.architecture as models

    config = dict(FAMILIES["mistral"].to_dict())
    monkeypatch.setenv("CKPTTOOL_CACHE", str(tmp_path / "cache"))
    expected = models.model_info(config)
    [entry] = (tmp_path / "cache" / "models").glob("*.json")
    entry.write_text("{not json")
    assert models.model_info(config) == expected
    blocked = tmp_path / "file"
    blocked.write_text("")
    monkeypatch.setenv("CKPTTOOL_CACHE", str(blocked))  # a file where the directory should be
    assert models.model_info(config) == expected
