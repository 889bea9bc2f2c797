"""DeepSeek-V3 on the HuggingFace side: MLA, first-k dense layers, shared experts, the sigmoid router's FP32
``e_score_correction_bias``, and the MTP layers a release stores after the main ones (ckpttool.families.mtp).

Fixtures (fixtures/make_fixtures.py): ``deepseek_v3_fsdp2_dcp`` (torch FSDP2 on 2 gloo ranks, DCP),
``deepseek_v3_hf_tp2_ep2`` (transformers' DistributedConfig(tp_size=2, ep_size=2)) and ``deepseek_v3_hf_mtp``
(save_pretrained, 4 shards, with an MTP layer built by transformers' own ``MtpModel`` and laid out as the release).
transformers' ``DeepseekV3ForCausalLM`` builds no MTP layer, so the first two hold none while the config declares one.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

import ckpttool
from conftest import FIXTURES, assert_failed_cleanly, load_output, tree_digest

DCP = FIXTURES / "deepseek_v3_fsdp2_dcp"
HF_TP_EP = FIXTURES / "deepseek_v3_hf_tp2_ep2"
MTP = FIXTURES / "deepseek_v3_hf_mtp"
#: within the fixtures' vocab of 251
TOKENS = torch.tensor([[1, 5, 17, 250, 42, 7, 3, 128], [2, 200, 125, 126, 0, 9, 64, 11]])
ADAPTER = "deepseek_v3 as qwen2_moe (its rules)"
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"
MISSING_NOTE = (
    "the config declares 1 MTP layer (num_nextn_predict_layers=1), but the checkpoint holds no tensor of "
    "model.layers.3: transformers loads the model without it, but a serving engine cannot use it for speculative "
    "decoding. If the model was trained with 0 MTP layers, set num_nextn_predict_layers to 0 in config.json"
)


def logits(directory: Path) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(TOKENS).logits


def mtp_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in tensors.items() if k.startswith("model.layers.3.")}


def hf_dir(directory: Path, tensors: dict[str, torch.Tensor], config: dict | None = None) -> Path:
    """A one-file HuggingFace directory with the MTP fixture's config (or ``config``)."""
    directory.mkdir(parents=True)
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    config = config or json.loads((MTP / "checkpoint" / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(config))
    return directory


# ------------------------------------------------------------------------------------------------
# the real producers: bit-exact merges, logits equal
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [DCP, HF_TP_EP], ids=lambda p: p.name)
def test_merge_equals_the_producers_weights_and_logits(case, tmp_path):
    before = tree_digest(case)
    ckpttool.merge(case / "checkpoint", tmp_path / "hf")
    assert tree_digest(case) == before
    got, want = load_output(tmp_path / "hf"), load_file(case / "reference" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    assert got["model.layers.2.mlp.experts.3.gate_proj.weight"].shape == (16, 32)
    assert got["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"].shape == (12, 32)  # kv_lora_rank + rope dim
    assert torch.equal(logits(tmp_path / "hf"), logits(case / "reference"))


def test_the_router_bias_is_no_bystander():
    """Negative control: the fixtures' non-zero ``e_score_correction_bias`` changes which experts are chosen, so a
    merge that lost or rounded it would change the logits."""
    model = AutoModelForCausalLM.from_pretrained(DCP / "reference", dtype=torch.float32).eval()
    with torch.no_grad():
        before = model(TOKENS).logits
        for layer in model.model.layers[1:]:
            layer.mlp.gate.e_score_correction_bias.zero_()
        assert not torch.equal(model(TOKENS).logits, before)


# ------------------------------------------------------------------------------------------------
# MTP layers: carried, checked, and a declared one the source does not hold
# ------------------------------------------------------------------------------------------------

def test_mtp_layers_are_carried_by_name_and_byte_and_load_in_transformers_mtp(tmp_path):
    from transformers.modeling_layers import MtpModel

    out = tmp_path / "hf"
    result = ckpttool.merge(MTP / "checkpoint", out, max_shard_size="100KB")
    got, want = load_output(out), load_output(MTP / "checkpoint")
    assert len(mtp_tensors(want)) == 32 and sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(mtp_tensors(want)) <= set(index)
    assert result.audit is not None and result.audit.findings == ()
    assert torch.equal(logits(out), logits(MTP / "reference"))
    # transformers' own MTP loader reads the merged layer: the tiny model's MTP layer is 3, not the release's 61
    main = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    main._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
    ours = MtpModel.from_pretrained(main).state_dict()
    source = AutoModelForCausalLM.from_pretrained(MTP / "checkpoint", dtype=torch.float32)
    source._keys_to_ignore_on_load_unexpected = [r"model\.layers\.3\..*"]
    theirs = MtpModel.from_pretrained(source).state_dict()
    assert sorted(ours) == sorted(theirs) and all(torch.equal(ours[k], theirs[k]) for k in theirs)


def test_the_expected_mtp_layer_is_what_the_release_layout_holds():
    """ckpttool's expectation (transformers' MtpModel, named as the release stores it) is exactly the fixture's."""
    from ckpttool.model.architecture import model_info
    from ckpttool.families import mtp

    info = model_info(json.loads((MTP / "checkpoint" / "config.json").read_text()))
    layers = mtp.expected(info)
    stored = mtp_tensors(load_output(MTP / "checkpoint"))
    assert list(layers) == [3]
    assert layers[3] == {k: tuple(v.shape) for k, v in stored.items()}
    assert layers[3]["model.layers.3.eh_proj.weight"] == (32, 64)
    assert layers[3]["model.layers.3.shared_head.head.weight"] == layers[3]["model.layers.3.embed_tokens.weight"] == (251, 32)


def test_glm4_moe_mtp_layers_have_the_same_layout():
    from transformers import Glm4MoeConfig

    from ckpttool.model.architecture import model_info
    from ckpttool.families import mtp

    config = Glm4MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                           num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                           n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1,
                           num_nextn_predict_layers=1).to_dict()
    layers = mtp.expected(model_info(config))
    names = {k.removeprefix("model.layers.2."): v for k, v in layers[2].items()}
    assert list(layers) == [2]
    assert {n: names[n] for n in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                                  "shared_head.head.weight", "embed_tokens.weight")} == {
        "enorm.weight": (32,), "hnorm.weight": (32,), "eh_proj.weight": (32, 64), "shared_head.norm.weight": (32,),
        "shared_head.head.weight": (64, 32), "embed_tokens.weight": (64, 32)}
    assert {"self_attn.q_proj.weight", "mlp.experts.3.down_proj.weight", "mlp.gate.e_score_correction_bias",
            "mlp.shared_experts.up_proj.weight", "post_attention_layernorm.weight"} <= set(names)
    assert mtp.expected(model_info({**config, "num_nextn_predict_layers": 0})) == {}


