"""The audit's detection classes of issue 18, each proven on a fault seeded in the fixtures' real weights, through
the CLI: untrained MTP layers, a missing shared expert, norms of the wrong convention, vocab rows that are copies.
Each test also audits the unfaulted weights, so that a check that cannot fail, or fires on everything, shows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, load_output
from test_audit import reference, write_hf
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import GemmaConfig

MTP = FIXTURES / "deepseek_v3_hf_mtp" / "checkpoint"
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def audit_json(cli, src: Path, *options: str) -> tuple[int, dict]:
    result = cli("audit", src, "--json", *options)
    return result.exit_code, json.loads(result.stdout)


def causes_of(doc: dict) -> list[tuple[str, str, int, str]]:
    return [(c["severity"], c["code"], c["count"], c["cause"]) for c in doc["causes"]]


# ------------------------------------------------------------------------------------------------ MTP


@pytest.fixture(scope="module")
def deepseek_with_mtp() -> tuple[dict[str, torch.Tensor], dict]:
    return load_output(MTP), json.loads((MTP / "config.json").read_text())


def test_a_trained_mtp_layer_is_not_flagged(cli, tmp_path, deepseek_with_mtp):
    code, doc = audit_json(cli, write_hf(tmp_path / "hf", *deepseek_with_mtp))
    assert code == 0 and doc["causes"] == []


def test_an_mtp_layer_at_its_initialisation_is_one_warning(cli, tmp_path, deepseek_with_mtp):
    tensors, config = deepseek_with_mtp
    tensors = dict(tensors)
    generator = torch.Generator().manual_seed(0)
    for name, t in tensors.items():  # what transformers' _init_weights gives it: norms 1, normal(0, 0.02)
        if name.startswith("model.layers.3.") and not name.endswith(("embed_tokens.weight", "shared_head.head.weight")):
            if t.dim() == 1 and name.endswith("norm.weight"):
                tensors[name] = torch.ones_like(t)
            elif t.dim() == 2:
                tensors[name] = torch.randn(t.shape, generator=generator) * config["initializer_range"]
    code, doc = audit_json(cli, write_hf(tmp_path / "hf", tensors, config))
    assert code == 0  # a warning: transformers ignores MTP layers
    mtp = [c for c in doc["causes"] if c["code"] == "mtp-untrained"]
    assert [(c["severity"], c["cause"]) for c in mtp] == [(
        "warning", "MTP layer 3 is at its initialisation (every norm exactly 1, every projection's RMS about "
                   "initializer_range 0.02): 29 tensors in layer 3")]
    assert "model.layers.3.enorm.weight" in mtp[0]["tensors"] and "model.layers.3.eh_proj.weight" in mtp[0]["tensors"]
    message = next(f["message"] for f in doc["findings"] if f["tensor"] == "model.layers.3.enorm.weight"
                   and f["code"] == "mtp-untrained")
    assert message == "'model.layers.3.enorm.weight' is at its initial value (1 everywhere): MTP layer 3 was not trained"
    assert cli("audit", write_hf(tmp_path / "again", tensors, config), "--strict").exit_code == 3


def test_an_mtp_layer_copied_from_a_main_layer_is_one_warning(cli, tmp_path, deepseek_with_mtp):
    tensors, config = deepseek_with_mtp
    tensors = dict(tensors)
    for name in list(tensors):
        source = name.replace("model.layers.3.", "model.layers.2.")
        if name.startswith("model.layers.3.") and source in tensors:
            tensors[name] = tensors[source].clone()
    code, doc = audit_json(cli, write_hf(tmp_path / "hf", tensors, config))
    assert code == 0
    assert causes_of(doc) == [("warning", "mtp-untrained", 21, "MTP layer 3 is a copy of main layer 2: 21 tensors in layer 3")]
    assert any(f["message"].startswith("'model.layers.3.self_attn.o_proj.weight' is identical to the same tensor of main "
                                       "layer 2: MTP layer 3 was not trained") for f in doc["findings"])


def test_a_declared_mtp_layer_that_is_absent_is_one_cause(cli, tmp_path, deepseek_with_mtp):
    tensors, config = deepseek_with_mtp
    kept = {n: t for n, t in tensors.items() if not n.startswith("model.layers.3.")}
    code, doc = audit_json(cli, write_hf(tmp_path / "hf", kept, config))
    assert code == 0
    assert [(c["code"], c["count"]) for c in doc["causes"]] == [("mtp-missing", 1)]


# ----------------------------------------------------------------------------------------- shared expert


@pytest.mark.parametrize(("fixture", "module", "layers"), [
    ("qwen2moe_fsdp2_dcp", "model.layers.{L}.mlp.shared_expert", "0-1"),
    ("deepseek_v3_fsdp2_dcp", "model.layers.{L}.mlp.shared_experts", "1-2"),  # layer 0 is dense
])
def test_a_missing_shared_expert_is_one_cause(cli, tmp_path, fixture, module, layers):
    tensors, config = reference(fixture)
    assert audit_json(cli, write_hf(tmp_path / "whole", tensors, config))[0] == 0
    part = module.split("{L}.")[1]
    kept = {n: t for n, t in tensors.items() if f".{part}." not in n}
    code, doc = audit_json(cli, write_hf(tmp_path / "hf", kept, config))
    assert code == 3
    assert causes_of(doc)[0] == ("error", "tensor-missing", 6,
                                 f"shared expert '{module}' is missing in layers {layers} (6 tensors); the config declares it")
    assert len(doc["causes"]) == 1 or doc["causes"][1]["code"] == "mtp-missing"


# ------------------------------------------------------------------------------------------------- norms


def gemma_config() -> dict:
    """A Gemma of the Llama fixture's sizes: its weights fit, its norms are 1 + w."""
    return GemmaConfig(vocab_size=1001, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, tie_word_embeddings=True).to_dict()


