"""LoRA on stacked MoE experts (PEFT 0.21's ``target_parameters`` on ``mlp.experts.gate_up_proj`` / ``down_proj``),
fused per expert into the tensors ``save_pretrained`` writes (Mixtral's ``experts.E.w1`` / ``w3`` / ``w2``).

The fixture is PEFT's own output (fixtures/make_lora.py, ``lora_mixtral_experts``): a bfloat16 tiny Mixtral, an
adapter on q_proj and on both stacked parameters, and ``merge_and_unload``'s output as the reference.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttool.lora.adapter import read_adapter
from ckpttool.plan.lora import AdapterTensor, LoraDelta
from conftest import assert_failed_cleanly, fixture_dir, load_output, tree_digest

EXPERTS = fixture_dir("lora_mixtral_experts")
W1 = "model.layers.0.block_sparse_moe.experts.{}.w1.weight"


@pytest.fixture(scope="module", autouse=True)
def inline_describe():
    """Configs described in this process (the logits test imports transformers anyway): no subprocess per base."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("CKPTTOOL_DESCRIBE", "inline")
        yield


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """The fixture's base merged with its adapter through the CLI (once per module)."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    out = tmp_path_factory.mktemp("fused") / "out"
    result = CliRunner().invoke(main, ["merge", str(EXPERTS / "checkpoint"), str(out), "--adapter",
                                       str(EXPERTS / "adapter")], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "LoRA adapter" in result.output and "fused into 26 tensors (rank 4, scaling 2)" in result.output
    return out


def test_expert_lora_is_bit_exact_with_merge_and_unload(fused):
    out, reference, base = load_output(fused), load_output(EXPERTS / "reference"), load_output(EXPERTS / "checkpoint")
    assert set(out) == set(reference)
    assert [name for name in out if not torch.equal(out[name], reference[name])] == []
    changed = sorted(name for name in base if not torch.equal(base[name], reference[name]))
    assert len(changed) == 26  # per layer: q_proj and w1 / w2 / w3 of 4 experts
    assert sum(".experts." in name for name in changed) == 24
    audit = json.loads((fused / "ckpttool-audit.json").read_text())
    assert audit["summary"]["errors"] == 0


def test_expert_lora_loads_strictly_with_the_merged_models_logits(fused):
    from transformers import AutoModelForCausalLM

    saved = torch.load(EXPERTS / "logits.pt")
    model, info = AutoModelForCausalLM.from_pretrained(fused, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        logits = model.eval()(saved["tokens"]).logits
    assert torch.equal(logits, saved["merged"])


def test_the_adapters_stacked_pairs_are_read_per_expert():
    deltas = read_adapter(EXPERTS / "adapter").deltas
    gate_up, down = deltas["model.layers.0.mlp.experts.base_layer"], deltas["model.layers.0.mlp.experts"]
    for delta in (gate_up, down):  # PEFT's keys do not say which parameter: both are candidates until attached
        assert (delta.experts, delta.rank, delta.scaling, delta.rounded) == (4, 4, 2.0, True)
        assert delta.parameters == ("model.layers.0.mlp.experts.gate_up_proj", "model.layers.0.mlp.experts.down_proj")


def _tensor(tmp_path: Path, name: str, value: torch.Tensor) -> AdapterTensor:
    path = tmp_path / f"{name}.safetensors"
    save_file({name: value}, str(path))
    from ckpttool.io.safetensors_format import read_header

    entry = read_header(path, str(path)).entries[name]
    return AdapterTensor(str(path), name, entry.shape, entry.dtype, entry.begin)


@pytest.mark.parametrize("experts, rank, out, cols", [(4, 4, 128, 32), (8, 16, 700, 96), (3, 5, 77, 33)])
def test_each_experts_rows_equal_peft_s_batched_einsum(tmp_path, experts, rank, out, cols):
    """Expert e's rows from its block of A and its interleaved columns of B, in chunks of 256 rows and from a row
    offset (w3: the second half of gate_up), are PEFT's ``einsum("o r e, e r i -> e o i")`` bit for bit."""
    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(experts * rank, cols, generator=g), torch.randn(out, experts * rank, generator=g)
    peft = torch.einsum("o r e, e r i -> e o i", b.reshape(out, -1, experts), a.reshape(experts, -1, cols)) * 0.5
    stored_a, stored_b = _tensor(tmp_path, "a", a), _tensor(tmp_path, "b", b)
    half = out // 2
    for e in range(experts):
        for offset, rows in ((0, out), (half, out - half)):
            delta = LoraDelta("x", "m", stored_a, stored_b, 0.5, rounded=True, experts=experts, expert=e,
                              row_offset=offset)
            got = torch.cat([delta.rows(s, min(s + 256, rows)) for s in range(0, rows, 256)])
            assert torch.equal(got, peft[e, offset:offset + rows])


