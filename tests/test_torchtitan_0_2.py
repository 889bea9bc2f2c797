"""torchtitan 0.2 (0.2.2, what many users still train with) with more expert FSDP ranks than experts: merged to HF
and split back in 0.2's names, both bit for bit.

Proof on torchtitan 0.2.2's own saves, made by ``fixtures/make_torchtitan_02.py`` (its Trainer on gloo, a Qwen3-MoE
of 2 experts): ``torchtitan_02_qwen3moe2_fsdp4ep2`` (FSDP 4 x EP 2, so that its ``apply_fsdp`` cuts each expert along
dim 1 over efsdp 2) and ``torchtitan_02_qwen3moe2_fsdp4`` (FSDP 4 without EP, where it keeps the experts ``Shard(0)``
with two empty shards). The reference is 0.2.2's own ``Qwen3StateDictAdapter.to_hf``.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_same_dcp, dcp_chunks, fixture_dir, load_output, tree_digest

import ckpttool

NAME = "torchtitan_02_qwen3moe2_fsdp4ep2"
NO_EP = "torchtitan_02_qwen3moe2_fsdp4"
#: each fixture's mesh as split's options, and the dry run's line for one stacked expert on it
MESHES = {NAME: (("--fsdp", "4", "--ep", "2"),
                 "layers.0.moe.experts.w2  [2x32x16]  (Shard(1), Shard(0)) over efsdp=2 x ep=2  local 1x16x16 x4"),
          NO_EP: (("--fsdp", "4"),
                  "layers.0.moe.experts.w2  [2x32x16]  (Shard(0)) over fsdp=4  local 1x32x16 x2, 0x32x16 x2")}
pytestmark = pytest.mark.usefixtures("describe_inline")  # the logits test imports transformers anyway


@pytest.fixture(scope="module", params=sorted(MESHES))
def merged(request, tmp_path_factory):
    """Each fixture merged to HF once, its source untouched: (fixture name, HF dir, merge result)."""
    src, out = fixture_dir(request.param), tmp_path_factory.mktemp("titan02") / "hf"
    before = tree_digest(src)
    result = ckpttool.merge(src / "checkpoint", out, config=src / "reference" / "config.json")
    assert tree_digest(src) == before
    return request.param, out, result


def test_the_fixture_is_torchtitan_0_2_2s_save_with_experts_cut_along_dim_1():
    producer = json.loads((fixture_dir(NAME) / "producer.json").read_text())
    assert producer["versions"]["torchtitan"] == "0.2.2" and producer["mesh"] == {"dp_shard": 4, "ep": 2}
    assert producer["expert_placements"]["layers.0.moe.experts.w2"]["placements"] == ["Shard(dim=1)", "Shard(dim=0)"]
    # ep Shard(0): one expert per EP rank; efsdp 2 Shard(1) within it: half of each expert's rows
    assert dcp_chunks(fixture_dir(NAME) / "checkpoint")["layers.0.moe.experts.w2"] == (
        (2, 32, 16), [((e, r, 0), (1, 16, 16)) for e in (0, 1) for r in (0, 16)])


def test_the_fixture_without_ep_is_torchtitan_0_2_2s_save_with_experts_along_dim_0():
    producer = json.loads((fixture_dir(NO_EP) / "producer.json").read_text())
    assert producer["versions"]["torchtitan"] == "0.2.2" and producer["mesh"] == {"dp_shard": 4, "ep": 1}
    assert producer["expert_placements"]["layers.0.moe.experts.w2"]["placements"] == ["Shard(dim=0)"]
    # fsdp 4 over 2 experts: one expert on each of ranks 0 and 1, ranks 2 and 3 empty (saved as one empty chunk)
    assert dcp_chunks(fixture_dir(NO_EP) / "checkpoint")["layers.0.moe.experts.w2"] == (
        (2, 32, 16), [((0, 0, 0), (1, 32, 16)), ((1, 0, 0), (1, 32, 16)), ((2, 0, 0), (0, 32, 16))])


def test_merge_is_torchtitan_0_2s_own_to_hf_bit_for_bit(merged):
    name, out, result = merged
    got, want = load_output(out), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert result.adapter == "qwen3_moe (torchtitan convention)"
    assert result.audit is not None and not result.audit.findings
    assert any("dropped 2 MoE load-balancing expert_bias tensors (layers.0.moe.expert_bias...)" in n
               for n in result.plan.notes)


def test_merge_loads_strictly_with_the_references_logits(merged):
    from transformers import Qwen3MoeForCausalLM

    name, out, _ = merged
    model, info = Qwen3MoeForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    reference = Qwen3MoeForCausalLM.from_pretrained(fixture_dir(name) / "reference")
    ids = torch.tensor([[1, 5, 9, 12, 3, 7, 16, 2]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, reference.eval()(ids).logits)


def test_split_to_torchtitan_0_2_names_is_its_own_save_in_the_same_chunks(cli, merged, tmp_path):
    # without EP (NO_EP) this mesh was refused before: 0.2.2 keeps the experts Shard(0) there, not along dim 1
    name, hf, _ = merged
    mesh, line = MESHES[name]
    before = tree_digest(hf)
    dry = cli("split", hf, "--to", "dcp", "--names", "torchtitan-0.2", *mesh, "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert line in dry.stdout
    out = tmp_path / "back"
    real = cli("split", hf, out, "--to", "dcp", "--names", "torchtitan-0.2", *mesh, "-q")
    assert real.exit_code == 0, real.output
    assert tree_digest(hf) == before
    # every model tensor, the load-balancing expert_bias too (written as zeros; the save's are still zero after 2
    # steps), bit for bit in torchtitan 0.2.2's chunks
    assert_same_dcp(out, fixture_dir(name) / "checkpoint", tmp_path)