def shifted_norms(tensors: dict[str, torch.Tensor], by: float) -> dict[str, torch.Tensor]:
    return {n: t + by if n.endswith("norm.weight") else t for n, t in tensors.items()}


def test_zero_centred_norms_in_a_llama_are_one_cause(cli, tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    assert audit_json(cli, write_hf(tmp_path / "whole", tensors, config))[1]["causes"] == []
    code, doc = audit_json(cli, write_hf(tmp_path / "hf", shifted_norms(tensors, -1.0), config))
    assert code == 3
    assert causes_of(doc) == [("error", "norm-convention", 5, "norms saved as zero-centred 1 + w in a llama model, "
                                                              "whose norms are w: 5 tensors in layers 0-1")]
    message = next(f["message"] for f in doc["findings"] if f["tensor"] == "model.norm.weight")
    assert message.startswith("'model.norm.weight' has mean ")
    assert message.endswith("llama norms multiply by the weight, so these scale by about "
                            f"{next(t['mean'] for t in doc['tensors'] if t['name'] == 'model.norm.weight'):.3g}: "
                            "weights saved for a zero-centred norm (1 + w); add 1")


def test_plain_norms_in_a_gemma_are_one_cause(cli, tmp_path):
    tensors, _ = reference("llama_fsdp2_dcp")
    del tensors[HEAD]  # Gemma ties its head
    code, doc = audit_json(cli, write_hf(tmp_path / "plain", tensors, gemma_config()))
    assert code == 3
    assert causes_of(doc) == [("error", "norm-convention", 5, "norms saved as plain w in a gemma model, whose norms "
                                                              "are 1 + w: 5 tensors in layers 0-1")]
    # the same weights in Gemma's convention pass
    code, doc = audit_json(cli, write_hf(tmp_path / "centred", shifted_norms(tensors, -1.0), gemma_config()))
    assert code == 0 and doc["causes"] == []


# ------------------------------------------------------------------------------------------- vocab rows


def with_tokenizer(directory: Path, tokens: int) -> Path:
    Tokenizer(WordLevel({f"t{i}": i for i in range(tokens)}, unk_token="t0")).save(str(directory / "tokenizer.json"))
    return directory


def test_rows_past_the_tokenizer_that_copy_real_rows_are_one_cause(cli, tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    clean = with_tokenizer(write_hf(tmp_path / "whole", tensors, config), 980)
    assert [c["code"] for c in audit_json(cli, clean)[1]["causes"]] == ["tokenizer-smaller"]  # padding of its own
    for name in (EMBED, HEAD):  # the 21 padding rows tiled from the first rows, as a wrong resize does
        rows = tensors[name].clone()
        rows[980:] = rows[:21]
        tensors[name] = rows
    code, doc = audit_json(cli, with_tokenizer(write_hf(tmp_path / "hf", tensors, config), 980))
    assert code == 3
    assert causes_of(doc)[0] == ("error", "vocab-rows-copied", 2,
                                 "rows past the tokenizer's 980 token ids copy real rows: 2 tensors")
    assert next(f["message"] for f in doc["findings"] if f["tensor"] == EMBED) == (
        "'model.embed_tokens.weight': 21 of the 21 rows past the tokenizer's 980 token ids repeat real rows (row 980 = "
        "row 0, row 981 = row 1, row 982 = row 2, ...): not padding; were the rows assembled from the wrong pieces?")


def test_zero_padding_rows_are_padding(cli, tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    for name in (EMBED, HEAD):
        tensors[name][980:] = 0.0
        tensors[name][5] = 0.0  # a real row of zeros too: zeros are never a copy
    doc = audit_json(cli, with_tokenizer(write_hf(tmp_path / "hf", tensors, config), 980))[1]
    assert "vocab-rows-copied" not in {c["code"] for c in doc["causes"]}


def test_one_layer_with_small_norms_is_no_convention_error(cli, tmp_path):
    """Llama 2's first input norm is small in a trained model: only every layer of a kind at the other convention's
    value is a converter's doing."""
    tensors, config = reference("llama_fsdp2_dcp")
    name = "model.layers.0.input_layernorm.weight"
    tensors[name] = tensors[name] - 1.0
    doc = audit_json(cli, write_hf(tmp_path / "hf", tensors, config))[1]
    assert "norm-convention" not in {c["code"] for c in doc["causes"]}
    tensors["model.layers.1.input_layernorm.weight"] = tensors["model.layers.1.input_layernorm.weight"] - 1.0
    doc = audit_json(cli, write_hf(tmp_path / "both", tensors, config))[1]
    assert [(c["code"], c["tensors"]) for c in doc["causes"] if c["code"] == "norm-convention"] == [
        ("norm-convention", [name, "model.layers.1.input_layernorm.weight"])]