def test_a_declared_mtp_layer_the_source_lacks_is_a_note_and_a_warning(cli, tmp_path):
    result = ckpttool.merge(DCP / "checkpoint", tmp_path / "hf")
    assert MISSING_NOTE in result.plan.notes
    assert [(f.code, f.severity) for f in result.audit.findings] == [("mtp-missing", "warning")]
    dry = cli("merge", DCP / "checkpoint", "--dry-run")
    assert dry.exit_code == 0 and f"note: {MISSING_NOTE}" in dry.stdout
    for source in (DCP / "checkpoint", tmp_path / "hf"):
        audit = cli("audit", source)
        assert audit.exit_code == 0, audit.output
        assert "warning  mtp-missing  model.layers.3" in audit.stdout and MISSING_NOTE in audit.stdout
        assert "audit: PASS WITH WARNINGS, 0 errors, 1 warning," in audit.stdout
        doc = json.loads(cli("audit", source, "--json", "--no-data").stdout)
        assert doc["findings"] == [{"code": "mtp-missing", "severity": "warning", "tensor": "model.layers.3",
                                    "file": None, "message": MISSING_NOTE}]
        assert doc["summary"]["verdict"] == "pass"
    assert cli("audit", DCP / "checkpoint", "--strict").exit_code == 3


