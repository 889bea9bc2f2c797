"""verify: a converted model loads strictly in transformers, runs, and computes what its reference computes.

The models are tiny seeded Llamas built from a transformers config; the faults are the ones weight-level checks
cannot see: q/k projections permuted within their heads (as HF <-> Meta RoPE conversions do) keep every shape
and statistic.
"""

from __future__ import annotations

import json
import zlib
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig

from ckpttool.errors import ArgumentError, ConfigError, SourceError
from ckpttool.commands.verify import verify
from ckpttool.verify import SENTENCE, TOLERANCES
from conftest import fixture_dir

SMALL = dict(vocab_size=1001, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)


def build(**overrides) -> torch.nn.Module:
    """Every tensor distinct random data (norms around 1), the same on every run."""
    model = AutoModelForCausalLM.from_config(LlamaConfig(**{**SMALL, **overrides})).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
            noise = 0.05 * torch.randn(tensor.shape, generator=g)
            tensor.copy_(1 + noise if name.endswith("norm.weight") else noise)
    return model


def permute_rope(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows permuted within each head as the HF <-> Meta Llama conversion does (interleaved <-> halves)."""
    rows, cols = w.shape
    return w.view(heads, rows // heads // 2, 2, cols).transpose(1, 2).reshape(rows, cols)


def save(model, path: Path, dtype: torch.dtype = torch.float32, permuted: bool = False) -> Path:
    model = build().to(dtype) if dtype != torch.float32 else model
    if permuted:
        with torch.no_grad():
            for layer in model.model.layers:
                attn = layer.self_attn.q_proj.weight, layer.self_attn.k_proj.weight
                attn[0].copy_(permute_rope(attn[0], SMALL["num_attention_heads"]))
                attn[1].copy_(permute_rope(attn[1], SMALL["num_key_value_heads"]))
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("verify")
    return {
        "ref": save(build(), root / "ref"),
        "copy": save(build(), root / "copy"),
        "permuted": save(build(), root / "permuted", permuted=True),
        "bf16": save(None, root / "bf16", torch.bfloat16),
        "bf16-permuted": save(None, root / "bf16-permuted", torch.bfloat16, permuted=True),
    }


def test_equal_models_verify_equal(models):
    result = verify(models["copy"], against=models["ref"])
    assert result.ok, result.problems
    assert result.comparison.max_abs == 0 and result.comparison.top1 == 1.0 and result.comparison.kl == 0
    assert result.input_from == "16 fixed ids (no tokenizer)"
    assert result.input_ids == tuple((7919 * i + 13) % 1001 for i in range(16))


def test_a_qk_rope_permutation_is_caught_though_no_weight_statistic_changes(models):
    ref, bad = load_file(models["ref"] / "model.safetensors"), load_file(models["permuted"] / "model.safetensors")
    changed = [k for k in ref if not torch.equal(ref[k], bad[k])]
    assert changed and all("q_proj" in k or "k_proj" in k for k in changed)
    for k in changed:  # same shape, same multiset of values: a weight-level check sees nothing
        assert ref[k].shape == bad[k].shape and torch.equal(ref[k].flatten().sort().values, bad[k].flatten().sort().values)
    result = verify(models["permuted"], against=models["ref"])
    assert not result.ok
    c = result.comparison
    assert c.top1 >= 0.8  # top-1 mostly agrees: not a verdict on its own
    assert 1e-2 < c.max_rel < 0.2 and c.max_rel > 1000 * TOLERANCES["float32"].max_rel
    assert any(p.startswith("differs: max |Δlogit| is") for p in result.problems)
    assert any("KL" in p for p in result.problems) and any("cosine" in p for p in result.problems)


def test_a_bf16_copy_passes_its_tolerance_and_a_permuted_bf16_copy_does_not(models):
    good = verify(models["bf16"], against=models["ref"])
    assert good.output.dtype == "bfloat16" and good.reference.dtype == "float32"
    assert good.comparison.tolerance == TOLERANCES["bfloat16"]
    assert good.ok, good.problems
    assert 0 < good.comparison.max_rel < TOLERANCES["bfloat16"].max_rel
    bad = verify(models["bf16-permuted"], against=models["ref"])
    assert not bad.ok and bad.comparison.tolerance == TOLERANCES["bfloat16"]
    assert any(p.startswith("differs: largest KL divergence") for p in bad.problems)
    # under float32's tolerance the plain bf16 copy differs: the tolerance follows the dtypes compared
    assert not verify(models["bf16"], against=models["ref"], tolerance=TOLERANCES["float32"]).ok


def test_a_float_tolerance_replaces_the_relative_bound_only(models):
    result = verify(models["permuted"], against=models["ref"], tolerance=0.5)
    assert result.comparison.tolerance.max_rel == 0.5
    assert not any("max |Δlogit|" in p for p in result.problems) and not result.ok  # cosine and KL still fail


def test_strict_loading_names_missing_unexpected_and_mismatched_tensors(models, tmp_path):
    out = tmp_path / "damaged"
    out.mkdir()
    for f in ("config.json", "generation_config.json"):
        (out / f).write_bytes((models["ref"] / f).read_bytes())
    tensors = load_file(models["ref"] / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    tensors["model.layers.0.self_attn.rotary_extra.weight"] = torch.ones(2, 2)
    tensors["model.norm.weight"] = torch.ones(16)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    result = verify(out)
    assert not result.ok
    assert ("'model.layers.1.mlp.up_proj.weight': LlamaForCausalLM has this parameter and the checkpoint does not "
            "(it was left at its random initialisation)") in result.problems
    assert ("'model.layers.0.self_attn.rotary_extra.weight': in the checkpoint, but LlamaForCausalLM has no such "
            "parameter (transformers drops it)") in result.problems
    assert "'model.norm.weight': shape [16] in the checkpoint, LlamaForCausalLM expects [32]" in result.problems


def test_mtp_layers_transformers_ignores_are_a_note_not_an_error():
    result = verify(fixture_dir("deepseek_v3_hf_mtp") / "checkpoint")
    assert result.ok, result.problems
    assert result.output.architecture == "DeepseekV3ForCausalLM"
    assert any("multi-token-prediction" in n and "'model.layers.3." in n for n in result.output.notes)


def test_the_checkpoints_tokenizer_encodes_a_fixed_sentence_and_a_sharded_reference_is_merged():
    ref = fixture_dir("llama_fsdp2_dcp")
    result = verify(ref / "reference", against=ref / "checkpoint")  # a DCP reference: merged to a temporary dir
    assert result.ok, result.problems
    expected = AutoTokenizer.from_pretrained(ref / "reference")(SENTENCE)["input_ids"]
    assert list(result.input_ids) == expected and result.input_from.startswith("a fixed sentence, tokenized by")
    assert result.reference.path == str(ref / "checkpoint")


def test_text_and_token_options(models, tmp_path):
    text = tmp_path / "prompt.txt"
    text.write_text("hello world, once more")
    ref = fixture_dir("llama_fsdp2_dcp") / "reference"
    result = verify(ref, text=text)
    assert result.ok and result.input_from == f"the text of '{text}', tokenized by '{ref}'"
    assert verify(ref, tokens=5).input_ids == (13, 925, 836, 747, 658)  # (7919 i + 13) mod 1001, not the tokenizer's
    with pytest.raises(SourceError, match="has no tokenizer to encode"):
        verify(models["ref"], text=text)
    with pytest.raises(ArgumentError, match="tokens= and text= both given"):
        verify(models["ref"], text=text, tokens=3)


def test_non_finite_and_constant_logits_fail(models, tmp_path):
    for name, value, message in (("nan", float("nan"), "NaN or infinite"), ("zero", 0.0, "zero variance")):
        out = tmp_path / name
        out.mkdir()
        (out / "config.json").write_bytes((models["ref"] / "config.json").read_bytes())
        tensors = load_file(models["ref"] / "model.safetensors")
        tensors["lm_head.weight"] = torch.full_like(tensors["lm_head.weight"], value)
        save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
        result = verify(out)
        assert not result.ok and any(message in p for p in result.problems), result.problems


def test_an_architecture_transformers_lacks_is_refused_by_name(models, tmp_path):
    out = tmp_path / "odd"
    out.mkdir()
    config = json.loads((models["ref"] / "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (out / "config.json").write_text(json.dumps(config))
    (out / "model.safetensors").write_bytes((models["ref"] / "model.safetensors").read_bytes())
    with pytest.raises(ConfigError, match="architectures names 'NoSuchForCausalLM', which transformers .* does not have"):
        verify(out)


def test_cli_exit_codes_and_messages(models, cli, tmp_path):
    ok = cli("verify", models["copy"], "--against", models["ref"])
    assert ok.exit_code == 0 and "verified: equal to the reference within tolerance" in ok.stdout
    bad = cli("verify", models["permuted"], "--against", models["ref"], "--json")
    assert bad.exit_code == 3
    doc = json.loads(bad.stdout)
    assert doc["status"] == "failed" and doc["comparison"]["top1_agreement"] >= 0.8
    assert any(p.startswith("differs: max |Δlogit|") for p in doc["problems"])
    missing = cli("verify", tmp_path / "nothing")
    assert missing.exit_code == 1 and f"Error: '{tmp_path / 'nothing'}': no such directory" in missing.stderr
    assert "Traceback" not in missing.output
    no_config = tmp_path / "empty"
    no_config.mkdir()
    result = cli("verify", no_config)
    assert result.exit_code == 1 and "config.json' not found: verify needs the model's config.json" in result.stderr
    usage = cli("verify", models["ref"], "--tokens", "3", "--text", "x")
    assert usage.exit_code == 2 and "--tokens and --text are exclusive" in usage.stderr


PEAK = r"""
import re, sys, json
def peak_mib():
    return int(re.search(r"VmHWM:\s+(\d+)", open("/proc/self/status").read()).group(1)) // 1024
import torch, transformers
from ckpttool.commands.verify import verify
base = peak_mib()
result = verify(sys.argv[1], tokens=16, stream=sys.argv[2] == "stream")
print(json.dumps({"ok": result.ok, "base": base, "peak": peak_mib()}))
"""


def save_large(path: Path) -> int:
    """A ~390 MB float32 Llama of random weights in 100 MB files (24 layers of 16 MB), as save_pretrained lays it out."""
    config = LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=24,
                         num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=64,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"], dtype="float32")
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    path.mkdir()
    config.to_json_file(path / "config.json")
    g = torch.Generator().manual_seed(0)
    files: list[dict[str, torch.Tensor]] = [{}]
    for name, shape in shapes.items():
        if sum(t.numel() for t in files[-1].values()) * 4 > 100_000_000:
            files.append({})
        files[-1][name] = torch.ones(shape) if name.endswith("norm.weight") else 0.02 * torch.randn(shape, generator=g)
    weight_map = {}
    for i, tensors in enumerate(files):
        file = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, path / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
    total = sum((path / f).stat().st_size for f in set(weight_map.values()))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))
    return total


def peak_above_imports(path: Path, mode: str) -> int:
    """verify in a fresh process: its peak resident memory above what importing torch and transformers took, MiB."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", PEAK, str(path), mode], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "OMP_NUM_THREADS": "1"})
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["ok"], out.stdout
    return doc["peak"] - doc["base"]


