"""ColossalAI 0.5.0 itself, run on this CPU (``fixtures/make_colossalai_real.py``): what ``HybridParallelPlugin`` and
``MoeHybridParallelPlugin`` save merges bit for bit to the unsharded model, loads strictly with equal logits, passes
the audit and diffs equal to the reference; the first incident, as ColossalAI users produced it (rank 0's live TP
pieces written as whole tensors), is refused with its diagnosis."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_failed_cleanly, fixture_dir, load_output, tree_digest

import ckpttool

REAL = ("colossalai_real_llama_tp2_bin", "colossalai_real_llama_tp2_bf16_st", "colossalai_real_llama_pp2_bin",
        "colossalai_real_llama_tp2_pp2_st", "colossalai_real_mixtral_ep2_bin", "colossalai_real_mixtral_pp2_ep2_bin")
MOE = ("colossalai_real_mixtral_ep2_bin", "colossalai_real_mixtral_pp2_ep2_bin")
INCIDENT = "incident_colossalai_llama_tp2_live_params"
INPUT_IDS = torch.tensor([[1, 5, 9, 42, 100, 999, 1000, 7]])


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    outs = {}
    for name in REAL:
        out = tmp_path_factory.mktemp(name) / "out"
        src = fixture_dir(name) / "checkpoint"
        before = tree_digest(src)
        outs[name] = (ckpttool.merge(src, out), out)
        assert tree_digest(src) == before
    return outs


@pytest.mark.parametrize("name", REAL)
def test_the_producer_was_colossalai_itself(name):
    producer = json.loads((fixture_dir(name) / "producer.json").read_text())
    assert producer["versions"]["colossalai"] == "0.5.0"
    assert producer["plugin"] == ("MoeHybridParallelPlugin" if name in MOE else "HybridParallelPlugin")


@pytest.mark.parametrize("name", REAL)
def test_merge_is_bit_identical_to_the_full_model(merged, name):
    got, want = load_output(merged[name][1]), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("name", REAL)
def test_output_loads_strictly_with_the_reference_logits(merged, name):
    from transformers import AutoModelForCausalLM

    ours, info = AutoModelForCausalLM.from_pretrained(merged[name][1], output_loading_info=True)
    assert not any(info.values()), info
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir(name) / "reference")
    with torch.no_grad():
        assert torch.equal(ours.eval()(INPUT_IDS).logits, reference.eval()(INPUT_IDS).logits)


@pytest.mark.parametrize("name", MOE)
def test_the_moe_savers_rotary_buffer_is_dropped_with_a_note(merged, name):
    """MoECheckpointIO writes the non-persistent ``rotary_emb.inv_freq`` that save_pretrained never writes."""
    result, out = merged[name]
    assert "model.rotary_emb.inv_freq" in json.loads(
        (fixture_dir(name) / "checkpoint" / "pytorch_model.bin.index.json").read_text())["weight_map"]
    assert ("dropped model.rotary_emb.inv_freq: a buffer the mixtral model does not save (non-persistent), written "
            "by the saver anyway") in result.plan.notes
    assert "model.rotary_emb.inv_freq" not in load_output(out)


@pytest.mark.parametrize("name", REAL)
def test_audit_passes_on_the_source(name):
    report = ckpttool.audit(fixture_dir(name) / "checkpoint", data=False)
    assert report.ok, [f.message for f in report.findings]


@pytest.mark.parametrize("name", REAL)
def test_diff_with_the_reference_is_equal(name):
    assert ckpttool.diff(fixture_dir(name) / "checkpoint", fixture_dir(name) / "reference").equal


def test_the_first_incident_as_colossalai_users_made_it_is_refused(cli, tmp_path):
    src = fixture_dir(INCIDENT) / "checkpoint"
    before = tree_digest(src)
    result = cli("merge", src, tmp_path / "out")
    assert result.exit_code == 1
    assert ("'model.embed_tokens.weight': shape [512, 32], but the config gives [1001, 32] (512 rows is one of 2 TP "
            "pieces of a vocab padded to 1024") in result.output
    assert ("'model.layers.0.self_attn.q_proj.weight': shape [16, 32], but the config gives [32, 32] (dim 0 has 16 "
            "of 32 (rows: a column-parallel split): one of 2 TP pieces; the other piece is missing)") in result.output
    assert_failed_cleanly(result, tmp_path / "out")
    assert tree_digest(src) == before


def test_the_optimizer_saved_into_the_same_folder_is_not_read_as_the_model(merged):
    src = fixture_dir("colossalai_real_llama_pp2_bin") / "checkpoint"
    assert (src / "pytorch_optim.bin.index.json").is_file() and list(src.glob("pytorch_optim-stage-*.bin"))
    assert len(load_output(merged["colossalai_real_llama_pp2_bin"][1])) == 21
