"""verify on hostile checkpoints: it never runs code a checkpoint ships and never reads stdin; hostile config
values, oversized prompts and missing paths are bad input (exit 1, a message naming the file and the key or
option), refused before anything heavy runs.

The models are tiny seeded Llamas saved by transformers; the "code" a checkpoint ships is a module that, once
imported, writes a marker file: the tests assert that the marker never appears.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from ckpttool.errors import ArgumentError, ConfigError, SourceError
from ckpttool.commands.verify import verify
from ckpttool.verify import MAX_TOKENS, TEXT_LIMIT
from conftest import ROOT, fixture_dir

SMALL = dict(vocab_size=1001, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)

#: the module a hostile checkpoint ships: importing it leaves a marker file, the proof that its code ran
EVIL = """
import pathlib
pathlib.Path({marker!r}).write_text("checkpoint code ran")
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
class EvilConfig(LlamaConfig):
    model_type = "evil"
class EvilForCausalLM(LlamaForCausalLM):
    config_class = EvilConfig
class EvilTokenizer(PreTrainedTokenizerFast):
    pass
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A tiny Llama saved by transformers, the same on every run."""
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny") / "model"
    AutoModelForCausalLM.from_config(LlamaConfig(**SMALL)).eval().save_pretrained(path)
    return path


@pytest.fixture
def scratch(tmp_path, monkeypatch) -> Path:
    """verify's temporary folders go here, so a test can check that none is left behind."""
    folder = tmp_path / "scratch"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def copy(tiny: Path, dest: Path, **config_changes) -> Path:
    shutil.copytree(tiny, dest)
    if config_changes:
        config = json.loads((dest / "config.json").read_text())
        (dest / "config.json").write_text(json.dumps({**config, **config_changes}))
    return dest