def test_verify_streams_a_model_far_larger_than_the_memory_it_takes(tmp_path):
    size_mib = save_large(tmp_path / "large") // 2**20
    assert size_mib > 350
    streamed = peak_above_imports(tmp_path / "large", "stream")
    whole = peak_above_imports(tmp_path / "large", "whole")
    assert whole > size_mib  # the control: loaded whole, the model is resident
    # streamed: transformers' and accelerate's fixed ~130 MiB, plus one 16 MB decoder layer at a time
    assert streamed < size_mib / 2, (streamed, whole, size_mib)


def dcp_source(model, directory: Path) -> Path:
    import warnings

    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "no process group: saving in a single process"
        dcp.save(model.state_dict(), checkpoint_id=str(directory))
    model.config.to_json_file(directory / "config.json")
    return directory


def test_merge_verify_forward_publishes_a_sound_model_and_nothing_else(cli, tmp_path):
    from ckpttool import merge
    from ckpttool.errors import ForwardError
    from conftest import assert_failed_cleanly

    good = cli("merge", dcp_source(build(), tmp_path / "good"), tmp_path / "good-out", "--verify-forward", "-q")
    assert good.exit_code == 0, good.output
    assert verify(tmp_path / "good-out", against=tmp_path / "good").ok
    broken = build()
    with torch.no_grad():
        broken.lm_head.weight[7, 3] = float("inf")  # every header and shape is right; the logits are not
    source = dcp_source(broken, tmp_path / "broken")
    with pytest.raises(ForwardError, match=r"fails its forward check \(1 problem\); nothing was published at"):
        merge(source, tmp_path / "api-out", verify_forward=True)
    assert not (tmp_path / "api-out").exists()
    result = cli("merge", source, tmp_path / "cli-out", "--verify-forward")
    assert_failed_cleanly(result, tmp_path / "cli-out", "fails its forward check",
                          "logits: 16 of 16016 values are NaN or infinite (first at position 0)")
    assert cli("merge", source, tmp_path / "unchecked", "-q").exit_code == 0  # the audit of headers alone passes it


def test_unreadable_weights_are_named_before_transformers_opens_them(models, cli, tmp_path):
    out = tmp_path / "truncated"
    out.mkdir()
    (out / "config.json").write_bytes((models["ref"] / "config.json").read_bytes())
    result = cli("verify", out)
    assert result.exit_code == 1
    assert f"Error: '{out}': no safetensors weights (model.safetensors or an index and its files)" in result.stderr
    (out / "model.safetensors").write_bytes((models["ref"] / "model.safetensors").read_bytes()[:100_000])
    result = cli("verify", out)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"'{out / 'model.safetensors'}': tensor " in result.stderr and "the file is truncated" in result.stderr
