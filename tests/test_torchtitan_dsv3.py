"""torchtitan's DeepSeek-V3, and torchtitan's MoE under tensor parallel.

Proof on torchtitan 0.3.0's own saves (``fixtures/make_torchtitan.py``: its ``Trainer`` on CPU, gloo; a tiny
DeepSeek-V3 of 3 layers, the first dense, multi-latent attention without ``q_lora_rank`` on FSDP 2 and with it on
FSDP 2 x EP 2, one shared expert, 4 routed ones behind a sigmoid router whose load-balancing ``expert_bias_E`` was
trained): ckpttool merges the step bit for bit into what torchtitan's own ``DeepSeekV3StateDictAdapter.to_hf``
makes, transformers' ``DeepseekV3ForCausalLM`` loads it strictly with the reference's logits, the audit passes, and
``split --to dcp --names torchtitan`` writes back torchtitan's own save, tensor for tensor and chunk for chunk.
(torchtitan's own forward against transformers': ``fixtures/check_torchtitan_split.py`` in the torchtitan venv,
recorded in fixtures/README.md.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_failed_cleanly, assert_merge_refused_with_config, fixture_dir, load_output, tree_digest
from conftest import assert_same_dcp
from conftest import dcp_chunks as _chunks
from transformers import DeepseekV3ForCausalLM

import ckpttool
from ckpttool.errors import ConfigError
from ckpttool.families import MemoryTensor, map_from_hf
from ckpttool.families.conventions import torchtitan, torchtitan_back
from ckpttool.layout.layout import Box, Layout, Piece, TensorLayout
from ckpttool.layout.placements import Placement
from ckpttool.model.architecture import model_info

#: fixture -> its mesh, as split takes it (producer.json records torchtitan's)
DSV3 = {"torchtitan_dsv3_fsdp2": {"fsdp": 2}, "torchtitan_dsv3q_ep2": {"fsdp": 2, "ep": 2}}
IDS = torch.tensor([[1, 5, 9, 12, 3, 7, 16, 2]])


def _config(name: str) -> dict:
    return json.loads((fixture_dir(name) / "reference" / "config.json").read_text())


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Each DeepSeek-V3 fixture merged to HF once, its source untouched (the source of the splits here)."""
    out = {}
    for name, src in ((name, fixture_dir(name)) for name in DSV3):
        before = tree_digest(src)
        hf = tmp_path_factory.mktemp(name) / "hf"
        out[name] = hf, ckpttool.merge(src / "checkpoint", hf, config=src / "reference" / "config.json")
        assert tree_digest(src) == before
    return out


# --- DeepSeek-V3 from torchtitan's own trainer ------------------------------------------------------------------------

@pytest.mark.parametrize("name", DSV3)
def test_the_producer_was_torchtitan_itself_with_mla_and_shared_experts(name):
    producer = json.loads((fixture_dir(name) / "producer.json").read_text())
    assert producer["versions"]["torchtitan"] == "0.3.0" and producer["world_size"] == 2
    entries = producer["entries"]["model_entries"]
    q_lora = name.startswith("torchtitan_dsv3q")
    assert producer["case"]["q_lora_rank"] == (16 if q_lora else 0)
    assert ("layers.1.attention.wq_b.weight" in entries) == q_lora
    assert ("layers.1.attention.wq.weight" in entries) != q_lora
    for key in ("layers.0.feed_forward.w1.weight", "layers.1.attention.wkv_a.weight", "layers.2.moe.expert_bias_E",
                "layers.1.moe.shared_experts.w2.weight", "layers.2.moe.routed_experts.inner_experts.w1_EFD"):
        assert key in entries, key