def test_of_two_declared_mtp_layers_the_one_absent_is_named(tmp_path):
    config = {**json.loads((MTP / "checkpoint" / "config.json").read_text()), "num_nextn_predict_layers": 2}
    src = hf_dir(tmp_path / "src", load_output(MTP / "checkpoint"), config)
    [finding] = ckpttool.audit(src, data=False).findings
    assert finding.code == "mtp-missing" and finding.tensor == "model.layers.4"
    assert finding.message == (
        "the config declares 2 MTP layers (num_nextn_predict_layers=2), but the checkpoint holds no tensor of "
        "model.layers.4: transformers loads the model without it, but a serving engine cannot use it for speculative "
        "decoding. If the model was trained with 1 MTP layer, set num_nextn_predict_layers to 1 in config.json")


def test_an_mtp_layer_held_in_part_is_refused_naming_what_is_missing(cli, tmp_path):
    tensors = load_output(MTP / "checkpoint")
    gone = ["model.layers.3.eh_proj.weight", "model.layers.3.shared_head.head.weight",
            "model.layers.3.mlp.experts.2.up_proj.weight"]
    src = hf_dir(tmp_path / "src", {k: v for k, v in tensors.items() if k not in gone})
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "does not match its deepseek_v3 config (3 problems)", *(
        f"'{name}': expected by the config but not in the checkpoint (MTP layer 3 is held in part; a checkpoint "
        "holds all of an MTP layer or none of it)" for name in gone))
    report = ckpttool.audit(src, data=False)
    assert sorted((f.code, f.tensor) for f in report.errors) == sorted(("tensor-missing", name) for name in gone)
    assert "mtp-missing" not in {f.code for f in report.findings}


def test_a_tensor_under_the_mtp_index_that_is_no_mtp_tensor_is_unexpected(cli, tmp_path):
    tensors = load_output(MTP / "checkpoint")
    tensors["model.layers.3.self_attn.q_proj.weight"] = torch.zeros(48, 32)  # MLA has q_a/q_b, no q_proj
    src = hf_dir(tmp_path / "src", tensors)
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "'model.layers.3.self_attn.q_proj.weight': not a tensor of a "
                          "deepseek_v3 model built from this config")
    report = ckpttool.audit(src, data=False)
    assert [(f.code, f.tensor) for f in report.findings] == [("tensor-unexpected", "model.layers.3.self_attn.q_proj.weight")]


def test_a_stray_tensor_at_the_mtp_index_counts_as_a_partial_layer(tmp_path):
    tensors = {k: v for k, v in load_output(MTP / "checkpoint").items() if not k.startswith("model.layers.3.")}
    tensors["model.layers.3.extra.weight"] = torch.zeros(2)
    report = ckpttool.audit(hf_dir(tmp_path / "src", tensors), data=False)
    codes = {f.code for f in report.findings}
    assert "mtp-missing" not in codes and "tensor-unexpected" in codes
    assert sum(f.code == "tensor-missing" for f in report.findings) == 32


def test_mtp_tensor_shapes_are_checked(cli, tmp_path):
    tensors = load_output(MTP / "checkpoint")
    tensors["model.layers.3.eh_proj.weight"] = tensors["model.layers.3.eh_proj.weight"].T.contiguous()
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", hf_dir(tmp_path / "src", tensors), out), out,
                          "'model.layers.3.eh_proj.weight': shape [64, 32], but the config gives [32, 64] (transposed")


# ------------------------------------------------------------------------------------------------
# the router bias keeps FP32 under a cast
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("case", [DCP, MTP], ids=lambda p: p.name)
def test_the_router_bias_stays_fp32_under_bfloat16(case, tmp_path):
    result = ckpttool.merge(case / "checkpoint", tmp_path / "hf", dtype="bfloat16")
    got = load_output(tmp_path / "hf")
    source = load_output(case / "reference") if case == DCP else load_output(case / "checkpoint")
    biases = sorted(k for k in got if k.endswith("e_score_correction_bias"))
    assert biases == sorted(k for k in source if k.endswith("e_score_correction_bias")) and len(biases) >= 2
    assert all(got[k].dtype == torch.float32 and torch.equal(got[k], source[k]) for k in biases)
    assert {v.dtype for k, v in got.items() if k not in biases} == {torch.bfloat16}
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["dtype"] == "bfloat16"
    assert "dtype-mix" not in {f.code for f in result.audit.findings}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert model.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32


