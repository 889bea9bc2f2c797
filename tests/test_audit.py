"""``audit``: a seeded-fault corpus derived from clean tiny models; each fault is an error naming the tensor
(or file) with the right diagnosis, and the clean models yield no error at all.

Families: the Llama fixture (vocab 1001, not divisible by any TP degree), the Mixtral fixture, and a Qwen2-MoE
built here from a transformers config with a fixed seed (4 layers, so a missing pipeline stage and per-layer
outliers can show).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, Qwen2MoeConfig

import ckpttool
from ckpttool.plan.diagnose import diagnose
from ckpttool.findings import CODES, ERROR
from ckpttool.io.sidecar import PieceSpec, save_shard
from conftest import fixture_dir, load_output

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"
MOE = "model.layers.{layer}.block_sparse_moe.experts.{expert}.{w}.weight"


def reference(name: str) -> tuple[dict[str, torch.Tensor], dict]:
    ref = fixture_dir(name) / "reference"
    return load_output(ref), json.loads((ref / "config.json").read_text())


def write_hf(path: Path, tensors: dict[str, torch.Tensor], config: dict, shards: int = 1) -> Path:
    """An HF directory: one model.safetensors, or ``shards`` files named by an index."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(config))
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return path
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n].contiguous() for n in names[i::shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return path


def errors(report) -> set[tuple[str, str | None]]:
    return {(f.code, f.tensor) for f in report.findings if f.severity == ERROR}


def message(report, code: str, tensor: str | None = None) -> str:
    found = [f.message for f in report.findings if f.code == code and (tensor is None or f.tensor == tensor)]
    assert found, f"no {code} finding for {tensor}: {[(f.code, f.tensor) for f in report.findings]}"
    return found[0]


@pytest.fixture(scope="session")
def qwen2_moe(tmp_path_factory) -> Path:
    config = Qwen2MoeConfig(
        vocab_size=1001, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=64, intermediate_size=64, moe_intermediate_size=24,
        shared_expert_intermediate_size=40, num_experts=4, num_experts_per_tok=2, tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)  # transformers' own init: zero biases, unit norms
    path = tmp_path_factory.mktemp("qwen2_moe") / "reference"
    model.save_pretrained(path)
    return path


# ------------------------------------------------------------------------------------------ clean models


@pytest.mark.parametrize("name", ["llama_fsdp2_dcp", "mixtral_fsdp2_dcp"])
def test_clean_references_have_no_findings(name):
    report = ckpttool.audit(fixture_dir(name) / "reference")
    assert report.ok and report.data_checked
    assert [f for f in report.findings if f.severity != "info"] == []
    assert report.tensors == len(load_output(fixture_dir(name) / "reference"))


def test_clean_qwen2_moe_with_transformers_init_has_only_info(qwen2_moe):
    report = ckpttool.audit(qwen2_moe)
    assert report.ok
    assert {f.severity for f in report.findings} <= {"info"}
    # transformers initialises biases to zero and norms to one: reported as facts, never as errors
    assert {f.code for f in report.findings} == {"zero-bias", "constant-vector"}


@pytest.mark.parametrize("name", ["llama_tp2_dcp", "llama_hf_tp2", "mixtral_hf_tp2_ep2", "mixtral_fsdp8_dcp_zero_chunk"])
def test_sharded_sources_of_clean_models_pass(name):
    report = ckpttool.audit(fixture_dir(name) / "checkpoint")
    assert report.ok, report.findings
    assert report.format != "hf"


# ----------------------------------------------------------------------------------- seeded faults: vocab


def padded_embedding(rows: int) -> torch.Tensor:
    tensors, _ = reference("llama_fsdp2_dcp")
    embed = tensors[EMBED]
    return torch.cat([embed, torch.zeros(max(rows - embed.shape[0], 0), embed.shape[1])])[:rows]


@pytest.mark.parametrize(("rows", "code", "says"), [
    (256, "vocab-tp-piece", "256 rows is one of 4 TP pieces of a vocab padded to 1024 (multiple of 128x4); the other 3 are missing"),
    (501, "vocab-tp-piece", "501 rows is one of 2 TP pieces of the 1001-row vocab; the other piece is missing"),
    (1024, "vocab-padding-not-stripped", "vocab padding not stripped: 1024 rows is vocab_size 1001 padded to a multiple of 32; rows 1001..1024 are padding"),
    (1047, "vocab-padding-doubled", "vocab padding applied twice: 1047 = 1001 + 2x23 rows; padded once it would be 1024"),
])
def test_embedding_fault_is_diagnosed(tmp_path, rows, code, says):
    tensors, config = reference("llama_fsdp2_dcp")
    tensors[EMBED] = padded_embedding(rows)
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config))
    assert errors(report) == {(code, EMBED)}
    assert says in message(report, code, EMBED)