def test_the_audit_proves_the_fuse_of_every_expert(tmp_path):
    """The fuse proof covers the per-expert tensors: PEFT's reference passes, an expert left as the base is caught."""
    from ckpttool.commands.merge import prepare
    from ckpttool.families.registry import adapter_for
    from ckpttool.lora.attach import attach_adapters
    from ckpttool.lora.audit import fuse_findings

    prepared = prepare(EXPERTS / "checkpoint")
    plan = attach_adapters(prepared.plan, [read_adapter(EXPERTS / "adapter")], adapter_for(prepared.model).rules)
    files = {t.name: "model.safetensors" for t in plan.targets}
    assert fuse_findings(plan, EXPERTS / "reference", files) == []
    out = tmp_path / "out"
    out.mkdir()
    tensors = load_file(EXPERTS / "reference" / "model.safetensors")
    tensors[W1.format(3)] = load_file(EXPERTS / "checkpoint" / "model.safetensors")[W1.format(3)]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    found = fuse_findings(plan, out, files)
    assert [(f.code, f.tensor) for f in found] == [("lora-delta-mismatch", W1.format(3))]
    assert found[0].message == (f"'{W1.format(3)}': rows 0..64 are not the base's plus scaling * B @ A of "
                                f"'{EXPERTS / 'adapter'}'")


def _refused(cli, tmp_path, base: Path, adapter: Path, *needles: str) -> None:
    out = tmp_path / "out"
    before = tree_digest(base), tree_digest(adapter)
    result = cli("merge", base, out, "--adapter", adapter)
    assert_failed_cleanly(result, out, *needles)
    assert (tree_digest(base), tree_digest(adapter)) == before


def test_a_stacked_pair_that_fits_neither_parameter_is_refused(cli, tmp_path):
    adapter = tmp_path / "adapter"
    shutil.copytree(EXPERTS / "adapter", adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    key = "base_model.model.model.layers.1.mlp.experts.lora_{}.weight"
    tensors[key.format("B")] = tensors[key.format("B")][:30].clone()  # down_proj's B, 30 rows of a hidden size of 32
    save_file(tensors, str(adapter / "adapter_model.safetensors"))
    weights = adapter / "adapter_model.safetensors"
    _refused(cli, tmp_path, EXPERTS / "checkpoint", adapter,
             f"Error: '{weights}': 1 LoRA module cannot be fused into the base:\n"
             f"  - '{key.format('A')}' [16, 64] and '{key.format('B')}' [30, 16] (4 experts of rank 4) fit none of "
             "the stacked parameters they may be on: 'model.layers.1.mlp.experts.gate_up_proj' is saved as 8 tensors "
             "like 'model.layers.1.block_sparse_moe.experts.0.w1.weight' ([64, 32]); "
             "'model.layers.1.mlp.experts.down_proj' is saved as 4 tensors like "
             "'model.layers.1.block_sparse_moe.experts.0.w2.weight' ([32, 64])\n")


def test_stacked_experts_on_a_family_without_unstack_rules_are_refused(cli, tmp_path):
    """Llama has no experts: no rule of its family saves a stacked parameter per expert."""
    adapter = tmp_path / "adapter"
    shutil.copytree(EXPERTS / "adapter", adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if "layers.0.mlp.experts.lora_" in k},
              str(adapter / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.0.mlp.experts.lora_A.weight"
    _refused(cli, tmp_path, fixture_dir("lora_llama") / "checkpoint", adapter,
             f"  - '{key}' [16, 64] and '{key.replace('lora_A', 'lora_B')}' [32, 16] (4 experts of rank 4) fit none of the "
             "stacked parameters they may be on: no rule of the family saves "
             "'model.layers.0.mlp.experts.gate_up_proj' per expert; no rule of the family saves "
             "'model.layers.0.mlp.experts.down_proj' per expert\n")


def test_a_stacked_pair_whose_rows_are_no_multiple_of_r_is_refused(cli, tmp_path):
    adapter = tmp_path / "adapter"
    shutil.copytree(EXPERTS / "adapter", adapter)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "r": 3}))
    weights = adapter / "adapter_model.safetensors"
    _refused(cli, tmp_path, EXPERTS / "checkpoint", adapter,
             f"Error: '{weights}': 'base_model.model.model.layers.0.mlp.experts.lora_A.weight' has 16 rows, "
             "not a multiple of r = 3 (LoRA on the stacked experts ['model.layers.0.mlp.experts.gate_up_proj', "
             "'model.layers.0.mlp.experts.down_proj']: r rows per expert)\n")