@pytest.mark.parametrize("name", DSV3)
def test_merge_is_bit_identical_to_torchtitans_own_to_hf_and_the_audit_passes(name, merged):
    hf, result = merged[name]
    got, want = load_output(hf), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    # the trained load-balancing bias is DeepSeek-V3's own e_score_correction_bias: kept, float32, not zeros
    bias = got["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert bias.dtype == torch.float32 and bias.any()
    assert result.adapter == "deepseek_v3 (torchtitan convention)"
    assert result.audit is not None and not result.audit.findings
    assert not any("permuted" in note for note in result.plan.notes)


def test_the_merge_loads_strictly_with_the_references_logits(merged):
    for name in DSV3:
        model, info = DeepseekV3ForCausalLM.from_pretrained(merged[name][0], output_loading_info=True)
        assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
        reference = DeepseekV3ForCausalLM.from_pretrained(fixture_dir(name) / "reference")
        with torch.no_grad():
            assert torch.equal(model.eval()(IDS).logits, reference.eval()(IDS).logits), name


@pytest.mark.parametrize("name", DSV3)
def test_split_back_is_torchtitans_own_save_in_the_same_chunks(name, merged, tmp_path):
    hf = merged[name][0]
    before = tree_digest(hf)
    result = ckpttool.split(hf, tmp_path / "back", names="torchtitan", **DSV3[name])
    assert tree_digest(hf) == before
    assert_same_dcp(tmp_path / "back", fixture_dir(name) / "checkpoint", tmp_path)
    assert not any("zeros" in note or "permuted" in note for note in result.notes)


# --- what is refused ----------------------------------------------------------------------------------------------------

def test_a_config_without_interleaved_rope_is_refused_naming_the_key(cli, tmp_path):
    name = "torchtitan_dsv3_fsdp2"
    config = {**_config(name), "rope_interleave": False}
    assert_merge_refused_with_config(
        cli, tmp_path, fixture_dir(name) / "checkpoint", config,
        "'layers.0.attention.wkv_a.weight': its rotary rows are in torchtitan's interleaved pairs and the config sets "
        "rope_interleave: false", "'layers.2.attention.wq.weight'")


def test_split_back_without_interleaved_rope_is_refused(merged, tmp_path):
    hf = merged["torchtitan_dsv3_fsdp2"][0]
    info = model_info({**_config("torchtitan_dsv3_fsdp2"), "rope_interleave": False})
    with pytest.raises(ConfigError, match=r"names='torchtitan': the deepseek_v3 model's its rotary rows .*"
                                          r"rope_interleave: false.*; nothing was written"):
        torchtitan_back.to_torchtitan(map_from_hf(info), info)
    assert not (tmp_path / "back").exists() and hf.exists()


def test_a_name_torchtitans_deepseek_v3_has_not_and_its_mtp_layers_are_refused_by_name():
    layout = _layout({"tok_embeddings.weight": (8, 4), "layers.0.attention.wk.weight": (4, 4),
                      "mtp_layers.0.eh_proj.weight": (4, 8)})
    info = model_info(_config("torchtitan_dsv3_fsdp2"))
    specs, _, problems = torchtitan.CONVENTION.cut(layout, info, None)
    assert [s.name for s in specs] == ["model.embed_tokens.weight"]
    assert problems == [
        ("layers.0.attention.wk.weight", "'layers.0.attention.wk.weight': not a torchtitan name ckpttool maps to "
         "HuggingFace for deepseek_v3 (not in torchtitan's DeepSeek-V3 model)"),
        # MTP layers are mapped since issue 29's fourth round: one the config does not declare is refused so
        ("mtp_layers.0.eh_proj.weight", "'mtp_layers.0.eh_proj.weight' of MTP layer 0: the deepseek_v3 config "
         "declares 0 MTP layers (num_nextn_predict_layers), so they have no place. Is this the config the model "
         "trained with? One with num_nextn_predict_layers 1 carries them to model.layers.3")]


def test_without_ep_torchtitan_0_2s_experts_stay_along_dim_0_beside_tp_and_over_hsdp(cli, merged):
    # 4 experts over 8 expert FSDP ranks: 0.3 cuts dim 1 there (test_expert_layouts.py); 0.2.2's apply_fsdp passes
    # its dim-1 placement only to the experts' EP-mesh fully_shard, so without EP they stay Shard(0) on FSDP after
    # TP's cut (its own save on FSDP alone: tests/test_torchtitan_0_2.py). These meshes were refused before
    hf = merged["torchtitan_dsv3_fsdp2"][0]
    for args, line in (
            (("--fsdp", "8", "--tp", "2"),
             "layers.1.moe.experts.w2  [4x32x16]  (Shard(0), Shard(2)) over fsdp=8 x tp=2  local 1x32x8 x8, 0x32x8 x8"),
            (("--dp", "2", "--fsdp", "4"),
             "layers.1.moe.experts.w2  [4x32x16]  (Replicate(), Shard(0)) over dp=2 x fsdp=4  local 1x32x16 x8")):
        result = cli("split", hf, "--to", "dcp", "--names", "torchtitan-0.2", *args, "--dry-run")
        assert result.exit_code == 0, result.output
        assert line in result.stdout


def test_torchtitan_0_2s_experts_over_tp_within_ep_are_refused(cli, merged, tmp_path):
    out = tmp_path / "out"
    result = cli("split", merged["torchtitan_dsv3_fsdp2"][0], out, "--to", "dcp", "--names", "torchtitan-0.2",
                 "--tp", "2", "--ep", "2")
    assert_failed_cleanly(result, out, "'layers.1.moe.experts.w1': torchtitan 0.2 shards experts over TP within EP")


# --- the names and placements, on made-up layouts ----------------------------------------------------------------------

def _layout(shapes: dict[str, tuple[int, ...]]) -> Layout:
    tensors = {n: TensorLayout(n, s, "F32", (Piece("f", n, Box.whole(s), "F32", "raw", 0, 0),))
               for n, s in shapes.items()}
    return Layout("/titan", "dcp", tensors)


def test_0_2s_bias_name_is_read_and_written_as_deepseeks_correction_bias():
    info = model_info(_config("torchtitan_dsv3q_ep2"))
    specs, _, problems = torchtitan.CONVENTION.cut(_layout({"layers.1.moe.expert_bias": (4,)}), info, None)
    assert not problems and [s.name for s in specs] == ["model.layers.1.mlp.gate.e_score_correction_bias"]
    written = torchtitan_back.to_torchtitan(map_from_hf(info), info, "0.2")
    names = {t.name for t in written.tensors}
    assert {"layers.1.moe.expert_bias", "layers.1.attention.wq_b.weight", "output.weight"} <= names
    assert not written.zeros and "layers.1.moe.expert_bias" in written.whole


def test_torchtitans_tensor_parallel_plan_for_mla_and_experts():
    shard = {name: torchtitan_back.tp_placement(name) for name in (
        "layers.0.attention.wq.weight", "layers.0.attention.wq_b.weight", "layers.0.attention.wkv_b.weight",
        "layers.0.attention.wq_a.weight", "layers.0.attention.wkv_a.weight", "layers.0.attention.kv_norm.weight",
        "layers.1.moe.router.gate.weight", "layers.1.moe.shared_experts.w1.weight",
        "layers.1.moe.shared_experts.w2.weight", "layers.1.moe.routed_experts.inner_experts.w1_EFD",
        "layers.1.moe.routed_experts.inner_experts.w2_EDF", "layers.1.moe.experts.w3")}
    s = Placement("shard", 0), Placement("shard", 1), Placement("shard", 2), Placement("replicate")
    assert list(shard.values()) == [s[0], s[0], s[0], s[3], s[3], s[3], s[3], s[0], s[1], s[1], s[2], s[1]]


def test_no_stacked_experts_no_mesh_check():
    written = torchtitan_back.TorchtitanNames([MemoryTensor("tok_embeddings.weight", (8, 4), ())], frozenset(), [])
    torchtitan_back.check_mesh(written, "0.3", fsdp=64, tp=8, ep=1)


# --- torchtitan's MoE under tensor parallel: Qwen3-MoE on TP 2 and on FSDP 2 x TP 2 with EP 2 (4 ranks), DeepSeek-V3 --

#: fixture -> its mesh as split takes it, and a stacked expert's chunks as torchtitan saved them
MOE_TP = {
    # TP shards the stacked experts too: w1_EFD / w3_EFD Shard(1), w2_EDF Shard(2) (the router replicated)
    "torchtitan_qwen3moe_tp2": ({"tp": 2}, [((0, 0, 0), (4, 32, 8)), ((0, 0, 8), (4, 32, 8))]),
    # with EP, experts over (efsdp 2, ep 2): ep Shard(0), efsdp strided within, not over TP
    "torchtitan_qwen3moe_tp2ep2": ({"fsdp": 2, "tp": 2, "ep": 2}, [((e, 0, 0), (1, 32, 16)) for e in range(4)]),
    # MLA on TP: wq_b / wkv_b Shard(0), the low-rank wq_a / wkv_a and norms replicated; shared experts as a dense FFN
    "torchtitan_dsv3q_tp2": ({"tp": 2}, [((0, 0, 0), (4, 32, 8)), ((0, 0, 8), (4, 32, 8))]),
}


@pytest.mark.parametrize("name", MOE_TP)
def test_moe_under_tp_merges_and_splits_back_in_torchtitans_chunks(name, tmp_path):
    src = fixture_dir(name) / "checkpoint"
    ckpttool.merge(src, tmp_path / "hf", config=fixture_dir(name) / "reference" / "config.json")
    got, want = load_output(tmp_path / "hf"), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    mesh, expert_chunks = MOE_TP[name]
    ckpttool.split(tmp_path / "hf", tmp_path / "back", names="torchtitan", **mesh)
    chunks = _chunks(tmp_path / "back")
    assert chunks["layers.1.moe.routed_experts.inner_experts.w2_EDF"][1] == expert_chunks
    if "dsv3" in name:
        assert chunks["layers.1.attention.wkv_b.weight"][1] == [((0, 0), (32, 16)), ((32, 0), (32, 16))]
        assert chunks["layers.1.attention.wkv_a.weight"][1] == [((0, 0), (24, 32))]
    # Qwen3-MoE's HF has no expert_bias_E: written as zeros; DeepSeek-V3's is carried, compared as any tensor
    assert_same_dcp(tmp_path / "back", src, tmp_path, unequal=("expert_bias_E",) if "qwen3" in name else ())
