"""More of issue 27, on PEFT's own outputs (fixtures/make_lora.py: the base, the adapter, ``merge_and_unload``'s
reference): ``diff FUSED BASE --adapter ADAPTER`` (B fused on the fly, as ``merge --adapter`` fuses it, and compared
with A), and LoRA on gpt-oss's experts, which stay stacked on disk as ``(E, in, out)`` (``lora_gpt_oss_experts``).
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import assert_failed_cleanly, build_in_row_chunks, fixture_dir, load_output, tree_digest

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


# gpt-oss: LoRA on experts stacked on disk (E, in, out) --------------------------------------------------------------

GPT_OSS = fixture_dir("lora_gpt_oss_experts")
GATE_UP = "model.layers.{}.mlp.experts.gate_up_proj"
DOWN = "model.layers.{}.mlp.experts.down_proj"


@pytest.fixture(scope="module")
def gpt_oss_fused(tmp_path_factory):
    """The gpt-oss fixture's base merged with its adapter through the CLI (once per module)."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    out = tmp_path_factory.mktemp("gpt-oss") / "out"
    result = CliRunner().invoke(main, ["merge", str(GPT_OSS / "checkpoint"), str(out), "--adapter",
                                       str(GPT_OSS / "adapter")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "fused into 8 tensors (rank 4, scaling 2)" in result.output
    return out


def test_gpt_oss_expert_lora_is_bit_exact_with_merge_and_unload(gpt_oss_fused):
    out, reference = load_output(gpt_oss_fused), load_output(GPT_OSS / "reference")
    base = load_output(GPT_OSS / "checkpoint")
    assert set(out) == set(reference)
    assert [name for name in out if not torch.equal(out[name], reference[name])] == []
    changed = sorted(name for name in base if not torch.equal(base[name], reference[name]))
    assert changed == sorted([*(GATE_UP.format(i) for i in (0, 1)), *(DOWN.format(i) for i in (0, 1)),
                              *(f"model.layers.{i}.self_attn.{m}_proj.weight" for i in (0, 1) for m in "qo")])
    assert out[GATE_UP.format(0)].shape == (4, 32, 96) and out[DOWN.format(0)].shape == (4, 48, 32)
    audit = json.loads((gpt_oss_fused / "ckpttool-audit.json").read_text())
    assert audit["summary"]["errors"] == 0


def test_gpt_oss_expert_lora_loads_strictly_with_the_merged_models_logits(gpt_oss_fused):
    from transformers import AutoModelForCausalLM

    saved = torch.load(GPT_OSS / "logits.pt")
    model, info = AutoModelForCausalLM.from_pretrained(gpt_oss_fused, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        logits = model.eval()(saved["tokens"]).logits
    assert torch.equal(logits, saved["merged"])


def _gpt_oss_plan(adapter=GPT_OSS / "adapter"):
    from ckpttool.commands.merge import prepare
    from ckpttool.families.registry import adapter_for
    from ckpttool.lora.adapter import read_adapter
    from ckpttool.lora.attach import attach_to_family

    prepared = prepare(GPT_OSS / "checkpoint")
    return attach_to_family(prepared.plan, [read_adapter(adapter)], adapter_for(prepared.model))


def test_a_stacked_target_is_fused_expert_by_expert_as_peft_s_whole_einsum():
    """Chunks of one expert (what a real gpt-oss's 2880 x 5760 experts take) give the reference's bytes, and the
    executor cuts such a target by experts, not by 256 rows."""
    from ckpttool.execute.buffers import chunks

    plan = _gpt_oss_plan()
    targets = [t for t in plan.targets if t.name in (GATE_UP.format(1), DOWN.format(1))]
    assert [d.stacked for t in targets for d in t.lora] == ["e i o", "e i o"]
    parts, sizes, allocated = build_in_row_chunks(plan, targets, rows=1)
    reference = load_output(GPT_OSS / "reference")
    for target in targets:
        assert len(parts[target.name]) == 4
        assert torch.equal(torch.cat(parts[target.name]), reference[target.name])
    one_expert = 32 * 96 * 2
    assert [c.stop - c.start for c in chunks(targets[0], 0, chunk_bytes=one_expert)] == [1, 1, 1, 1]


def test_a_stacked_pair_that_fits_the_stacked_tensor_in_neither_orientation_is_refused(cli, tmp_path):
    adapter = tmp_path / "adapter"
    shutil.copytree(GPT_OSS / "adapter", adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight"
    tensors[key] = tensors[key][:80].clone()  # gate_up's B: 80 rows where the base's 2I is 96
    save_file(tensors, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    out = tmp_path / "out"
    before = tree_digest(GPT_OSS), tree_digest(adapter)
    result = cli("merge", GPT_OSS / "checkpoint", out, "--adapter", adapter)
    assert_failed_cleanly(
        result, out,
        f"'{adapter / 'adapter_model.safetensors'}': 1 LoRA module cannot be fused into the base:\n"
        "  - 'base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight' [16, 32] and "
        f"'{key}' [80, 16] (4 experts of rank 4) fit none of the stacked parameters they may be on: the base holds "
        "'model.layers.1.mlp.experts.gate_up_proj' stacked, [4, 32, 96], where they make [4, 32, 80] "
        "((E, in, out), as the family stores it); the base holds 'model.layers.1.mlp.experts.down_proj' stacked, "
        "[4, 48, 32], where they make [4, 32, 80] ((E, in, out), as the family stores it)")
    assert (tree_digest(GPT_OSS), tree_digest(adapter)) == before


def test_diff_proves_the_gpt_oss_fuse(cli):
    result = cli("diff", GPT_OSS / "reference", GPT_OSS / "checkpoint", "--adapter", GPT_OSS / "adapter", "-q")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[-1] == "equal: 37 tensors identical"
