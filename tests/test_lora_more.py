"""More of issue 27: ``diff FUSED BASE --adapter ADAPTER`` (B fused on the fly, as ``merge --adapter`` fuses it, and
compared with A), on PEFT's own outputs (fixtures/make_lora.py: ``merge_and_unload``'s reference, the base, the adapter).
"""

from __future__ import annotations

import json
import shutil

import pytest
from safetensors.torch import load_file, save_file

from conftest import fixture_dir, tree_digest

pytestmark = pytest.mark.usefixtures("describe_inline")

LLAMA = fixture_dir("lora_llama")
EXPERTS = fixture_dir("lora_mixtral_experts")
Q0 = "model.layers.0.self_attn.q_proj.weight"


@pytest.mark.parametrize("fixture, fused, tensors", [(LLAMA, 14, 21), (EXPERTS, 26, 41)], ids=["llama", "experts"])
def test_merge_and_unloads_output_equals_the_base_fused_with_its_adapter(cli, fixture, fused, tensors):
    before = tree_digest(fixture)
    result = cli("diff", fixture / "reference", fixture / "checkpoint", "--adapter", fixture / "adapter", "-q")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines() == [
        f"B: LoRA adapter '{fixture / 'adapter'}' fused into {fused} tensors "
        f"(rank {8 if fixture == LLAMA else 4}, scaling 2)",
        f"equal: {tensors} tensors identical"]
    assert tree_digest(fixture) == before


def test_a_fused_tensor_that_is_not_the_fuse_is_named_with_its_largest_difference(cli, tmp_path):
    fused = tmp_path / "fused"
    shutil.copytree(LLAMA / "reference", fused)
    tensors = load_file(fused / "model.safetensors")
    tensors[Q0] = tensors[Q0].clone()
    tensors[Q0][3, 5] += 0.5  # one element off: bf16 rounds the sum, so the error is what the file holds
    expected = float((tensors[Q0].double() - load_file(LLAMA / "reference" / "model.safetensors")[Q0].double()).abs().max())
    save_file(tensors, str(fused / "model.safetensors"), metadata={"format": "pt"})
    result = cli("diff", fused, LLAMA / "checkpoint", "--adapter", LLAMA / "adapter", "--json")
    assert result.exit_code == 3, result.output
    report = json.loads(result.stdout)
    assert report["adapters"] == [str(LLAMA / "adapter")]
    assert report["fused"] == [f"LoRA adapter '{LLAMA / 'adapter'}' fused into 14 tensors (rank 8, scaling 2)"]
    assert report["counts"] == {"only_a": 0, "only_b": 0, "equal": 20, "different": 1}
    [d] = report["differences"]
    assert (d["name"], d["status"], d["differing"], d["numel"]) == (Q0, "different", 1, 1024)
    assert d["max_abs_diff"] == pytest.approx(expected) and expected > 0.4
    text = cli("diff", fused, LLAMA / "checkpoint", "--adapter", LLAMA / "adapter", "-q")
    assert text.exit_code == 3
    assert f"  {Q0}: 1 of 1024 elements differ, max |A-B| = {expected:.6g}" in text.stdout


def test_the_base_against_itself_fused_names_every_tensor_the_adapter_changes(cli):
    result = cli("diff", LLAMA / "checkpoint", LLAMA / "checkpoint", "--adapter", LLAMA / "adapter", "--json")
    assert result.exit_code == 3, result.output
    report = json.loads(result.stdout)
    assert report["counts"] == {"only_a": 0, "only_b": 0, "equal": 7, "different": 14}
    assert all(d["max_abs_diff"] > 0 and d["differing"] > 0 for d in report["differences"])
    assert {d["name"].split(".")[-2] for d in report["differences"]} == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def test_without_the_adapter_the_fused_model_and_its_base_differ(cli):
    result = cli("diff", LLAMA / "reference", LLAMA / "checkpoint", "--json")
    assert result.exit_code == 3
    assert json.loads(result.stdout)["adapters"] == [] and json.loads(result.stdout)["counts"]["different"] == 14


def test_a_missing_adapter_is_an_error_naming_it(cli, tmp_path):
    result = cli("diff", LLAMA / "reference", LLAMA / "checkpoint", "--adapter", tmp_path / "nowhere")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert result.stderr.strip() == (f"Error: '{tmp_path / 'nowhere'}': no such adapter folder (a PEFT adapter is a "
                                     "folder holding adapter_config.json and adapter_model.safetensors)")
    assert result.stdout == ""
    assert list(tmp_path.iterdir()) == []


def test_an_adapter_that_does_not_fit_b_is_an_error_naming_its_tensor(cli):
    """The Llama adapter on the Mixtral base: its MLP modules are not in it (as merge --adapter refuses them)."""
    before = tree_digest(EXPERTS), tree_digest(LLAMA / "adapter")
    result = cli("diff", EXPERTS / "reference", EXPERTS / "checkpoint", "--adapter", LLAMA / "adapter", "--json")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert f"'{LLAMA / 'adapter' / 'adapter_model.safetensors'}': " in result.stderr
    assert "LoRA modules cannot be fused into the base:" in result.stderr
    assert "the adapter changes 'model.layers.0.mlp.gate_proj', but the base has no " in result.stderr
    assert json.loads(result.stdout)["status"] == "error"
    assert (tree_digest(EXPERTS), tree_digest(LLAMA / "adapter")) == before


def test_the_api_fuses_b_only():
    """A is never fused: the adapter applies to B, the side that is base + adapter."""
    from ckpttool.commands.diff import diff

    result = diff(LLAMA / "checkpoint", LLAMA / "reference", adapters=[LLAMA / "adapter"])
    assert not result.equal and result.counts()["different"] == 14
