"""Expert layouts split writes as their producers save them (issues 29/30, fifth round).

- torchtitan 0.3 cuts each stacked expert along dim 1 when its expert FSDP size exceeds the experts: over HSDP
  (``dp_replicate 2 x dp_shard 2``, 2 experts: ``Replicate()``, ``Shard(1)``) and beside TP without EP
  (``dp_shard 2 x tp 2``, 1 expert: ``w1``/``w3`` ``_StridedShard(1, 2)`` then TP ``Shard(1)``, ``w2`` ``Shard(1)``
  then ``Shard(2)``); the fixtures are torchtitan's own saves (``fixtures/make_torchtitan.py``).
- transformers' own TP plans cut stacked experts (``packed_colwise`` / ``rowwise``; Llama 4's ``packed_rowwise`` /
  ``colwise``) and its distributed save writes them as plain ``Shard`` chunks: ``split --to dcp --tp 2`` writes the
  same chunks (``llama4_hf_tp2``, ``qwen3_next_hf_tp2``), for every family from one table
  (:mod:`ckpttool.families.expert_tp`).
"""

from __future__ import annotations

import json

import pytest
import torch

import ckpttool
from conftest import assert_same_dcp, dcp_chunks, fixture_dir, load_output, tree_digest
from ckpttool.families import expert_tp
from ckpttool.io.safetensors_format import read_header

pytestmark = pytest.mark.usefixtures("describe_inline")

W1, W2 = "layers.0.moe.routed_experts.inner_experts.w1_EFD", "layers.0.moe.routed_experts.inner_experts.w2_EDF"


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """torchtitan fixture name -> its merge (once), checked bit for bit against torchtitan's own ``to_hf``."""
    cache = {}

    def merge(name: str):
        if name not in cache:
            src, out = fixture_dir(name), tmp_path_factory.mktemp(name) / "hf"
            before = tree_digest(src)
            ckpttool.merge(src / "checkpoint", out, config=src / "reference" / "config.json")
            assert tree_digest(src) == before
            got, want = load_output(out), load_output(src / "reference")
            assert sorted(got) == sorted(want)
            assert all(got[k].dtype == t.dtype and torch.equal(got[k], t) for k, t in want.items())
            cache[name] = out
        return cache[name]
    return merge


@pytest.mark.parametrize("name, mesh, w1, w2", [
    # HSDP: each replica holds one copy, FSDP cuts dim 1 in two; DCP saves a replicated chunk once
    ("torchtitan_qwen3moe2_hsdp2x2", {"dp": 2, "fsdp": 2},
     [((0, 0, 0), (2, 8, 32)), ((0, 8, 0), (2, 8, 32))], [((0, 0, 0), (2, 16, 16)), ((0, 16, 0), (2, 16, 16))]),
    # beside TP: w1 cut by TP (dim 1) then by FSDP within each TP piece (strided), w2 by FSDP (dim 1) and TP (dim 2)
    ("torchtitan_qwen3moe1_fsdp2tp2", {"fsdp": 2, "tp": 2},
     [((0, r, 0), (1, 4, 32)) for r in (0, 4, 8, 12)],
     [((0, r, c), (1, 16, 8)) for r in (0, 16) for c in (0, 8)]),
])
def test_experts_cut_along_dim_1_over_hsdp_or_beside_tp_split_back_in_torchtitans_chunks(name, mesh, w1, w2, merged,
                                                                                          tmp_path):
    src = fixture_dir(name) / "checkpoint"
    chunks = dcp_chunks(src)
    assert (chunks[W1][1], chunks[W2][1]) == (w1, w2)
    hf = merged(name)
    before = tree_digest(hf)
    ckpttool.split(hf, tmp_path / "back", names="torchtitan", **mesh)
    assert tree_digest(hf) == before
    assert_same_dcp(tmp_path / "back", src, tmp_path, unequal=("expert_bias_E",))


def test_the_fixtures_say_the_mesh_torchtitan_trained_on():
    for name, mesh in (("torchtitan_qwen3moe2_hsdp2x2", {"dp_replicate": 2, "dp_shard": 2}),
                       ("torchtitan_qwen3moe1_fsdp2tp2", {"dp_shard": 2, "tp": 2})):
        producer = json.loads((fixture_dir(name) / "producer.json").read_text())
        assert producer["mesh"] == mesh and producer["versions"]["torchtitan"] == "0.3.0"


# --- transformers' TP plans: stacked experts in the chunks its distributed save writes ---------------------------------