def test_config_vocab_size_disagreeing_with_embedding_and_head(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    config["vocab_size"] = 1000
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config))
    assert errors(report) == {("config-vocab-size", EMBED), ("config-vocab-size", HEAD)}
    assert "both have 1001 rows: the config's vocab_size 1000 looks wrong" in message(report, "config-vocab-size", EMBED)


def test_the_seed_incident_arithmetic():
    found = diagnose(EMBED, (16064, 8192), (128256, 8192), 128256, {EMBED: 16064})
    assert (found.code, found.text) == (
        "vocab-tp-piece",
        "16064 rows is one of 8 TP pieces of a vocab padded to 128512 (multiple of 64x8); the other 7 are missing",
    )
    assert diagnose(EMBED, (128512, 8192), (128256, 8192), 128256, {}).text == (
        "vocab padding not stripped: 128512 rows is vocab_size 128256 padded to a multiple of 512; rows 128256..128512 "
        "are padding"
    )
    assert diagnose(EMBED, (128768, 8192), (128256, 8192), 128256, {}).code == "vocab-padding-doubled"


@pytest.mark.parametrize(("got", "expected", "code", "text"), [
    ((500, 32), (1001, 32), "vocab-tp-piece", "500 rows is one of 2 TP pieces of the 1001-row vocab; the other piece is missing"),
    ((334, 32), (1001, 32), "vocab-tp-piece", "334 rows is one of 3 TP pieces of the 1001-row vocab; the other 2 are missing"),
    ((32, 11), (32, 43), "shape-tp-piece", "dim 1 has 11 of 43 (columns: a row-parallel split): one of 4 TP pieces; the other 3 are missing"),
    ((7, 5), (3, 3), "shape-mismatch", "[7, 5] instead of [3, 3]"),
])
def test_diagnosis_arithmetic(got, expected, code, text):
    found = diagnose("t", got, expected, 1001, {})
    assert (found.code, found.text) == (code, text)


def test_tokenizer_smaller_than_vocab_is_info(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    hf = write_hf(tmp_path / "hf", tensors, config)
    (hf / "tokenizer.json").write_text(json.dumps({"model": {"type": "WordLevel", "vocab": {"a": 0, "b": 1}}, "added_tokens": []}))
    report = ckpttool.audit(hf, data=False)
    assert report.ok
    assert message(report, "tokenizer-smaller") == "'tokenizer.json' has 2 token ids for vocab_size 1001"


@pytest.mark.parametrize("text", ["{not json", '{"model": 3}', "[]"])
def test_unreadable_tokenizer_is_a_warning(tmp_path, text):
    tensors, config = reference("llama_fsdp2_dcp")
    hf = write_hf(tmp_path / "hf", tensors, config)
    (hf / "tokenizer.json").write_text(text)
    report = ckpttool.audit(hf, data=False)
    assert report.ok and not report.strict().ok
    assert message(report, "tokenizer-invalid") == "'tokenizer.json' is not a tokenizer.json with a vocab; its size is not checked"


def test_tokenizer_larger_than_vocab(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    hf = write_hf(tmp_path / "hf", tensors, config)
    tokenizer = json.loads((fixture_dir("llama_fsdp2_dcp") / "checkpoint" / "tokenizer.json").read_text())
    tokenizer["added_tokens"].append({"id": 1010, "content": "<extra>", "special": True})
    (hf / "tokenizer.json").write_text(json.dumps(tokenizer))
    report = ckpttool.audit(hf, data=False)
    assert errors(report) == {("tokenizer-vocab", None)}
    assert message(report, "tokenizer-vocab") == (
        "'tokenizer.json' has token ids up to 1010, but vocab_size is 1001: ids 1001..1010 index past the embedding"
    )


# --------------------------------------------------------------------------- seeded faults: other shapes


def test_transposed_projection(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    name = "model.layers.1.mlp.gate_proj.weight"
    tensors[name] = tensors[name].t().contiguous()
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config), data=False)
    assert errors(report) == {("shape-transposed", name)}
    assert "transposed: [32, 64] is [64, 32] with its dims swapped" in message(report, "shape-transposed", name)


def test_row_parallel_piece(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    name = "model.layers.0.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :16].contiguous()
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config), data=False)
    assert errors(report) == {("shape-tp-piece", name)}
    assert "dim 1 has 16 of 64 (columns: a row-parallel split): one of 4 TP pieces; the other 3 are missing" in message(report, "shape-tp-piece")