def test_a_dry_run_shows_the_adapter_and_the_uncast_bias(cli):
    dry = cli("merge", DCP / "checkpoint", "--dry-run", "--dtype", "bf16")
    assert dry.exit_code == 0, dry.output
    assert f"family:   {ADAPTER}" in dry.stdout
    assert f"  {BIAS}  F32 [4]  <- {BIAS} (1 piece)" in dry.stdout
    assert "  model.layers.1.mlp.gate.weight  BF16 [4x32]  <- model.layers.1.mlp.gate.weight (2 pieces)" in dry.stdout
    for case in (DCP, HF_TP_EP, MTP):
        assert json.loads(cli("merge", case / "checkpoint", "--dry-run", "--json").stdout)["adapter"] == ADAPTER
        audit = cli("audit", case / "checkpoint", "--no-data")
        assert f"family: {ADAPTER}" in audit.stdout


def test_only_the_named_targets_keep_their_dtype():
    from ckpttool.layout.layout import Box, Layout, Piece, TensorLayout
    from ckpttool.plan.plan import plan_covered
    from ckpttool.families import keeps_dtype

    assert keeps_dtype(BIAS) and keeps_dtype("e_score_correction_bias")
    assert not keeps_dtype("model.layers.1.mlp.gate.weight") and not keeps_dtype("x.e_score_correction_bias_2")
    tensors = {name: TensorLayout(name, (4,), "F32", (Piece("f", name, Box((0,), (4,)), "F32"),)) for name in ("a", "b")}
    plan, failed = plan_covered(Layout("", "test", tensors), dtype="BF16", keep_dtype={"b"})
    assert failed == [] and {t.name: t.dtype for t in plan.targets} == {"a": "BF16", "b": "F32"}


def test_model_descriptions_with_mtp_layers_are_cached(tmp_path, monkeypatch):
    from ckpttool.model import architecture

    monkeypatch.setenv("CKPTTOOL_CACHE", str(tmp_path / "cache"))
    config = json.loads((MTP / "checkpoint" / "config.json").read_text())
    built = architecture.model_info(config)
    [entry] = (tmp_path / "cache" / "models").glob("*.json")
    assert json.loads(entry.read_text())["mtp"]["layers.0.eh_proj.weight"] == [32, 64]
    monkeypatch.setattr(architecture, "_build", lambda *a: pytest.fail("the cached description was not used"))
    assert architecture.model_info(config) == built and len(built.mtp_shapes) == 32


def test_a_cached_description_without_mtp_layers_is_not_read(tmp_path, monkeypatch):
    """An entry written before ModelInfo had ``mtp_shapes`` (no ``format`` in its key) is another file."""
    import hashlib
    from importlib.metadata import version

    from ckpttool.model import architecture

    monkeypatch.setenv("CKPTTOOL_CACHE", str(tmp_path / "cache"))
    config = json.loads((MTP / "checkpoint" / "config.json").read_text())
    old_key = json.dumps({"transformers": version("transformers"), "config": config}, sort_keys=True, default=str)
    old = tmp_path / "cache" / "models" / f"{hashlib.sha256(old_key.encode()).hexdigest()}.json"
    old.parent.mkdir(parents=True)
    old.write_text(json.dumps({"model_type": "deepseek_v3", "memory": {}, "disk": {}, "tied": {}, "family": "qwen2_moe"}))
    assert len(architecture.model_info(config).mtp_shapes) == 32


def test_source_copy_is_untouched_by_a_refused_merge(cli, tmp_path):
    """A partial MTP layer in a sharded HF directory: refused before a byte is written, the source unchanged."""
    src = tmp_path / "src"
    shutil.copytree(MTP / "checkpoint", src)
    index = json.loads((src / "model.safetensors.index.json").read_text())
    del index["weight_map"]["model.layers.3.enorm.weight"]
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    before = tree_digest(src)
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert tree_digest(src) == before
    assert_failed_cleanly(result, out, "'model.layers.3.enorm.weight': expected by the config but not in the checkpoint "
                          "(MTP layer 3 is held in part")
