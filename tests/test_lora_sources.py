"""LoRA adapters saved with their base in one sharded source (ckpttool.lora.embedded): a PEFT-wrapped model under
FSDP2 saved with DCP is fused by default, bit for bit with PEFT's merge_and_unload, and `merge --adapter-only` writes
its adapter as PEFT's save_pretrained does (ckpttool.lora.export). Every refusal: message, exit 1, nothing written.

The fixture peft_llama_fsdp2_dcp (fixtures/make_lora.py) is lora_llama's PEFT model sharded over 2 gloo ranks: its
producer checked that the same model unsharded saves lora_llama's adapter/ and merges into lora_llama's reference/,
byte for byte: its reference/ is that merge, and lora_llama/adapter that adapter."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ckpttool.errors import SourceError
from ckpttool.layout.layout import Box, Layout, Piece, TensorLayout
from ckpttool.lora.embedded import split_embedded
from conftest import assert_failed_cleanly, fixture_dir, tree_digest

SOURCE = fixture_dir("peft_llama_fsdp2_dcp") / "checkpoint"
LLAMA = fixture_dir("lora_llama")


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """The source merged (adapter fused by default) and its adapter exported, once, through the CLI."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    root = tmp_path_factory.mktemp("sources")
    runner = CliRunner()
    fused = runner.invoke(main, ["merge", str(SOURCE), str(root / "fused"), "--json"], catch_exceptions=False)
    exported = runner.invoke(main, ["merge", str(SOURCE), str(root / "adapter"), "--adapter-only"],
                             catch_exceptions=False)
    return {"root": root, "fused": fused, "adapter": exported}


def test_a_peft_model_saved_by_fsdp2_is_fused_by_default_bit_exact_with_merge_and_unload(outputs):
    result = outputs["fused"]
    assert result.exit_code == 0, result.output
    out = outputs["root"] / "fused"
    assert (out / "model.safetensors").read_bytes() == (SOURCE.parent / "reference" / "model.safetensors").read_bytes()
    note = f"LoRA adapter '{SOURCE}' fused into 14 tensors (rank 8, scaling 2)"
    assert result.stderr == f"note: {note}, as it was saved with the base\n"
    doc = json.loads(result.stdout)
    assert doc["embedded_adapter"] == note
    assert doc["format"] == "dcp"
    assert ("a LoRA adapter ('default', 14 modules) saved with the base: set aside from the base, whose names are "
            "transformers' ('base_model.model.' and '.base_layer' dropped)") in doc["notes"]
    assert len([t for t in doc["targets"] if "lora" in t]) == 14
    assert doc["audit"]["summary"]["errors"] == 0


