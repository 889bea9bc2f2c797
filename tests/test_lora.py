"""LoRA adapters fused into the base (ckpttool.lora): bit for bit with PEFT 0.21's merge_and_unload, chunk by chunk,
and every refusal naming the adapter's file and tensor with nothing written.

The fixtures are PEFT's own output (fixtures/make_lora.py): a base, an adapter saved by save_pretrained and the
merge_and_unload reference, with the logits of both."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttool.execute.reads import Reader
from ckpttool.execute.assembly import build
from ckpttool.execute.buffers import chunks, piece_uses
from ckpttool.lora.adapter import read_adapter
from ckpttool.plan.lora import AdapterTensor, LoraDelta, fuse_rows
from conftest import assert_failed_cleanly, fixture_dir, load_output, tree_digest

LLAMA, MIXTRAL = fixture_dir("lora_llama"), fixture_dir("lora_mixtral")


@pytest.fixture(scope="module")
def fused(tmp_path_factory):
    """Each fixture's base merged with its adapter through the CLI (once per module)."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    found = {}
    for fixture in (LLAMA, MIXTRAL):
        out = tmp_path_factory.mktemp("fused") / fixture.name
        result = CliRunner().invoke(main, ["merge", str(fixture / "checkpoint"), str(out), "--adapter",
                                           str(fixture / "adapter"), "-q"], catch_exceptions=False)
        assert result.exit_code == 0, result.output
        found[fixture.name] = out
    return found


@pytest.mark.parametrize("fixture", [LLAMA, MIXTRAL], ids=["llama-bf16-safetensors", "mixtral-rslora-patterns-bin"])
def test_the_fuse_is_bit_exact_with_merge_and_unload(fused, fixture):
    out = load_output(fused[fixture.name])
    reference = load_output(fixture / "reference")
    base = load_output(fixture / "checkpoint")
    assert set(out) == set(reference)
    assert [name for name in out if not torch.equal(out[name], reference[name])] == []
    changed = [name for name in base if not torch.equal(base[name], reference[name])]
    assert len(changed) == (14 if fixture is LLAMA else 10)  # 7 (q/k/v/o/gate/up/down) or 5 (q/k/v/o/router) x 2 layers
    audit = json.loads((fused[fixture.name] / "ckpttool-audit.json").read_text())
    assert audit["summary"]["errors"] == 0


