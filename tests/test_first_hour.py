"""The first hour of a new user: a merge that exits 0 must give something transformers loads, or say so once.

A source named in a convention of its own (Megatron-Core torch_dist, Megatron legacy, DeepSpeed MoE) with no config
to map its names is refused unless raw names are asked for (``--raw-names``, then warned about once); a PEFT
adapter, in the source, beside the base or in a subfolder, is refused rather than left out of the merge; ``-q``
prints nothing on success.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import ckpttool
from ckpttool.errors import ConfigError
from conftest import FIXTURES, assert_failed_cleanly, fixture_dir, load_output, tree_digest

LLAMA = fixture_dir("llama_tp2_dcp") / "checkpoint"
UNCHECKED = "tensor names are kept as the source recorded them and nothing was checked against an architecture"


def _megatron(tmp_path: Path, kind: str) -> Path:
    """The Megatron TP=2 PP=2 checkpoint (``torch_dist`` or ``legacy``) with no config.json in or next to it."""
    src = tmp_path / "run" / kind
    shutil.copytree(FIXTURES / "megatron_tp2_pp2" / kind, src)
    return src


def _refusal(src: Path, why: str = "no config.json was found in or next to it", convention: str = "Megatron-Core") -> str:
    return (f"'{src}': its tensors are named in the {convention} convention, not HuggingFace's, and {why}, so a merge "
            "would write names transformers cannot load. Pass --config path/to/config.json (the config of the "
            f"HuggingFace model) to write HuggingFace names, or --raw-names to keep the {convention} names")


def _api(message: str) -> str:
    return message.replace("--config path/to/config.json", "config='path/to/config.json'").replace("--raw-names", "raw_names=True")


def _warning(out: Path) -> str:
    return (f"warning: generic merge (no config.json found): the Megatron-Core {UNCHECKED}; transformers cannot load "
            f"'{out}' (merge again with --config path/to/config.json of the HuggingFace model for its names)\n")


# 1. names transformers cannot load ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["torch_dist", "legacy"])
def test_a_megatron_merge_without_config_is_refused_and_says_what_to_pass(cli, tmp_path, kind):
    src, out = _megatron(tmp_path, kind), tmp_path / "out"
    before = tree_digest(src)
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out)
    assert result.stderr == f"Error: {_refusal(src)}\n" and result.stdout == ""
    dry = cli("merge", src, "--dry-run")  # the dry run says what the merge would do: refuse
    assert dry.exit_code == 1 and dry.stderr == f"Error: {_refusal(src)}\n" and dry.stdout == ""
    with pytest.raises(ConfigError) as refused:
        ckpttool.merge(src, out)
    assert str(refused.value) == _api(_refusal(src))
    assert not out.exists() and tree_digest(src) == before


def test_a_deepspeed_moe_merge_without_config_is_refused(cli, tmp_path):
    src = tmp_path / "moe" / "checkpoint"
    shutil.copytree(fixture_dir("deepspeed_moe_zero2_ep2") / "checkpoint", src, ignore=shutil.ignore_patterns("config.json"))
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out)
    assert result.stderr == f"Error: {_refusal(src, convention='DeepSpeed MoE')}\n"


def test_megatron_names_a_config_transformers_cannot_build_leaves_unmapped_are_refused(cli, tmp_path):
    src, out = _megatron(tmp_path, "torch_dist"), tmp_path / "out"
    config = src.parent / "config.json"
    config.write_text(json.dumps({"model_type": "not-a-real-model", "vocab_size": 3}))
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out)
    why = f"transformers has no causal LM for the model_type 'not-a-real-model' of '{config}'"
    assert result.stderr == f"Error: {_refusal(src, why)}\n"


def test_nothing_a_config_maps_or_that_holds_hf_names_is_refused(cli, tmp_path):
    src = _megatron(tmp_path, "torch_dist")
    mapped = cli("merge", src, tmp_path / "mapped", "--config", FIXTURES / "megatron_tp2_pp2" / "config.json")
    assert mapped.exit_code == 0, mapped.output
    assert "warning:" not in mapped.stderr
    bare = tmp_path / "bare" / "checkpoint"  # DCP of a transformers model: its own names, a generic merge as before
    shutil.copytree(LLAMA, bare, ignore=shutil.ignore_patterns("config.json"))
    generic = cli("merge", bare, tmp_path / "generic")
    assert generic.exit_code == 0, generic.output
    assert (generic.stdout + generic.stderr).count("generic merge (") == 1
    assert "Megatron" not in generic.stderr


def test_raw_names_keep_megatron_names_and_warn_exactly_once(cli, tmp_path):
    src, out = _megatron(tmp_path, "torch_dist"), tmp_path / "out"
    result = cli("merge", src, out, "--raw-names")
    assert result.exit_code == 0, result.output
    assert _warning(out) in result.stderr
    said = result.stdout + result.stderr
    assert said.count("kept as") == 1 and said.count("generic merge (") == 1 and said.count("--config") == 1
    assert "decoder.final_layernorm.weight" in load_output(out)  # Megatron-Core's names, layers stacked
    doc = cli("merge", src, tmp_path / "doc", "--raw-names", "--json")
    assert json.loads(doc.stdout)["raw_names"] == "Megatron-Core"
    kept = ckpttool.merge(src, tmp_path / "api", raw_names=True)
    assert kept.raw_names == "Megatron-Core" and kept.generic
    quiet = cli("merge", src, tmp_path / "quiet", "--raw-names", "-q")  # -q: the warning alone
    assert quiet.exit_code == 0 and quiet.stdout == "" and quiet.stderr == _warning(tmp_path / "quiet")


# 2. PEFT adapters --------------------------------------------------------------------------------------------------

ADAPTER_REFUSAL = ("ckpttool fuses an adapter only when asked: {base} would write the base without it. Fuse it with "
                   "--adapter: ckpttool merge BASE OUT --adapter '{folder}', BASE a folder holding the base alone\n")


def _adapter(folder: Path, weights: str = "adapter_model.safetensors") -> Path:
    """What PEFT's save_pretrained writes for a LoRA adapter of the Llama fixture."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"]}))
    lora = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(4, 32),
            "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.zeros(32, 4)}
    if weights.endswith(".bin"):
        torch.save(lora, folder / weights)
    else:
        save_file(lora, folder / weights)
    return folder / weights