def test_the_fused_model_loads_strictly_with_the_merged_models_logits(outputs):
    from transformers import AutoModelForCausalLM

    saved = torch.load(LLAMA / "logits.pt")
    model, info = AutoModelForCausalLM.from_pretrained(outputs["root"] / "fused", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    with torch.no_grad():
        assert torch.equal(model.eval()(saved["tokens"]).logits, saved["merged"])


def test_the_adapter_only_export_is_what_peft_save_pretrained_writes(outputs):
    result = outputs["adapter"]
    assert result.exit_code == 0, result.output
    out = outputs["root"] / "adapter"
    assert sorted(p.name for p in out.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    # the same names, shapes, dtypes and bytes as peft's save_pretrained of the same model, unsharded
    assert (out / "adapter_model.safetensors").read_bytes() == \
        (LLAMA / "adapter" / "adapter_model.safetensors").read_bytes()
    written, peft_saved = (json.loads(p.read_text()) for p in (out / "adapter_config.json",
                                                               LLAMA / "adapter" / "adapter_config.json"))
    assert sorted(written.pop("target_modules")) == sorted(peft_saved.pop("target_modules"))  # a set in PEFT
    assert written == peft_saved
    assert result.stdout == (f"wrote the LoRA adapter of '{SOURCE}' (14 modules, rank 8) to '{out}': "
                             "adapter_config.json, adapter_model.safetensors\n")


def test_the_exported_adapter_loads_in_peft_with_the_original_adapters_logits(outputs):
    peft = pytest.importorskip("peft")  # not in the project venv: the byte equality above is the proof there
    from transformers import AutoModelForCausalLM

    saved = torch.load(LLAMA / "logits.pt")
    base = AutoModelForCausalLM.from_pretrained(LLAMA / "checkpoint")
    model = peft.PeftModel.from_pretrained(base, outputs["root"] / "adapter").eval()
    with torch.no_grad():
        assert torch.equal(model(saved["tokens"]).logits, saved["peft"])


def test_the_python_api_exports_the_adapter(tmp_path):
    import ckpttool

    result = ckpttool.export_adapter(SOURCE, tmp_path / "adapter")
    assert result.to_json() == {"status": "ok", "source": str(SOURCE), "output": str(tmp_path / "adapter"),
                                "files": ["adapter_config.json", "adapter_model.safetensors"], "modules": 14,
                                "ranks": "8", "restored": None}
    assert (tmp_path / "adapter" / "adapter_model.safetensors").read_bytes() == \
        (LLAMA / "adapter" / "adapter_model.safetensors").read_bytes()


def test_an_adapter_config_can_be_given_when_none_is_beside_the_checkpoint(cli, tmp_path):
    src = _copy_without_config(tmp_path)
    result = cli("merge", src, "--dry-run", "--json", "--adapter-config", LLAMA / "adapter" / "adapter_config.json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    fused = {t["name"]: t["lora"] for t in doc["targets"] if "lora" in t}
    assert len(fused) == 14
    assert fused["model.layers.0.self_attn.q_proj.weight"] == [{"adapter": str(src), "rank": 8, "scaling": 2.0}]


def test_a_source_holding_an_adapter_without_its_config_is_refused(cli, tmp_path):
    src = _copy_without_config(tmp_path)
    before = tree_digest(src)
    for args in ([], ["--adapter-only"]):
        out = tmp_path / "out"
        result = cli("merge", src, out, *args)
        assert_failed_cleanly(result, out)
        assert result.stderr == (
            f"Error: '{src}': holds a LoRA adapter saved with the base (14 modules, e.g. 'base_model.model.model."
            "layers.0.self_attn.q_proj.lora_A.default.weight'), and no adapter_config.json beside it. The scaling "
            "(lora_alpha / r) is only in the adapter's config: give --adapter-config path/to/adapter_config.json "
            "(what save_pretrained or LoraConfig.save_pretrained writes), or put it beside the checkpoint\n")
    missing = tmp_path / "nowhere.json"
    result = cli("merge", src, tmp_path / "out", "--adapter-config", missing)
    assert_failed_cleanly(result, tmp_path / "out", f"'{missing}': no such file. The scaling")
    assert tree_digest(src) == before


def test_an_adapter_config_whose_rank_is_not_the_adapters_is_refused(cli, tmp_path):
    src = _copy_without_config(tmp_path)
    config = json.loads((LLAMA / "adapter" / "adapter_config.json").read_text())
    (tmp_path / "c.json").write_text(json.dumps({**config, "r": 16}))
    out = tmp_path / "out"
    result = cli("merge", src, out, "--adapter-config", tmp_path / "c.json")
    assert_failed_cleanly(result, out)
    assert result.stderr == (f"Error: '{src}': 'base_model.model.model.layers.0.mlp.down_proj.lora_A.default.weight' "
                             f"has rank 8 but {tmp_path / 'c.json'} says r = 16 for 'model.layers.0.mlp.down_proj'\n")


def test_an_adapter_config_for_a_source_without_an_adapter_is_refused(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", LLAMA / "checkpoint", out, "--adapter-config", LLAMA / "adapter" / "adapter_config.json")
    assert_failed_cleanly(result, out)
    assert result.stderr == (f"Error: '{LLAMA / 'checkpoint'}' holds no LoRA adapter with its base (no lora_A / "
                             f"lora_B tensor), so the adapter config '{LLAMA / 'adapter' / 'adapter_config.json'}' "
                             "applies to nothing; a PEFT adapter folder is fused with --adapter\n")


def test_adapter_only_refuses_a_source_without_an_adapter_and_options_that_do_not_apply(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", LLAMA / "checkpoint", out, "--adapter-only")
    assert_failed_cleanly(result, out)
    assert result.stderr == (f"Error: '{LLAMA / 'checkpoint'}': holds no LoRA adapter (no '<module>.lora_A.<name>"
                             ".weight' tensor of a PEFT model); --adapter-only writes the adapter a source holds with "
                             "its base\n")
    result = cli("merge", SOURCE, out, "--adapter-only", "--dtype", "bf16")
    assert result.exit_code == 2 and "--dtype does not apply to it" in result.output and not out.exists()


def test_adapter_only_keeps_a_destination_holding_other_files(cli, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    result = cli("merge", SOURCE, out, "--adapter-only", "--force")
    assert result.exit_code == 1 and "notes.txt" in result.stderr and "Traceback" not in result.output
    assert [p.name for p in out.iterdir()] == ["notes.txt"]
    assert not list(tmp_path.glob(".out.ckpttool-partial-*"))


def test_a_fuse_that_left_the_delta_out_fails_the_audit(cli, tmp_path, monkeypatch):
    from ckpttool.execute import assembly as executor  # the chunk builder, which fuses

    monkeypatch.setattr(executor, "fuse_rows", lambda weight, *rest: weight)  # the delta left out
    out = tmp_path / "out"
    result = cli("merge", SOURCE, out)
    assert_failed_cleanly(result, out, "Error: the merged checkpoint fails its audit (14 errors)",
                          "[lora-delta-mismatch] 'model.layers.0.self_attn.q_proj.weight': rows 0..32 "
                          f"are not the base's plus scaling * B @ A of '{SOURCE}'")


def test_the_audit_of_such_a_source_is_its_base_and_says_the_adapter_is_set_aside(cli):
    result = cli("audit", SOURCE, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["summary"]["errors"] == 0
    assert ("a LoRA adapter ('default', 14 modules) saved with the base: set aside from the base, whose names are "
            "transformers' ('base_model.model.' and '.base_layer' dropped)") in [f["message"] for f in report["findings"]]


def test_an_untrained_adapter_saved_with_the_base_stops_the_merge(cli, tmp_path, monkeypatch):
    """verl #7285: a run whose lora_B never left zero; the fused output would silently be the base."""
    from ckpttool.lora.embedded import SourceTensor

    read = SourceTensor.read_rows
    monkeypatch.setattr(SourceTensor, "read_rows", lambda self, start, stop: read(self, start, stop).zero_()
                        if ".lora_B." in self.key else read(self, start, stop))
    out = tmp_path / "out"
    result = cli("merge", SOURCE, out)
    assert_failed_cleanly(result, out, "Error: the merged checkpoint fails its audit (1 error); nothing was published",
                          f"  - [lora-untrained] '{SOURCE}': every lora_B of the adapter is zero (14 modules): it was "
                          "never trained, and the fused output equals the base. Is it the adapter of the last step?")


def _copy_without_config(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    shutil.copytree(SOURCE, src)
    (src / "adapter_config.json").unlink()
    return src


def _layout(*names: str) -> Layout:
    """A layout of 1-element tensors of these names (split_embedded reads names only)."""
    return Layout("/ckpt", "dcp", {n: TensorLayout(n, (1,), "F32", (Piece("f", n, Box((0,), (1,)), "F32"),))
                                   for n in names})


def test_what_peft_saves_beside_a_lora_module_and_ckpttool_does_not_fuse_is_refused_by_name():
    layer = "base_model.model.model.layers.0.self_attn.q_proj"
    cases = {
        f"{layer}.lora_magnitude_vector.default.weight": "DoRA's magnitude vector: DoRA is not fused",
        "base_model.model.lm_head.modules_to_save.default.weight": "a modules_to_save copy",
        "base_model.model.model.embed_tokens.lora_embedding_A.default": "embedding LoRA",
        f"{layer}.lora_B.default.bias": "a trained bias of lora_B (lora_bias) is not fused yet",
    }
    for name, why in cases.items():
        with pytest.raises(SourceError) as e:
            split_embedded(_layout(f"{layer}.base_layer.weight", f"{layer}.lora_A.default.weight", name))
        assert str(e.value).startswith(f"'/ckpt': '{name}': {why}"), str(e.value)
    with pytest.raises(SourceError, match=r"holds 2 LoRA adapters \('default' \(e\.g\. '.*'\), 'other' "):
        split_embedded(_layout(f"{layer}.lora_A.default.weight", f"{layer}.lora_A.other.weight"))
    with pytest.raises(SourceError, match="PEFT's wrapped names \\('.base_layer.'\\) but no lora_A / lora_B tensor"):
        split_embedded(_layout(f"{layer}.base_layer.weight"))
    assert split_embedded(_layout("model.layers.0.self_attn.q_proj.weight")) is None
    split = split_embedded(_layout(f"{layer}.base_layer.weight", f"{layer}.lora_A.default.weight",
                                   f"{layer}.lora_B.default.weight", "base_model.model.lm_head.weight"))
    assert sorted(split.base.tensors) == ["lm_head.weight", "model.layers.0.self_attn.q_proj.weight"]
    assert sorted(split.lora) == ["model.layers.0.self_attn.q_proj.lora_A.weight",
                                  "model.layers.0.self_attn.q_proj.lora_B.weight"]