@pytest.mark.parametrize("fixture", [LLAMA, MIXTRAL], ids=["llama", "mixtral"])
def test_the_fused_model_loads_strictly_with_the_merged_models_logits(fused, fixture):
    from transformers import AutoModelForCausalLM

    saved = torch.load(fixture / "logits.pt")
    model, info = AutoModelForCausalLM.from_pretrained(fused[fixture.name], output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        logits = model.eval()(saved["tokens"]).logits
    assert torch.equal(logits, saved["merged"])
    assert torch.allclose(logits.float(), saved["peft"].float(), atol=2e-2)  # the unmerged PEFT model's, within bf16


def test_streamed_chunks_of_a_few_rows_give_the_same_bytes(tmp_path):
    """The executor's chunk path: each chunk built from W's rows and the same rows of B times A, in blocks of 256 rows
    (ROW_ALIGN: the kernel's row blocks, as in the whole product), so 3 rows asked are a whole fixture target."""
    from ckpttool.commands.merge import prepare
    from ckpttool.families.registry import adapter_for
    from ckpttool.lora.attach import attach_adapters

    prepared = prepare(LLAMA / "checkpoint")
    plan = attach_adapters(prepared.plan, [read_adapter(LLAMA / "adapter")], adapter_for(prepared.model).rules)
    reference = load_file(LLAMA / "reference" / "model.safetensors")
    fused = [t for t in plan.targets if t.lora]
    assert len(fused) == 14
    for target in fused:
        chunk_list = chunks(target, 0, rows=3)
        assert [(c.start, c.stop) for c in chunk_list] == [(0, target.shape[0])]
        reader = Reader(plan.root, piece_uses(chunk_list))
        try:
            rows = build(chunk_list[0], reader)
        finally:
            reader.close()
        assert torch.equal(rows, reference[target.name]), target.name


def test_a_large_target_in_chunks_of_256_rows_equals_the_whole_product(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(1000, 96, generator=g).bfloat16()
    a, b = torch.randn(16, 96, generator=g), torch.randn(1000, 16, generator=g)
    delta = _delta(tmp_path, a, b, scaling=2.0)
    whole = w.clone()
    whole += (b @ a) * 2.0  # PEFT: one product of the whole weight
    assert torch.equal(torch.cat([fuse_rows(w[i:i + 256], (delta,), i, min(i + 256, 1000))
                                  for i in range(0, 1000, 256)]), whole)


def test_a_dry_run_names_the_fused_tensors_and_counts_the_adapter_in_its_peak(cli):
    plain = json.loads(cli("merge", LLAMA / "checkpoint", "--dry-run", "--json").stdout)
    result = cli("merge", LLAMA / "checkpoint", "--dry-run", "--json", "--adapter", LLAMA / "adapter")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    fused = {t["name"]: t["lora"] for t in doc["targets"] if "lora" in t}
    assert len(fused) == 14
    assert fused["model.layers.0.self_attn.q_proj.weight"] == [{"adapter": str(LLAMA / "adapter"), "rank": 8,
                                                                "scaling": 2.0}]
    assert f"LoRA adapter '{LLAMA / 'adapter'}' fused into 14 tensors (rank 8, scaling 2)" in doc["notes"]
    assert doc["predicted_peak_bytes"] > plain["predicted_peak_bytes"]
    text = cli("merge", LLAMA / "checkpoint", "--dry-run", "--adapter", LLAMA / "adapter").stdout
    assert f"model.layers.0.self_attn.q_proj.weight  BF16 [32x32]  <- model.layers.0.self_attn.q_proj.weight " \
           f"(1 piece, + LoRA of '{LLAMA / 'adapter'}')" in text


def test_the_python_api_fuses_and_casts_after_the_fuse(tmp_path):
    import ckpttool

    result = ckpttool.merge(LLAMA / "checkpoint", tmp_path / "out", adapters=[LLAMA / "adapter"], dtype="float32")
    out = load_output(tmp_path / "out")
    reference = load_output(LLAMA / "reference")
    assert all(torch.equal(out[n], reference[n].float()) for n in reference)  # fused in bf16 as PEFT, then cast
    assert result.plan.notes[-1].startswith("LoRA adapter")


# PEFT's arithmetic, on synthetic adapters ----------------------------------------------------------------------------


def _adapter(folder: Path, tensors: dict[str, torch.Tensor], **config) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4, "lora_alpha": 8, **config}))
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def _delta(tmp_path: Path, a: torch.Tensor, b: torch.Tensor, **kw) -> LoraDelta:
    path = tmp_path / f"w{len(list(tmp_path.iterdir()))}.safetensors"
    save_file({"a": a.contiguous(), "b": b.contiguous()}, str(path))
    from ckpttool.io.safetensors_format import read_header

    e = read_header(path).entries
    return LoraDelta(str(tmp_path), "m", AdapterTensor(str(path), "a", e["a"].shape, e["a"].dtype, e["a"].begin),
                     AdapterTensor(str(path), "b", e["b"].shape, e["b"].dtype, e["b"].begin), **kw)


def test_fan_in_fan_out_and_two_adapters_follow_peft(tmp_path):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=g).bfloat16()  # Conv1D: (in, out)
    a1, b1 = torch.randn(4, 48, generator=g), torch.randn(40, 4, generator=g)
    a2, b2 = torch.randn(2, 40, generator=g).bfloat16(), torch.randn(48, 2, generator=g).bfloat16()
    d1 = _delta(tmp_path, a1, b1, scaling=0.5, fan_in_fan_out=True)
    d2 = _delta(tmp_path, a2, b2, scaling=4.0)  # a bf16 adapter: float32 in memory, as PeftModel holds it
    expected = w.clone()
    expected += (b1 @ a1).T * 0.5  # lora.Linear.merge: weight.data += get_delta_weight(), one adapter after the other
    expected += (b2.float() @ a2.float()) * 4.0
    assert torch.equal(torch.cat([fuse_rows(w[i:i + 5], (d1, d2), i, min(i + 5, 48)) for i in range(0, 48, 5)]),
                       expected)