def test_missing_pipeline_stage_is_one_finding(tmp_path, qwen2_moe):
    tensors = load_output(qwen2_moe)
    config = json.loads((qwen2_moe / "config.json").read_text())
    kept = {n: t for n, t in tensors.items() if not n.startswith(("model.layers.2.", "model.layers.3."))}
    report = ckpttool.audit(write_hf(tmp_path / "hf", kept, config), data=False)
    assert errors(report) == {("layers-missing", "model.layers.2..3")}
    per_layer = sum(1 for n in tensors if n.startswith("model.layers.2."))
    assert message(report, "layers-missing") == (
        f"layers 2..3 of 'model.layers' are missing entirely ({2 * per_layer} tensors; present: 0..1 of 4 layers): "
        "a pipeline stage missing?"
    )


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_missing_expert(tmp_path, family, qwen2_moe):
    if family == "mixtral":
        tensors, config = reference("mixtral_fsdp2_dcp")
        prefix = "model.layers.1.block_sparse_moe.experts"
    else:
        tensors, config = load_output(qwen2_moe), json.loads((qwen2_moe / "config.json").read_text())
        prefix = "model.layers.1.mlp.experts"
    kept = {n: t for n, t in tensors.items() if not n.startswith(f"{prefix}.2.")}
    report = ckpttool.audit(write_hf(tmp_path / "hf", kept, config), data=False)
    assert errors(report) == {("expert-missing", f"{prefix}.2")}
    assert f"expert 2 of '{prefix}' is missing entirely (3 tensors; 3 of 4 experts present)" == message(report, "expert-missing")


@pytest.mark.parametrize(("name", "rows", "says"), [
    ("model.layers.0.self_attn.q_proj.weight", 30, "([30, 32] instead of [32, 32])"),
    ("model.layers.0.mlp.up_proj.weight", 128, "(dim 0 is 2x the expected 64: pieces concatenated 2 times, or a fused tensor that was not split)"),
])
def test_other_wrong_shapes(tmp_path, name, rows, says):
    tensors, config = reference("llama_fsdp2_dcp")
    tensors[name] = tensors[name].repeat(2, 1)[:rows].contiguous()
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config), data=False)
    assert errors(report) == {("shape-mismatch", name)}
    assert message(report, "shape-mismatch").endswith(says)


def test_missing_single_tensor(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    del tensors["model.layers.0.self_attn.k_proj.weight"]
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config), data=False)
    assert errors(report) == {("tensor-missing", "model.layers.0.self_attn.k_proj.weight")}


def test_unexpected_tensor_is_a_warning(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config), data=False)
    assert report.ok
    assert [(f.severity, f.code) for f in report.findings] == [("warning", "tensor-unexpected")]
    assert not report.strict().ok


# ---------------------------------------------------------------------------------- seeded faults: data


QWEN_MOE = "model.layers.{layer}.mlp.experts.{expert}.{w}.weight"
PROJECTIONS = {"mixtral": (MOE, ("w1", "w2", "w3")), "qwen2_moe": (QWEN_MOE, ("gate_proj", "up_proj", "down_proj"))}


def moe_family(family: str, qwen2_moe: Path) -> tuple[dict[str, torch.Tensor], dict]:
    if family == "mixtral":
        return reference("mixtral_fsdp2_dcp")
    return load_output(qwen2_moe), json.loads((qwen2_moe / "config.json").read_text())


@pytest.mark.parametrize("family", PROJECTIONS)
def test_two_identical_experts(tmp_path, family, qwen2_moe):
    tensors, config = moe_family(family, qwen2_moe)
    template, projections = PROJECTIONS[family]
    for w in projections:
        tensors[template.format(layer=0, expert=3, w=w)] = tensors[template.format(layer=0, expert=1, w=w)].clone()
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config))
    assert errors(report) == {("experts-identical", template.format(layer=0, expert=3, w=w)) for w in projections}
    name = template.format(layer=0, expert=3, w=projections[1])
    assert message(report, "experts-identical", name) == f"'{name}' is identical to '{template.format(layer=0, expert=1, w=projections[1])}'"