def _base(folder: Path) -> Path:
    shutil.copytree(fixture_dir("llama_hf_tp2") / "reference", folder)
    return folder


@pytest.mark.parametrize("weights", ["adapter_model.safetensors", "adapter_model.bin"])
def test_an_adapter_folder_is_refused_naming_its_weights(cli, tmp_path, weights):
    adapter, out = _adapter(tmp_path / "adapter", weights), tmp_path / "out"
    result = cli("merge", adapter.parent, out)
    assert_failed_cleanly(result, out)
    assert result.stderr == (f"Error: '{adapter}': a PEFT adapter (adapter_config.json beside it). "
                             + ADAPTER_REFUSAL.format(base="a merge", folder=adapter.parent))


def test_a_base_holding_an_adapter_is_refused_even_with_its_format_named(cli, tmp_path):
    base = _base(tmp_path / "model")
    adapter = _adapter(base)
    before = tree_digest(base)
    for extra in ((), ("--format", "hf")):
        out = tmp_path / "out"
        result = cli("merge", base, out, *extra)
        assert_failed_cleanly(result, out)
        assert result.stderr == (f"Error: '{adapter}': a PEFT adapter (adapter_config.json beside it). "
                                 + ADAPTER_REFUSAL.format(base="a merge", folder=adapter.parent))
    assert tree_digest(base) == before


def test_the_folder_above_an_adapter_is_refused_rather_than_pointing_at_the_base(cli, tmp_path):
    run = tmp_path / "run"
    base = _base(run / "base")
    adapter = _adapter(run / "lora")
    out = tmp_path / "out"
    result = cli("merge", run, out)
    assert_failed_cleanly(result, out)
    assert result.stderr == (f"Error: '{adapter}': a PEFT adapter (adapter_config.json beside it). "
                             + ADAPTER_REFUSAL.format(base=f"a merge of '{base}'", folder=adapter.parent))
    assert "give it as the source" not in result.stderr


def test_adapter_config_without_adapter_weights_is_no_adapter(cli, tmp_path):
    base = _base(tmp_path / "model")
    (base / "adapter_config.json").write_text("{}")  # a stray config names no weights: the base merges as before
    assert cli("merge", base, tmp_path / "out", "-q").exit_code == 0


# 3. -q --------------------------------------------------------------------------------------------------------------


def test_quiet_prints_nothing_on_success(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", LLAMA, out, "-q")
    assert result.exit_code == 0, result.output
    assert result.stdout == "" and result.stderr == ""
    assert (out / "model.safetensors").is_file()
    dry = cli("merge", LLAMA, "--dry-run", "-q")
    assert dry.exit_code == 0 and dry.stdout == "" and dry.stderr == ""


def test_quiet_still_prints_errors(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", tmp_path / "missing", out, "-q")
    assert_failed_cleanly(result, out)
    assert result.stderr == f"Error: '{tmp_path / 'missing'}': no such file or directory\n"
    assert result.stdout == ""