def _saved_chunks(name: str) -> dict[str, list]:
    """Every tensor of a transformers distributed save (``DCP_SHARDING_INFO``): its chunks ``(offsets, sizes)``."""
    chunks: dict[str, list] = {}
    for path in sorted((fixture_dir(name) / "checkpoint").glob("shard-*.safetensors")):
        header = read_header(path)
        info = json.loads(header.metadata["DCP_SHARDING_INFO"])
        for key, where in info.items():
            chunks.setdefault(key, []).append((tuple(where["saved_offsets"]), tuple(header.entries[key].shape)))
    return {k: sorted(v) for k, v in chunks.items()}


@pytest.mark.parametrize("name, experts", [
    ("llama4_hf_tp2", "language_model.model.layers.{}.feed_forward.experts."),  # [E, H, 2I] packed_rowwise
    ("qwen3_next_hf_tp2", "model.layers.{}.mlp.experts."),  # [E, 2I, H] packed_colwise
])
def test_split_over_tp_cuts_stacked_experts_in_the_chunks_transformers_saves(name, experts, tmp_path):
    reference = fixture_dir(name) / "reference"
    ckpttool.split(reference, tmp_path / "dcp", tp=2)
    ours, theirs = dcp_chunks(tmp_path / "dcp"), _saved_chunks(name)
    stacked = [experts.format(layer) + w for layer in (0, 1) for w in ("gate_up_proj", "down_proj")]
    stacked = [k for k in stacked if k in theirs]
    assert len(stacked) >= 2
    for key in stacked:
        assert len(theirs[key]) == 2 and ours[key][1] == theirs[key], key
    # and every language-model tensor the producer cut, the same way (Llama 4's vision model, which its plan cuts
    # too, the split keeps whole, as before)
    text = {k: v for k, v in theirs.items() if not k.startswith(("vision_model.", "multi_modal_projector."))}
    assert {k: ours[k][1] for k in text} == text
    ckpttool.merge(tmp_path / "dcp", tmp_path / "hf", config=reference)
    got, want = load_output(tmp_path / "hf"), load_output(reference)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_ep_still_places_experts_over_expert_ranks_whatever_the_plan(tmp_path):
    reference = fixture_dir("qwen3_next_hf_tp2") / "reference"
    result = ckpttool.split(reference, tmp_path / "dcp", tp=2, ep=2, dry_run=True)
    placed = {s.name: s.describe() for s in result.tensors}
    assert placed["model.layers.0.mlp.experts.gate_up_proj"] == "(Shard(0)) over ep=2"


def _installed_plan(model_type: str) -> dict[str, str]:
    """The stacked experts' entries of the installed transformers' plan for ``model_type`` (with its sub-configs')."""
    from transformers import CONFIG_MAPPING

    config = CONFIG_MAPPING[model_type]
    plan = dict(config.base_model_tp_plan or {})
    for sub in (getattr(config, "sub_configs", None) or {}).values():
        plan.update(getattr(sub, "base_model_tp_plan", None) or {})
    return {k: v for k, v in plan.items() if ".experts." in k and k.endswith("_proj")}


def test_the_plan_table_is_transformers_own():
    """:data:`expert_tp.PLANS` against the installed transformers, one model type of each group (reading all ~500
    configs costs ~10 s of CPU; the whole table was checked so by hand with transformers 5.23), the models whose plan
    cuts none, and the one it cannot load under TP (:data:`expert_tp.NOT_LOADED`)."""
    for plan, types in expert_tp.GROUPS:
        assert _installed_plan(types[0]) == plan, types[0]
    assert _installed_plan("qwen3_vl_moe") and not _installed_plan("gpt_oss") and not _installed_plan("dbrx")
    assert not set(expert_tp.NOT_LOADED) & set(expert_tp.PLANS)


def test_a_plan_style_gives_the_dim_transformers_saves():
    assert [str(expert_tp.placement_of_style(s)) for s in ("packed_colwise", "colwise", "rowwise", "packed_rowwise")] \
        == ["Shard(1)", "Shard(1)", "Shard(2)", "Shard(2)"]
    place = expert_tp.with_plan_experts(lambda name: None, "llama4")
    assert str(place("language_model.model.layers.3.feed_forward.experts.gate_up_proj")) == "Shard(2)"
    assert place("language_model.model.layers.3.feed_forward.router.weight") is None
    assert expert_tp.with_plan_experts(len, "gpt_oss") is len