@pytest.mark.parametrize("family", PROJECTIONS)
def test_dead_expert(tmp_path, family, qwen2_moe):
    tensors, config = moe_family(family, qwen2_moe)
    template, projections = PROJECTIONS[family]
    for w in projections:
        tensors[template.format(layer=1, expert=2, w=w)].zero_()
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config))
    assert errors(report) == {("zero-tensor", template.format(layer=1, expert=2, w=w)) for w in projections}
    name = template.format(layer=1, expert=2, w=projections[0])
    numel = tensors[name].numel()
    assert message(report, "zero-tensor", name) == f"'{name}' is all zeros (expert 2 is dead: {numel} elements)"


@pytest.mark.parametrize(("value", "code", "says"), [(math.nan, "nan", "holds 2 NaN values of 1024"),
                                                     (math.inf, "inf", "holds 2 infinite values of 1024")])
def test_nan_and_inf(tmp_path, value, code, says):
    tensors, config = reference("llama_fsdp2_dcp")
    name = "model.layers.1.self_attn.q_proj.weight"
    tensors[name][3, 4] = value
    tensors[name][7, 1] = -value
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config))
    assert errors(report) == {(code, name)}
    assert says in message(report, code, name)


def test_zero_filled_matrix_and_constant_matrix(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    tensors["model.layers.0.mlp.up_proj.weight"].zero_()
    tensors["model.layers.1.mlp.up_proj.weight"].fill_(0.5)
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config))
    assert errors(report) == {("zero-tensor", "model.layers.0.mlp.up_proj.weight")}
    assert message(report, "constant-tensor") == "'model.layers.1.mlp.up_proj.weight' is 0.5 everywhere (2048 elements)"


def test_layer_outlier_is_a_warning(tmp_path, qwen2_moe):
    tensors = load_output(qwen2_moe)
    config = json.loads((qwen2_moe / "config.json").read_text())
    name = "model.layers.2.self_attn.o_proj.weight"
    tensors[name] = tensors[name] * 100
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config))
    assert report.ok
    warnings = [f for f in report.findings if f.severity == "warning"]
    assert [(f.code, f.tensor) for f in warnings] == [("norm-outlier", name)]
    assert "x the median" in warnings[0].message and "over 4 layers" in warnings[0].message


def test_one_tensor_in_another_dtype(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    name = "model.layers.0.input_layernorm.weight"
    tensors[name] = tensors[name].to(torch.bfloat16)
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config), data=False)
    assert errors(report) == {("dtype-mix", name)}
    assert message(report, "dtype-mix") == f"'{name}' is BF16, but 20 of 21 floating-point tensors are F32"


def test_config_dtype_disagreeing_with_weights(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    config["dtype"] = "bfloat16"
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config), data=False)
    assert report.ok
    assert message(report, "config-dtype") == "config.json says dtype bfloat16, but the weights are F32"


# ------------------------------------------------------------------------------------ tied embeddings


def test_tied_flag_with_a_different_head(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    config["tie_word_embeddings"] = True
    hf = write_hf(tmp_path / "hf", tensors, config)
    report = ckpttool.audit(hf)
    assert errors(report) == {("tie-mismatch", HEAD)}
    assert "differs from 'model.embed_tokens.weight', but tie_word_embeddings is true" in message(report, "tie-mismatch")
    headers_only = ckpttool.audit(hf, data=False)
    assert headers_only.ok and message(headers_only, "tie-mismatch").endswith("(data not checked)")


def test_tied_flag_with_an_equal_head_is_info(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    config["tie_word_embeddings"] = True
    tensors[HEAD] = tensors[EMBED].clone()
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config))
    assert report.ok
    assert [(f.code, f.tensor) for f in report.findings] == [("tied-copy", HEAD)]


def test_untied_flag_with_no_head(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    del tensors[HEAD]
    report = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config), data=False)
    assert errors(report) == {("tie-mismatch", HEAD)}
    assert "transformers would initialise a random output layer" in message(report, "tie-mismatch")


# ---------------------------------------------------------------------------------------- index and files