def hostile(tiny: Path, dest: Path, marker: Path, *, config: dict | None = None,
            tokenizer_config: dict | None = None) -> Path:
    """``tiny`` with the evil module beside it and the given config changes and tokenizer config."""
    copy(tiny, dest, **(config or {}))
    (dest / "evil.py").write_text(EVIL.format(marker=str(marker)))
    if tokenizer_config is not None:
        shutil.copy(fixture_dir("llama_fsdp2_dcp") / "reference" / "tokenizer.json", dest / "tokenizer.json")
        (dest / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return dest


def run_cli(tmp_path: Path, *args: str, stdin: str = "y\n") -> subprocess.CompletedProcess:
    """``python -m ckpttool ARGS`` in a fresh process, answering "y" to any question on stdin; every cache
    transformers could write (its copies of remote code included) kept under ``tmp_path``."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "TMPDIR": str(tmp_path), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ckpttool", *map(str, args)], input=stdin, capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=300)


def no_code_ran(tmp_path: Path, marker: Path) -> None:
    assert not marker.exists(), "the checkpoint's code ran"
    assert not list((tmp_path / "hf").rglob("evil.py")), "transformers copied the checkpoint's code to run it"


# ------------------------------------------------------------------------------------------------ remote code


def test_a_config_auto_map_is_refused_unread_though_stdin_says_yes(tiny, tmp_path):
    marker = tmp_path / "PWNED"
    config = {"model_type": "evil", "architectures": None,
              "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilForCausalLM"}}
    model = hostile(tiny, tmp_path / "evil-model", marker, config=config)
    before = sorted(p.name for p in model.iterdir())
    result = run_cli(tmp_path, "verify", model)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"Error: '{model / 'config.json'}': \"auto_map\" names code shipped with the checkpoint" in result.stderr
    assert "ckpttool never runs checkpoint code" in result.stderr
    assert "Traceback" not in result.stderr and "[y/N]" not in result.stdout + result.stderr
    no_code_ran(tmp_path, marker)
    assert sorted(p.name for p in model.iterdir()) == before  # no __pycache__: evil.py was never imported


def test_a_tokenizer_auto_map_is_refused_unread_though_stdin_says_yes(tiny, tmp_path):
    marker = tmp_path / "PWNED"
    tokenizer_config = {"tokenizer_class": "EvilTokenizer", "auto_map": {"AutoTokenizer": [None, "evil.EvilTokenizer"]}}
    model = hostile(tiny, tmp_path / "evil-tokenizer", marker, tokenizer_config=tokenizer_config)
    result = run_cli(tmp_path, "verify", model)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"Error: '{model / 'tokenizer_config.json'}': \"auto_map\" names code shipped" in result.stderr
    assert "Traceback" not in result.stderr and "[y/N]" not in result.stdout + result.stderr
    no_code_ran(tmp_path, marker)
    assert not (model / "__pycache__").exists()


@pytest.mark.parametrize("file, doc, key", [
    ("config.json", {"text_config": {"auto_map": {"AutoConfig": "evil.EvilConfig"}}}, "text_config.auto_map"),
    ("processor_config.json", {"auto_map": {"AutoProcessor": "evil.EvilProcessor"}}, "auto_map"),
    ("preprocessor_config.json", {"auto_map": {"AutoImageProcessor": "evil.Evil"}}, "auto_map"),
    ("config.json", {"custom_pipelines": {"evil": {"impl": "evil.EvilPipeline"}}}, "custom_pipelines"),
])
def test_every_config_that_can_name_code_is_searched(tiny, tmp_path, cli, scratch, file, doc, key):
    marker = tmp_path / "PWNED"
    model = hostile(tiny, tmp_path / "model", marker)
    target = model / file
    existing = json.loads(target.read_text()) if target.exists() else {}
    target.write_text(json.dumps({**existing, **doc}))
    result = cli("verify", model)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"Error: '{target}': \"{key}\" names code shipped with the checkpoint" in result.stderr
    assert not marker.exists() and not list(scratch.iterdir())


def test_a_reference_with_an_auto_map_is_refused_before_anything_runs(tiny, tmp_path, cli, scratch):
    marker = tmp_path / "PWNED"
    out = copy(tiny, tmp_path / "out")
    ref = hostile(tiny, tmp_path / "ref", marker, config={"auto_map": {"AutoModelForCausalLM": "evil.EvilForCausalLM"}})
    result = cli("verify", out, "--against", ref)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"Error: '{ref / 'config.json'}': \"auto_map\" names code shipped" in result.stderr
    assert not marker.exists() and not list(scratch.iterdir())


def test_the_api_refuses_it_too_and_the_audit_never_runs_it(tiny, tmp_path, cli):
    marker = tmp_path / "PWNED"
    model = hostile(tiny, tmp_path / "model", marker,
                    config={"auto_map": {"AutoModelForCausalLM": "evil.EvilForCausalLM"}})
    with pytest.raises(ConfigError, match="never runs checkpoint code"):
        verify(model)
    # the audit builds the architecture through transformers' own class (trust_remote_code=False): it checks the
    # weights and runs nothing
    result = cli("audit", model, "--no-data")
    assert result.exit_code == 0, result.output
    assert not marker.exists()


# ------------------------------------------------------------------------------------------- hostile configs


@pytest.mark.parametrize("change, message", [
    ({"pad_token_id": 5000}, "pad_token_id is 5000, outside the vocabulary (vocab_size 1001: ids 0..1000)"),
    ({"pad_token_id": -1}, "pad_token_id is -1, outside the vocabulary"),
    ({"pad_token_id": "0"}, "pad_token_id is \"0\"; it must be a token id (an integer) or null"),
    ({"quantization_config": {"quant_method": "nosuch"}},
     "quantization_config.quant_method is 'nosuch', which transformers"),
    ({"quantization_config": {"bits": 4}}, "quantization_config has no \"quant_method\" string"),
    ({"attn_implementation": "flash_attention_2"}, "attn_implementation is \"flash_attention_2\"; verify runs the "
                                                   "model with torch's own kernels ('eager' or 'sdpa')"),
    ({"_attn_implementation": "flash_attention_2"}, "_attn_implementation is \"flash_attention_2\""),
    ({"_attn_implementation": "kernels-community/flash-attn"},
     "_attn_implementation is \"kernels-community/flash-attn\""),
    ({"experts_implementation": "deepgemm"}, "experts_implementation is \"deepgemm\""),
    ({"num_hidden_layers": -1}, "num_hidden_layers is -1; it must be a positive integer"),
    ({"num_hidden_layers": 0}, "num_hidden_layers is 0; it must be a positive integer"),
    ({"hidden_size": 32.5}, "hidden_size is 32.5; it must be a positive integer"),
    ({"num_hidden_layers": 10**9}, "num_hidden_layers is 1000000000, more than the 21 tensors the checkpoint stores"),
    ({"max_position_embeddings": 4}, "max_position_embeddings is 4, fewer than the 16 tokens verify feeds; feed at "
                                     "most 4 (--tokens 4)"),
    ({"text_config": {"pad_token_id": 99, "vocab_size": 10}}, "text_config.pad_token_id is 99, outside the vocabulary"),
    ({"dtype": "nosuch"},
     "dtype is \"nosuch\"; it must name a torch dtype (\"float32\", \"bfloat16\", ...) or be \"auto\""),
    ({"torch_dtype": 5}, "torch_dtype is 5; it must name a torch dtype"),
    # what transformers' own validators reject, in their words (which name the field)
    ({"num_attention_heads": 5}, "transformers rejects this config (StrictDataclassClassValidationError: Class "
                                 "validation error for validator 'validate_architecture': ValueError: The hidden size "
                                 "(32) is not a multiple of the number of attention heads (5).)"),
    ({"rms_norm_eps": "x"}, "Field 'rms_norm_eps' expected float, got str"),
    ({"model_type": "nosuch", "architectures": None}, "transformers rejects this config (ValueError: The checkpoint "
                                                      "you are trying to load has model type `nosuch`"),
])
def test_hostile_config_values_are_bad_input_named_by_key(tiny, tmp_path, cli, scratch, change, message):
    model = copy(tiny, tmp_path / "model", **change)
    before = {p.name: p.read_bytes() for p in model.iterdir()}
    result = cli("verify", model)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output and "internal error" not in result.output
    assert f"Error: '{model / 'config.json'}': " in result.stderr and message in result.stderr, result.stderr
    assert {p.name: p.read_bytes() for p in model.iterdir()} == before and not list(scratch.iterdir())


def test_a_name_transformers_does_not_know_is_named(tiny, tmp_path, cli, scratch):
    for change in ({"hidden_act": "nosuch"}, {"rope_parameters": {"rope_type": "nosuch"}}):
        model = copy(tiny, tmp_path / f"model-{len(list(tmp_path.iterdir()))}", **change)
        result = cli("verify", model)
        assert result.exit_code == 1 and "Traceback" not in result.output and "internal error" not in result.output
        assert (f"Error: '{model}': transformers cannot load it as LlamaForCausalLM: its config names 'nosuch', "
                f"which transformers does not know") in result.stderr, result.stderr
    assert not list(scratch.iterdir())


def test_the_position_bound_follows_the_tokens_fed(tiny, tmp_path, cli):
    model = copy(tiny, tmp_path / "model", max_position_embeddings=4)
    assert cli("verify", model, "--tokens", "4").exit_code == 0
    result = cli("verify", model, "--tokens", "5")
    assert result.exit_code == 1 and "max_position_embeddings is 4, fewer than the 5 tokens" in result.stderr


def test_a_quantization_package_this_machine_lacks_is_named_by_key(tiny, tmp_path, cli, monkeypatch):
    import transformers.utils.import_utils as import_utils

    if import_utils.is_optimum_available():
        pytest.skip("optimum is installed: GPTQ would load")
    model = copy(tiny, tmp_path / "model", quantization_config={"quant_method": "gptq", "bits": 4})
    result = cli("verify", model)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (f"Error: '{model / 'config.json'}': transformers cannot load it as LlamaForCausalLM here: "
            f"quantization_config.quant_method 'gptq' needs a package that is not installed") in result.stderr


# ----------------------------------------------------------------------------------------------- bounded input


def test_a_text_over_the_limit_is_refused_unread(tiny, tmp_path, cli, scratch):
    ref = fixture_dir("llama_fsdp2_dcp") / "reference"
    text = tmp_path / "corpus.txt"
    with open(text, "wb") as f:
        f.truncate(100 * 2**20)  # 100 MB, sparse: nothing of it is read
    result = cli("verify", ref, "--text", text)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert (f"Error: text file '{text}' is {100 * 2**20} bytes; verify reads at most {TEXT_LIMIT} bytes (1 MiB) of "
            f"text (--text takes a prompt of at most 1 MiB and {MAX_TOKENS} tokens)") in result.stderr
    edge = tmp_path / "edge.txt"
    edge.write_bytes(b"a" * (TEXT_LIMIT + 1))
    assert f"text file '{edge}' is {TEXT_LIMIT + 1} bytes" in cli("verify", ref, "--text", edge).stderr
    assert text.stat().st_size == 100 * 2**20 and not list(scratch.iterdir())


def test_a_text_of_too_many_tokens_and_a_binary_text_are_refused(tmp_path, cli, scratch):
    ref = fixture_dir("llama_fsdp2_dcp") / "reference"
    text = tmp_path / "long.txt"
    text.write_text("hello world " * MAX_TOKENS)
    result = cli("verify", ref, "--text", text)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"the text of '{text}' to " in result.stderr
    bound = f"tokens; verify feeds at most {MAX_TOKENS} (--text takes a prompt of at most {MAX_TOKENS} tokens)"
    assert bound in result.stderr
    binary = tmp_path / "binary.txt"
    binary.write_bytes(b"\xff\xfe\x00bad")
    result = cli("verify", ref, "--text", binary)
    assert result.exit_code == 1 and "internal error" not in result.output
    assert f"Error: text file '{binary}': not UTF-8 text (byte 0: invalid start byte)" in result.stderr
    assert not list(scratch.iterdir())


def test_the_token_count_is_bounded_on_the_command_line_and_in_the_api(tiny, cli):
    result = cli("verify", tiny, "--tokens", str(MAX_TOKENS + 1))
    assert result.exit_code == 2 and "--tokens" in result.stderr and f"1<=x<={MAX_TOKENS}" in result.stderr
    for tokens in (0, MAX_TOKENS + 1, 10**9):
        with pytest.raises(ArgumentError, match=rf"tokens={tokens}: feed 1 to {MAX_TOKENS} tokens"):
            verify(tiny, tokens=tokens)


# ------------------------------------------------------------------------------------- paths before anything


@pytest.fixture
def nothing_heavy(monkeypatch) -> list[str]:
    """Record any merge of a reference or any model load: a path error must come before both."""
    import importlib

    calls: list[str] = []
    # by module object: the package binds the API's functions over its submodules' names (ckpttool.verify)
    merging, verifying = (importlib.import_module(m) for m in ("ckpttool.commands.merge", "ckpttool.commands.verify"))
    monkeypatch.setattr(merging, "merge", lambda *a, **k: calls.append("merge"))
    monkeypatch.setattr(verifying, "run_forward", lambda *a, **k: calls.append("forward"))
    return calls


def test_a_missing_reference_is_named_before_anything_is_loaded(tiny, tmp_path, cli, scratch, nothing_heavy):
    missing = tmp_path / "no-reference"
    result = cli("verify", tiny, "--against", missing)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"Error: reference '{missing}': no such file or directory" in result.stderr
    assert nothing_heavy == [] and not missing.exists() and not list(scratch.iterdir())


def test_a_missing_output_or_text_is_named_before_a_sharded_reference_is_merged(tmp_path, cli, scratch, nothing_heavy):
    sharded = fixture_dir("llama_fsdp2_dcp") / "checkpoint"
    missing = tmp_path / "no-output"
    result = cli("verify", missing, "--against", sharded)
    assert result.exit_code == 1 and f"Error: '{missing}': no such directory" in result.stderr
    ref = fixture_dir("llama_fsdp2_dcp") / "reference"
    text = tmp_path / "no-prompt.txt"
    result = cli("verify", ref, "--against", sharded, "--text", text)
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"Error: text file '{text}': cannot read: No such file or directory" in result.stderr
    assert nothing_heavy == [] and not missing.exists() and not text.exists() and not list(scratch.iterdir())


def test_a_sound_model_still_verifies(tiny, tmp_path, scratch):
    """The refusals leave the ordinary run alone: a saved Llama, its config untouched, verifies against itself."""
    result = verify(tiny, against=copy(tiny, tmp_path / "ref"))
    assert result.ok, result.problems
    assert not list(scratch.iterdir())


def test_hostile_values_raise_config_errors_in_the_api(tiny, tmp_path):
    with pytest.raises(ConfigError, match="pad_token_id is 5000"):
        verify(copy(tiny, tmp_path / "pad", pad_token_id=5000))
    with pytest.raises(SourceError, match="no tokenizer to encode"):
        text = tmp_path / "t.txt"
        text.write_text("hi")
        verify(tiny, text=text)


def test_a_tokenizer_that_does_not_parse_is_named(tiny, tmp_path, cli, scratch):
    model = copy(tiny, tmp_path / "model")
    (model / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    (model / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": 7}}')
    result = cli("verify", model, "--json")
    assert result.exit_code == 1 and "Traceback" not in result.output and "internal error" not in result.output
    assert f"Error: '{model}': its tokenizer does not load: " in result.stderr
    assert json.loads(result.stdout)["status"] == "error" and not list(scratch.iterdir())