def test_a_rank_past_one_kernel_block_stays_within_a_rounding_of_the_whole_product(tmp_path):
    """Row blocks of a product equal the rows of the whole product when the kernel does not split r; with a large
    rank (512) it may, and then the float32 sums differ in their last bits: bounded here, one bf16 rounding at most."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=g).bfloat16()
    a, b = torch.randn(512, 64, generator=g) * 0.05, torch.randn(96, 512, generator=g) * 0.05
    delta = _delta(tmp_path, a, b, scaling=2.0)
    whole = w.clone()
    whole += (b @ a) * 2.0
    rows = torch.cat([fuse_rows(w[i:i + 7], (delta,), i, min(i + 7, 96)) for i in range(0, 96, 7)])
    ulp = torch.finfo(torch.bfloat16).eps * whole.float().abs().clamp_min(1e-3)
    assert ((rows.float() - whole.float()).abs() <= ulp).all()


# refusals ------------------------------------------------------------------------------------------------------------


def _llama_adapter(tmp_path: Path, edit=None, **config) -> Path:
    folder = tmp_path / "adapter"
    shutil.copytree(LLAMA / "adapter", folder)
    if config:
        path = folder / "adapter_config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), **config}))
    if edit is not None:
        tensors = load_file(folder / "adapter_model.safetensors")
        edit(tensors)
        save_file(tensors, str(folder / "adapter_model.safetensors"))
    return folder


def _refused(cli, tmp_path, adapter, message):
    out = tmp_path / "out"
    before = tree_digest(LLAMA / "checkpoint"), tree_digest(adapter) if adapter.is_dir() else None
    result = cli("merge", LLAMA / "checkpoint", out, "--adapter", adapter)
    assert_failed_cleanly(result, out)
    assert result.stderr == f"Error: {message}\n"
    assert (tree_digest(LLAMA / "checkpoint"), tree_digest(adapter) if adapter.is_dir() else None) == before


def test_a_missing_adapter_folder_or_weights_file_is_refused(cli, tmp_path):
    _refused(cli, tmp_path, tmp_path / "nowhere", f"'{tmp_path / 'nowhere'}': no such adapter folder (a PEFT adapter is "
             "a folder holding adapter_config.json and adapter_model.safetensors)")
    adapter = _llama_adapter(tmp_path)
    (adapter / "adapter_model.safetensors").unlink()
    _refused(cli, tmp_path, adapter, f"'{adapter}': adapter_config.json but no adapter_model.safetensors or "
             "adapter_model.bin beside it; the adapter's weights are missing")


def test_a_module_the_base_does_not_have_is_refused_naming_the_tensor(cli, tmp_path):
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def rename(tensors):
        for which in "AB":
            old = f"base_model.model.model.layers.0.self_attn.q_proj.lora_{which}.weight"
            tensors[old.replace("layers.0", "layers.7")] = tensors.pop(old)

    adapter = _llama_adapter(tmp_path, rename)
    _refused(cli, tmp_path, adapter, f"'{adapter / 'adapter_model.safetensors'}': 1 LoRA module cannot be fused into the "
             f"base:\n  - '{key.replace('layers.0', 'layers.7')}': the adapter changes 'model.layers.7.self_attn.q_proj', "
             "but the base has no 'model.layers.7.self_attn.q_proj.weight' (the nearest is "
             "'model.layers.1.self_attn.q_proj.weight')")


def test_a_shape_mismatch_is_refused_with_both_shapes(cli, tmp_path):
    a = "base_model.model.model.layers.1.self_attn.k_proj.lora_A.weight"
    b = a.replace("lora_A", "lora_B")

    def widen(tensors):
        tensors[b] = torch.zeros(32, 8)  # k_proj is 16 rows (2 KV heads of 8)

    adapter = _llama_adapter(tmp_path, widen)
    _refused(cli, tmp_path, adapter, f"'{adapter / 'adapter_model.safetensors'}': 1 LoRA module cannot be fused into the "
             f"base:\n  - '{a}' [8, 32] and '{b}' [32, 8] make a delta of [32, 32], but the base's "
             "'model.layers.1.self_attn.k_proj.weight' is [16, 32]")


def test_dora_is_refused_by_name(cli, tmp_path):
    adapter = _llama_adapter(tmp_path, use_dora=True)
    _refused(cli, tmp_path, adapter, f"'{adapter / 'adapter_config.json'}': DoRA (use_dora = true): its magnitude vector "
             "rescales each column by the norm of W + scale*B@A, which ckpttool does not compute; fuse it with peft's "
             "merge_and_unload")


def test_a_rank_the_config_does_not_state_is_refused(cli, tmp_path):
    adapter = _llama_adapter(tmp_path, r=16)
    _refused(cli, tmp_path, adapter, f"'{adapter / 'adapter_model.safetensors'}': "
             "'base_model.model.model.layers.0.mlp.down_proj.lora_A.weight' has rank 8 but "
             f"{adapter / 'adapter_config.json'} says r = 16 for 'model.layers.0.mlp.down_proj'")


def test_expert_lora_on_stacked_parameters_is_read_per_expert():
    """No longer refused (issue 27): the stacked pairs are read as per-expert deltas (tests/test_lora_experts.py fuses
    them bit-exact with PEFT, and keeps the refusals of what stays unsupported)."""
    deltas = read_adapter(fixture_dir("lora_mixtral_experts") / "adapter").deltas
    stacked = [d for d in deltas.values() if d.parameters]
    assert len(stacked) == 4 and {(d.experts, d.rank) for d in stacked} == {(4, 4)}


# the proof of a fuse (ckpttool.lora.audit) ----------------------------------------------------------------------------


def test_the_merge_audit_proves_the_fuse(fused):
    audit = json.loads((fused["lora_llama"] / "ckpttool-audit.json").read_text())
    assert not [f for f in audit["findings"] if f["code"].startswith("lora-")]


def test_an_untrained_adapter_stops_the_publish(cli, tmp_path):
    def zero(tensors):
        for key in [k for k in tensors if "lora_B" in k]:
            tensors[key] = torch.zeros_like(tensors[key])

    adapter = _llama_adapter(tmp_path, zero)
    out = tmp_path / "out"
    result = cli("merge", LLAMA / "checkpoint", out, "--adapter", adapter)
    assert_failed_cleanly(result, out, "Error: the merged checkpoint fails its audit (1 error); nothing was published",
                          f"  - [lora-untrained] '{adapter}': every lora_B of the adapter is zero (14 modules): it was "
                          "never trained, and the fused output equals the base. Is it the adapter of the last step?")


def test_a_fuse_that_wrote_the_base_is_caught(cli, tmp_path, monkeypatch):
    import ckpttool.execute.assembly as executor  # the chunk builder, which fuses

    monkeypatch.setattr(executor, "fuse_rows", lambda weight, *rest: weight)  # the delta left out
    out = tmp_path / "out"
    result = cli("merge", LLAMA / "checkpoint", out, "--adapter", LLAMA / "adapter")
    assert_failed_cleanly(result, out, "Error: the merged checkpoint fails its audit (14 errors)",
                          "[lora-delta-mismatch] 'model.layers.0.self_attn.q_proj.weight': rows 0..32 "
                          f"are not the base's plus scaling * B @ A of '{LLAMA / 'adapter'}'")


def test_an_untargeted_tensor_changed_is_caught(tmp_path):
    from ckpttool.commands.merge import prepare
    from ckpttool.lora.audit import fuse_findings

    out = tmp_path / "out"
    out.mkdir()
    tensors = load_file(LLAMA / "checkpoint" / "model.safetensors")
    tensors["model.norm.weight"] = tensors["model.norm.weight"] + 1
    save_file(tensors, str(out / "model.safetensors"))
    plan = prepare(LLAMA / "checkpoint").plan
    found = fuse_findings(plan, out, {t.name: "model.safetensors" for t in plan.targets})
    assert [(f.code, f.tensor, f.message) for f in found] == [
        ("lora-untargeted-changed", "model.norm.weight", "'model.norm.weight': row 0 differs from the base's, and no adapter targets it")]