def sharded_llama(tmp_path: Path) -> Path:
    tensors, config = reference("llama_fsdp2_dcp")
    return write_hf(tmp_path / "hf", tensors, config, shards=2)


def edit_index(hf: Path, edit) -> None:
    path = hf / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    edit(index)
    path.write_text(json.dumps(index))


def test_clean_sharded_directory(tmp_path):
    assert ckpttool.audit(sharded_llama(tmp_path), data=False).findings == ()


def test_index_naming_a_missing_file(tmp_path):
    hf = sharded_llama(tmp_path)
    edit_index(hf, lambda index: index["weight_map"].update({"model.norm.weight": "model-00003-of-00002.safetensors"}))
    report = ckpttool.audit(hf, data=False)
    assert ("index-missing-file", "model.norm.weight") in errors(report)
    assert message(report, "index-missing-file") == (
        "'model.safetensors.index.json' puts 'model.norm.weight' in 'model-00003-of-00002.safetensors', which does not exist"
    )
    assert [f.file for f in report.findings if f.code == "index-missing-file"] == ["model-00003-of-00002.safetensors"]


def test_index_with_wrong_total_size(tmp_path):
    hf = sharded_llama(tmp_path)
    edit_index(hf, lambda index: index["metadata"].update({"total_size": 12}))
    report = ckpttool.audit(hf, data=False)
    assert errors(report) == {("index-total-size", None)}
    assert message(report, "index-total-size").startswith(
        "'model.safetensors.index.json': metadata.total_size is 12, but its tensors hold "
    )


def test_index_putting_a_tensor_in_the_wrong_file(tmp_path):
    hf = sharded_llama(tmp_path)
    index = json.loads((hf / "model.safetensors.index.json").read_text())
    name = "model.norm.weight"
    other = next(f for f in set(index["weight_map"].values()) if f != index["weight_map"][name])
    edit_index(hf, lambda index: index["weight_map"].update({name: other}))
    report = ckpttool.audit(hf, data=False)
    assert ("index-wrong-file", name) in errors(report)
    assert "but that file has no such tensor; it is in" in message(report, "index-wrong-file")


@pytest.mark.parametrize("path", ["../outside.safetensors", "/etc/passwd", "link.safetensors"])
def test_index_naming_a_file_outside(tmp_path, path):
    hf = sharded_llama(tmp_path)
    (tmp_path / "outside.safetensors").write_bytes((hf / "model-00001-of-00002.safetensors").read_bytes())
    (hf / "link.safetensors").symlink_to(tmp_path / "outside.safetensors")
    edit_index(hf, lambda index: index["weight_map"].update({"model.norm.weight": path}))
    report = ckpttool.audit(hf, data=False)
    assert ("index-outside", None) in {(f.code, None) for f in report.errors}
    assert [f.file for f in report.findings if f.code == "index-outside"] == [path]


def test_tensor_in_two_files_and_unlisted_file(tmp_path):
    hf = sharded_llama(tmp_path)
    save_file({"model.norm.weight": torch.ones(32)}, str(hf / "extra.safetensors"))
    edit_index(hf, lambda index: index["weight_map"].update({"extra": "extra.safetensors"}))
    report = ckpttool.audit(hf, data=False)
    assert ("tensor-duplicated", "model.norm.weight") in errors(report)
    (hf / "stray.safetensors").write_bytes((hf / "extra.safetensors").read_bytes())
    report = ckpttool.audit(hf, data=False)
    assert [f.file for f in report.findings if f.code == "file-unreferenced"] == ["stray.safetensors"]


def test_tensor_in_a_file_but_not_in_the_index(tmp_path):
    hf = sharded_llama(tmp_path)
    edit_index(hf, lambda index: index["weight_map"].pop("model.norm.weight"))
    report = ckpttool.audit(hf, data=False)
    assert report.ok is False  # the architecture still misses it
    assert message(report, "tensor-unlisted", "model.norm.weight").endswith("but not in 'model.safetensors.index.json'; transformers will not load it")
    assert ("tensor-missing", "model.norm.weight") in errors(report)


def test_index_that_is_not_json(tmp_path):
    hf = sharded_llama(tmp_path)
    (hf / "model.safetensors.index.json").write_text("{not json")
    report = ckpttool.audit(hf, data=False)
    assert report.findings[0].code == "index-invalid"
    assert report.findings[0].message.startswith("'model.safetensors.index.json': cannot read: Expecting property name")