def test_an_untrained_expert_adapter_is_one_finding_counting_its_modules(tmp_path):
    """Each stacked pair is on 2E targets but counted (and its B read) once."""
    from ckpttool.commands.merge import prepare
    from ckpttool.families.registry import adapter_for
    from ckpttool.lora.attach import attach_adapters
    from ckpttool.lora.audit import fuse_findings

    adapter = tmp_path / "adapter"
    shutil.copytree(EXPERTS / "adapter", adapter)
    tensors = load_file(adapter / "adapter_model.safetensors")
    save_file({k: torch.zeros_like(v) if "lora_B" in k else v for k, v in tensors.items()},
              str(adapter / "adapter_model.safetensors"))
    prepared = prepare(EXPERTS / "checkpoint")
    plan = attach_adapters(prepared.plan, [read_adapter(adapter)], adapter_for(prepared.model).rules)
    found = fuse_findings(plan, EXPERTS / "checkpoint", {t.name: "model.safetensors" for t in plan.targets})
    assert [f.message for f in found] == [
        f"'{adapter}': every lora_B of the adapter is zero (6 modules): it was never trained, and the fused output "
        "equals the base. Is it the adapter of the last step?"]


def test_rank_and_alpha_patterns_match_the_stacked_parameters_name(tmp_path):
    """PEFT matches rank_pattern / alpha_pattern against 'mlp.experts.down_proj', not the key's module."""
    from ckpttool.errors import SourceError

    adapter = tmp_path / "adapter"
    shutil.copytree(EXPERTS / "adapter", adapter)
    path = adapter / "adapter_config.json"
    config = json.loads(path.read_text())
    path.write_text(json.dumps({**config, "alpha_pattern": {"gate_up_proj": 8, "experts": 99}}))
    deltas = read_adapter(adapter).deltas  # the same alpha for both parameters; 'experts' names no parameter
    assert {d.scaling for d in deltas.values()} == {2.0}
    path.write_text(json.dumps({**config, "alpha_pattern": {"down_proj": 16}}))
    with pytest.raises(SourceError) as e:
        read_adapter(adapter)
    assert str(e.value) == (
        f"'{adapter / 'adapter_model.safetensors'}': 'base_model.model.model.layers.0.mlp.experts.lora_A.weight' is "
        "the LoRA of one of ['model.layers.0.mlp.experts.gate_up_proj', 'model.layers.0.mlp.experts.down_proj'], to "
        f"which {path}'s rank_pattern / alpha_pattern give different (r, alpha) [(4, 8), (4, 16)]; not fused yet")
