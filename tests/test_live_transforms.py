"""Live gather of models whose families need plan transforms: torchtitan (Q/K rows from Meta's RoPE pairs to HF's
halves; Qwen3-MoE's stacked experts cut per expert) and gpt-oss (from Megatron-Core: fc1 ``[gate; up]`` interleaved
and transposed into ``gate_up_proj``, fc2 transposed into ``down_proj``; from FSDP2 in transformers' names: none).

One 2-rank gloo job (``live_transforms_worker.py``) holds each fixture's model in the names its real producer keeps
in memory (torchtitan 0.3's trainer, megatron-core 0.16, FSDP2), sharded as that job shards it, and saves it live.
Each output must equal, byte for byte, the offline merge of the same job's DCP save, hold the reference weights
(torchtitan's own ``to_hf``; Megatron-Bridge's mapping), load strictly in transformers and give its logits. The
plan is the merge's (``plan_layout``): there is no second implementation of a transform to test.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import load_output, tree_digest
from live_transforms_worker import model_entries
from test_live import digests, launch
# imported here, transformers describes the configs in this process (a subprocess each would cost seconds)
from transformers import AutoModelForCausalLM

import ckpttool

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
WORKER = Path(__file__).resolve().parent / "live_transforms_worker.py"
#: scenario -> the fixture its job comes from
DCP_SAVED = {"titan_fsdp2": "torchtitan_llama3_fsdp2", "titan_tp": "torchtitan_llama3_tp2",
             "titan_moe": "torchtitan_qwen3moe_fsdp2", "oss_fsdp2": "gpt_oss_fsdp2_dcp"}
MEGATRON = FIXTURES / "megatron_gpt_oss_tp2_ep2"
TITAN = FIXTURES / "torchtitan_llama3_fsdp2"
TOKENS = torch.tensor([[1, 5, 9, 12, 3, 7, 16, 2]])


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("live_transforms")
    codes, outputs, _ = launch(2, out, *DCP_SAVED, "titan_midhead", "oss_megatron", worker=WORKER)
    assert codes == [0, 0], "\n".join(outputs)
    return out


def reference_of(scenario: str) -> Path:
    return MEGATRON / "reference" if scenario == "oss_megatron" else FIXTURES / DCP_SAVED[scenario] / "reference"


def assert_loads_strictly_with_the_references_logits(directory: Path, reference: Path) -> None:
    """The reference's tensors bit for bit; transformers loads them strictly and computes the reference's logits."""
    got, want = load_output(directory), load_output(reference)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    logits = []
    for path in (directory, reference):
        model, loading = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, output_loading_info=True)
        assert not any(loading.values()), loading  # strict: nothing missing, unexpected or mismatched
        with torch.no_grad():
            logits.append(model.eval()(TOKENS).logits)
    assert torch.equal(*logits)


@pytest.mark.parametrize("scenario", sorted(DCP_SAVED))
def test_live_equals_the_offline_merge_of_the_jobs_dcp_save(job, scenario, tmp_path):
    config = FIXTURES / DCP_SAVED[scenario] / "reference" / "config.json"
    ckpttool.merge(job / f"{scenario}_dcp", tmp_path / "offline", config=config, max_shard_size="24KB")
    assert digests(job / scenario) == digests(tmp_path / "offline")
    assert len(digests(job / scenario)) > 3  # sharded: several writers, several rounds
    assert_loads_strictly_with_the_references_logits(job / scenario, reference_of(scenario))


def test_torchtitan_qk_rows_are_permuted_as_torchtitans_own_to_hf_permutes_them(job):
    raw = model_entries(TITAN / "checkpoint")["layers.0.attention.qkv_linear.wq.weight"]
    got = load_output(job / "titan_fsdp2")["model.layers.0.self_attn.q_proj.weight"]
    assert not torch.equal(got, raw)
    assert sorted(got.tolist()) == sorted(raw.tolist())  # the same rows, in another order
    assert torch.equal(got, load_output(TITAN / "reference")["model.layers.0.self_attn.q_proj.weight"])


def test_qk_rows_cut_in_the_middle_of_a_head_equal_the_fsdp2_job(job):
    """Q and K split across ranks inside a head: the permutation's chunks read rows held by both ranks."""
    assert digests(job / "titan_midhead") == digests(job / "titan_fsdp2")
    assert_loads_strictly_with_the_references_logits(job / "titan_midhead", TITAN / "reference")