def test_no_tensors_at_all(tmp_path):
    hf = tmp_path / "hf"
    hf.mkdir()
    save_file({}, str(hf / "model.safetensors"))
    report = ckpttool.audit(hf)
    assert errors(report) == {("no-weights", None)}
    assert message(report, "no-weights") == f"'{hf}' holds no model tensors"


def test_truncated_shard_is_a_header_finding(tmp_path):
    hf = sharded_llama(tmp_path)
    shard = hf / "model-00002-of-00002.safetensors"
    shard.write_bytes(shard.read_bytes()[:100])
    report = ckpttool.audit(hf, data=False)
    assert [(f.code, f.file) for f in report.findings if f.code == "header-invalid"] == [("header-invalid", shard.name)]


# ------------------------------------------------------------------------------------ sharded sources


def test_missing_rank_file_is_a_coverage_finding_per_tensor(copy_fixture):
    src = copy_fixture("llama_tp2_dcp")
    (src / "__1_0.distcp").unlink()
    report = ckpttool.audit(src)
    assert not report.ok
    coverage = [f for f in report.findings if f.code == "coverage"]
    assert {f.tensor for f in coverage} >= {EMBED, HEAD}
    assert {f.file for f in coverage} == {"__1_0.distcp"}
    assert "rows 501..1001 covered by no piece" in message(report, "coverage", EMBED)


def test_recorded_padding_and_diverging_replicas(tmp_path):
    norm = torch.linspace(0.5, 1.5, 8)
    for rank in range(2):
        specs = {
            "embed": PieceSpec.split((12, 8), dim=0, index=rank, count=2, true_size=10, tp_rank=rank),
            "norm": PieceSpec.replicated((8,)),
        }
        local = {"embed": torch.randn(6, 8), "norm": norm + (0.25 if rank == 1 else 0.0)}
        save_shard(local, specs, tmp_path / "ckpt", rank=rank, world_size=2)
    report = ckpttool.audit(tmp_path / "ckpt")
    assert errors(report) == {("replica-divergence", "norm")}
    assert "(max |difference| 0.25)" in message(report, "replica-divergence")
    assert message(report, "padding-recorded", "embed") == (
        "'embed': dim 0 padded to 12, true size 10; a merge strips rows 10..12"
    )
    assert message(report, "no-config").startswith("no config.json found")


def test_skipped_optimizer_state_is_a_note(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.randn(4, 4), "optim": {"state": {"w": {"exp_avg": torch.zeros(4, 4)}}}}
    with pytest.warns(UserWarning):
        dcp.save(state, checkpoint_id=str(tmp_path / "dcp"))
    report = ckpttool.audit(tmp_path / "dcp")
    assert report.ok
    assert message(report, "source-note") == "skipped 1 optimizer/training-state tensors"


# ------------------------------------------------------------------------------------- report and codes


def test_json_document_and_codes(tmp_path):
    tensors, config = reference("llama_fsdp2_dcp")
    tensors[EMBED] = padded_embedding(1024)
    doc = ckpttool.audit(write_hf(tmp_path / "hf", tensors, config)).to_json()
    assert set(doc) == {"findings", "causes", "summary", "tensors"}
    assert doc["findings"][0] == {
        "code": "vocab-padding-not-stripped", "severity": "error", "tensor": EMBED, "file": None,
        "message": doc["findings"][0]["message"],
    }
    assert doc["summary"]["verdict"] == "fail" and doc["summary"]["errors"] == 1
    assert len(doc["tensors"]) == 21 and all(len(t["fingerprint"]) == 64 for t in doc["tensors"])


def test_every_code_is_documented_in_the_readme():
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    for code, (severity, _) in CODES.items():
        assert f"| `{code}` | {severity} |" in readme, code


def test_headers_only_reads_no_tensor_data(tmp_path, monkeypatch):
    tensors, config = reference("llama_fsdp2_dcp")
    hf = write_hf(tmp_path / "hf", tensors, config)
    import ckpttool.execute.reference

    def refuse(*args, **kwargs):
        raise AssertionError("tensor data read with data=False")

    monkeypatch.setattr(ckpttool.execute.reference.PieceLoader, "_bytes", refuse)
    assert ckpttool.audit(hf, data=False).ok