def test_gpt_oss_from_megatron_core_tp2_ep2_equals_the_offline_merge_of_its_torch_dist(job, tmp_path):
    ckpttool.merge(MEGATRON / "torch_dist", tmp_path / "offline", config=MEGATRON / "config.json", max_shard_size="24KB")
    assert digests(job / "oss_megatron") == digests(tmp_path / "offline")
    assert_loads_strictly_with_the_references_logits(job / "oss_megatron", MEGATRON / "reference")


# ---- one process: what is refused, and the dtype ------------------------------------------------------------------


def titan_config() -> dict:
    return json.loads((TITAN / "reference" / "config.json").read_text())


def test_torchtitan_names_without_a_config_are_refused_and_nothing_is_written(tmp_path):
    from ckpttool.errors import ConfigError
    from ckpttool.live import save_hf

    state = model_entries(TITAN / "checkpoint")
    with pytest.raises(ConfigError) as caught:
        save_hf(state, tmp_path / "hf")
    assert str(caught.value) == (
        "the live tensors are named in the torchtitan convention, not HuggingFace's, and no config was given, so the "
        "gather would write torchtitan names and its Q/K rows in Meta's RoPE order, which transformers cannot load. "
        "Pass config= (the HuggingFace model's config: a transformers config, or the dict of its config.json) to "
        "write HuggingFace names, or raw_names=True to keep the torchtitan names")
    assert list(tmp_path.iterdir()) == []
    save_hf(state, tmp_path / "raw", raw_names=True)  # asked for: written as held, nothing permuted
    got = load_output(tmp_path / "raw")
    assert sorted(got) == sorted(state) and all(torch.equal(got[k], state[k]) for k in state)


def test_a_config_whose_head_dim_does_not_fit_the_rope_permutation_is_refused(tmp_path):
    from ckpttool.errors import ConfigError
    from ckpttool.live import save_hf

    with pytest.raises(ConfigError, match=r"'model.layers.0.self_attn.k_proj.weight': RoPE pairs to halves \(head_dim "
                                          r"6\) needs blocks of 6 along dim 0, which does not divide its size 16"):
        save_hf(model_entries(TITAN / "checkpoint"), tmp_path / "hf", config={**titan_config(), "head_dim": 6})
    assert list(tmp_path.iterdir()) == []


def test_a_torchtitan_moe_tensor_under_a_dense_config_is_refused_by_name(tmp_path):
    from ckpttool.errors import ConfigError
    from ckpttool.live import save_hf

    state = {**model_entries(TITAN / "checkpoint"), "layers.0.moe.experts.w1": torch.zeros(2, 96, 32)}
    with pytest.raises(ConfigError, match=r"'layers.0.moe.experts.w1': not a torchtitan name ckpttool maps to "
                                          r"HuggingFace for llama \(MoE and MLA layers are not supported yet\)"):
        save_hf(state, tmp_path / "hf", config=titan_config())
    assert list(tmp_path.iterdir()) == []


def test_a_cast_with_the_permutation_equals_the_offline_merges(tmp_path):
    from ckpttool.live import save_hf

    save_hf(model_entries(TITAN / "checkpoint"), tmp_path / "live", config=titan_config(), dtype="bfloat16")
    before = tree_digest(TITAN / "checkpoint")
    ckpttool.merge(TITAN / "checkpoint", tmp_path / "offline", config=TITAN / "reference" / "config.json",
                   dtype="bfloat16")
    assert tree_digest(TITAN / "checkpoint") == before
    assert digests(tmp_path / "live") == digests(tmp_path / "offline")
    want = load_output(TITAN / "reference")
    got = load_output(tmp_path / "live")
    assert all(torch.equal(got[k], want[k].to(torch.bfloat16)) for k in want)
