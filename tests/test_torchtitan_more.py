"""torchtitan both ways: ``split --to dcp --names torchtitan`` writes an HF model back in torchtitan 0.3's own names,
with Q/K rows in Meta's RoPE order and torchtitan's placements, so a torchtitan job resumes from it.

Proof on torchtitan's own saves (``fixtures/torchtitan_*``, made by ``fixtures/make_torchtitan.py``): merge the
step to HF, split it back on the same mesh, and every model tensor equals the original bit for bit, saved in the
same chunks. (torchtitan 0.3's own loader on that output, with its logits: ``fixtures/check_torchtitan_split.py``,
run in the torchtitan venv, recorded in fixtures/README.md; not here: the suite does not install torchtitan.)"""

from __future__ import annotations


import json

import pytest
import torch
from conftest import assert_failed_cleanly, assert_merge_refused_with_config, assert_same_dcp, fixture_dir, tree_digest
from conftest import dcp_chunks as _chunks
from conftest import dcp_model_tensors as _tensors

import ckpttool
from ckpttool.cli.choices import SPLIT_NAMES
from ckpttool.commands.split_dcp import NAMES
from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.families.conventions import torchtitan, torchtitan_back

#: fixture -> its mesh (fsdp, tp), as producer.json records it
MESHES = {"torchtitan_llama3_fsdp2": (2, 1), "torchtitan_llama3_tp2": (1, 2), "torchtitan_qwen3_fsdp2": (2, 1)}


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Each fixture merged to HF once (the source of every split here)."""
    out = {}
    for name in MESHES:
        hf = tmp_path_factory.mktemp(name) / "hf"
        ckpttool.merge(fixture_dir(name) / "checkpoint", hf, config=fixture_dir(name) / "reference" / "config.json")
        out[name] = hf
    return out


@pytest.mark.parametrize("name", MESHES)
def test_split_back_is_bit_identical_to_torchtitans_own_save_in_the_same_chunks(name, merged, tmp_path):
    fsdp, tp = MESHES[name]
    before = tree_digest(merged[name])
    result = ckpttool.split(merged[name], tmp_path / "back", fsdp=fsdp, tp=tp, names="torchtitan")
    assert tree_digest(merged[name]) == before
    original = fixture_dir(name) / "checkpoint"
    assert _chunks(tmp_path / "back") == _chunks(original)
    got, want = _tensors(tmp_path / "back", tmp_path), _tensors(original, tmp_path)
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert "written in torchtitan 0.3's names" in result.adapter
    permuted = [n for n in result.notes if "back to Meta's interleaved pairs" in n]
    assert bool(permuted) == ("qwen3" not in name)  # Qwen3's torchtitan model rotates halves, as HF's


def test_the_cli_splits_to_torchtitan_names_and_the_dry_run_shows_the_inverse_rope(cli, merged, tmp_path):
    hf = merged["torchtitan_llama3_fsdp2"]
    dry = cli("split", hf, "--to", "dcp", "--names", "torchtitan", "--fsdp", "2", "--dry-run")
    assert dry.exit_code == 0, dry.output
    assert "layers.0.attention.qkv_linear.wq.weight  [32x32]  (Replicate()) over fsdp=2" in dry.stdout
    assert "(RoPE halves to pairs (head_dim 8))" in dry.stdout
    assert "layers.0.attention.qkv_linear.wv.weight  [16x32]  (Replicate()) over fsdp=2  local 16x32 x2\n" in dry.stdout
    assert "layers.0.attention.wo.weight  [32x32]  (Shard(0)) over fsdp=2" in dry.stdout
    real = cli("split", hf, tmp_path / "out", "--to", "dcp", "--names", "torchtitan", "--fsdp", "2", "-q")
    assert real.exit_code == 0, real.output
    assert "tok_embeddings.weight" in _chunks(tmp_path / "out")


def test_torchtitan_0_2_names_and_its_tp_plan(merged, tmp_path):
    name = "torchtitan_llama3_tp2"
    ckpttool.split(merged[name], tmp_path / "old", tp=2, names="torchtitan-0.2")
    chunks = _chunks(tmp_path / "old")
    assert "output.weight" in chunks and "lm_head.weight" not in chunks
    # 0.2 has no fused wqkv: wq is ColwiseParallel, Shard(0) over tp
    assert chunks["layers.0.attention.wq.weight"] == ((32, 32), [((0, 0), (16, 32)), ((16, 0), (16, 32))])
    assert chunks["layers.0.attention.wo.weight"] == ((32, 32), [((0, 0), (32, 16)), ((0, 16), (32, 16))])
    got, want = _tensors(tmp_path / "old", tmp_path), _tensors(fixture_dir(name) / "checkpoint", tmp_path)
    for key, tensor in want.items():
        old = key.replace("qkv_linear.", "").replace("lm_head.", "output.")
        assert torch.equal(got[old], tensor), key


def test_the_split_merges_back_to_the_same_hf_model(merged, tmp_path):
    from conftest import load_output

    name = "torchtitan_llama3_tp2"
    ckpttool.split(merged[name], tmp_path / "back", tp=2, names="torchtitan")
    ckpttool.merge(tmp_path / "back", tmp_path / "again", config=merged[name] / "config.json")
    got, want = load_output(tmp_path / "again"), load_output(merged[name])
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)


def test_a_family_torchtitan_has_no_model_of_is_refused_naming_it(cli, tmp_path):
    src = fixture_dir("hf_bin_mixtral") / "checkpoint"
    before = tree_digest(src)
    out = tmp_path / "out"
    result = cli("split", src, out, "--to", "dcp", "--names", "torchtitan")
    assert_failed_cleanly(result, out, "names='torchtitan': torchtitan 0.3 has no mixtral model",
                          "it writes llama, qwen3")
    assert tree_digest(src) == before


def test_names_with_megatron_is_a_usage_error_and_writes_nothing(cli, merged, tmp_path):
    out = tmp_path / "out"
    result = cli("split", merged["torchtitan_llama3_fsdp2"], out, "--to", "megatron", "--names", "torchtitan")
    assert result.exit_code == 2
    assert "--names torchtitan is for --to dcp" in result.stderr
    assert not out.exists()


def test_the_api_refuses_unknown_names_and_names_for_megatron_before_reading(tmp_path):
    missing = tmp_path / "nothing-here"  # never read: the refusal comes first
    with pytest.raises(ArgumentError, match=r"names='torchtitan-9': split writes the names 'hf', 'torchtitan'"):
        ckpttool.split(missing, tmp_path / "out", names="torchtitan-9")
    with pytest.raises(ArgumentError, match=r"names='torchtitan' is for to='dcp'"):
        ckpttool.split(missing, tmp_path / "out", to="megatron", names="torchtitan")
    assert not (tmp_path / "out").exists()


def test_a_tensor_with_no_torchtitan_name_is_refused_listing_it():
    from ckpttool.families import MemoryTensor
    from ckpttool.model.description import ModelInfo

    info = ModelInfo("llama", {"model_type": "llama", "head_dim": 8}, {}, {})
    memory = [MemoryTensor("model.layers.0.self_attn.q_proj.bias", (32,), ())]
    with pytest.raises(ConfigError, match=r"1 tensor of the llama model has no name in torchtitan 0.3's model: "
                                          r"model.layers.0.self_attn.q_proj.bias; nothing was written"):
        torchtitan_back.to_torchtitan(memory, info)


def test_release_names_and_the_cli_choices_agree():
    assert SPLIT_NAMES == NAMES
    assert [torchtitan_back.release_of(n) for n in NAMES if n != "hf"] == list(torchtitan_back.RELEASES)


# --- torchtitan's MoE: Qwen3-MoE from its own trainer (FSDP2, and EP 2 on gloo) ---------------------------------------

MOE = {"torchtitan_qwen3moe_fsdp2": {"fsdp": 2}, "torchtitan_qwen3moe_ep2": {"fsdp": 2, "ep": 2}}


@pytest.fixture(scope="module")
def moe_merged(tmp_path_factory):
    out = {}
    for name in MOE:
        hf = tmp_path_factory.mktemp(name) / "hf"
        src = fixture_dir(name) / "checkpoint"
        before = tree_digest(src)
        result = ckpttool.merge(src, hf, config=fixture_dir(name) / "reference" / "config.json")
        assert tree_digest(src) == before
        out[name] = (hf, result)
    return out


@pytest.mark.parametrize("name", MOE)
def test_moe_merge_is_bit_identical_to_torchtitans_own_to_hf(name, moe_merged):
    from conftest import load_output

    hf, result = moe_merged[name]
    got, want = load_output(hf), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in got
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert result.adapter == "qwen3_moe (torchtitan convention)"
    assert result.audit is not None and not result.audit.findings
    assert any("dropped 2 MoE load-balancing expert_bias tensors (layers.0.moe.expert_bias_E...)" in n
               for n in result.plan.notes)


def test_moe_merge_loads_strictly_with_the_references_logits(moe_merged):
    from transformers import Qwen3MoeForCausalLM

    name = "torchtitan_qwen3moe_ep2"
    model, info = Qwen3MoeForCausalLM.from_pretrained(moe_merged[name][0], output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    reference = Qwen3MoeForCausalLM.from_pretrained(fixture_dir(name) / "reference")
    ids = torch.tensor([[1, 5, 9, 12, 3, 7, 16, 2]])
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, reference.eval()(ids).logits)


@pytest.mark.parametrize("name", MOE)
def test_moe_split_back_is_torchtitans_save_with_a_zero_expert_bias(name, moe_merged, tmp_path):
    result = ckpttool.split(moe_merged[name][0], tmp_path / "back", names="torchtitan", **MOE[name])
    original = fixture_dir(name) / "checkpoint"
    assert _chunks(tmp_path / "back") == _chunks(original)
    got, want = _tensors(tmp_path / "back", tmp_path), _tensors(original, tmp_path)
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        if key.endswith("expert_bias_E"):  # HF's Qwen3-MoE has none: zeros, float32, as torchtitan initialises it
            assert got[key].dtype == torch.float32 and not got[key].any(), key
        else:
            assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
    assert any("wrote 2 MoE load-balancing expert_bias_E tensors as zeros" in n for n in result.notes)


def test_moe_names_of_0_2_are_written_for_torchtitan_0_2():
    from ckpttool.families import map_from_hf
    from ckpttool.model.architecture import model_info

    config = __import__("json").loads((fixture_dir("torchtitan_qwen3moe_ep2") / "reference" / "config.json").read_text())
    info = model_info(config)
    written = torchtitan_back.to_torchtitan(map_from_hf(info), info, "0.2")
    names = {t.name: t.shape for t in written.tensors}
    assert names["layers.0.moe.experts.w1"] == (4, 16, 32) and names["layers.0.moe.experts.w2"] == (4, 32, 16)
    assert written.zeros == {"layers.0.moe.expert_bias", "layers.1.moe.expert_bias"}
    assert "output.weight" in names


def test_a_torchtitan_step_reshards_straight_to_another_torchtitan_mesh(tmp_path):
    # TP 2 -> FSDP 2 without a merge: Q/K go pairs -> halves -> pairs, the two permutations cancel (no transform)
    src = fixture_dir("torchtitan_llama3_tp2")
    result = ckpttool.split(src / "checkpoint", tmp_path / "fsdp", fsdp=2, names="torchtitan",
                            config=src / "reference" / "config.json")
    assert result.transforms() == {}
    assert _chunks(tmp_path / "fsdp") == _chunks(fixture_dir("torchtitan_llama3_fsdp2") / "checkpoint")
    got, want = _tensors(tmp_path / "fsdp", tmp_path), _tensors(src / "checkpoint", tmp_path)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_the_moe_names_before_0_3_are_cut_per_expert_too():
    from ckpttool.layout.layout import Box, Layout, Piece, TensorLayout
    from ckpttool.model.description import ModelInfo

    shapes = {"tok_embeddings.weight": (8, 4), "layers.0.moe.experts.w1": (2, 6, 4), "layers.0.moe.experts.w2": (2, 4, 6),
              "layers.0.moe.router.gate.weight": (2, 4), "layers.0.moe.expert_bias": (2,)}
    layout = Layout("/titan", "dcp", {n: TensorLayout(n, s, "F32", (Piece("f", n, Box.whole(s), "F32", "raw", 0, 0),))
                                      for n, s in shapes.items()})
    info = ModelInfo("qwen3_moe", {"model_type": "qwen3_moe", "head_dim": 2}, {},
                     {"model.layers.0.mlp.experts.0.gate_proj.weight": (6, 4)})
    specs, notes, problems = torchtitan.CONVENTION.cut(layout, info, None)
    assert not problems
    got = {s.name: (s.shape, s.slices[0].source, s.slices[0].src.offsets) for s in specs}
    assert got["model.layers.0.mlp.experts.1.gate_proj.weight"] == ((6, 4), "layers.0.moe.experts.w1", (1, 0, 0))
    assert got["model.layers.0.mlp.experts.0.down_proj.weight"] == ((4, 6), "layers.0.moe.experts.w2", (0, 0, 0))
    assert got["model.layers.0.mlp.gate.weight"][1] == "layers.0.moe.router.gate.weight"
    assert any("dropped 1 MoE load-balancing expert_bias tensors (layers.0.moe.expert_bias...)" in n for n in notes)


# --- issue 29, round 4: DeepSeek-V3 under TP x EP, MTP, experts sharded along dim 1 -----------------------------------

@pytest.fixture(scope="module")
def titan_merged(tmp_path_factory):
    """Fixture name -> (merged HF dir, merged tensors, reference tensors, result), each merged once on first use
    (its source untouched) and compared with torchtitan's own ``to_hf``: the tensors both hold are bit-equal."""
    from conftest import load_output

    cache = {}

    def merged(name: str):
        if name not in cache:
            src, out = fixture_dir(name), tmp_path_factory.mktemp(name) / "hf"
            before = tree_digest(src)
            result = ckpttool.merge(src / "checkpoint", out, config=src / "reference" / "config.json")
            assert tree_digest(src) == before
            got, want = load_output(out), load_output(src / "reference")
            for key, tensor in want.items():
                assert key in got and got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), key
            cache[name] = out, got, want, result
        return cache[name]
    return merged


def test_deepseek_v3_on_fsdp2_x_tp2_x_ep2_merges_and_splits_back_in_torchtitans_chunks(titan_merged, tmp_path):
    # 4 ranks: MLA's wq_b / wkv_b Shard(0) over TP; the routed experts over (efsdp 2, ep 2), not over TP
    name = "torchtitan_dsv3q_tp2ep2"
    hf, got, want, result = titan_merged(name)
    assert sorted(got) == sorted(want) and result.audit is not None and not result.audit.findings
    ckpttool.split(hf, tmp_path / "back", names="torchtitan", fsdp=2, tp=2, ep=2)
    chunks = _chunks(tmp_path / "back")
    assert chunks["layers.1.moe.routed_experts.inner_experts.w2_EDF"][1] == [((e, 0, 0), (1, 32, 16)) for e in range(4)]
    assert chunks["layers.1.attention.wkv_b.weight"][1] == [((0, 0), (16, 16)), ((16, 0), (16, 16)),
                                                            ((32, 0), (16, 16)), ((48, 0), (16, 16))]
    assert_same_dcp(tmp_path / "back", fixture_dir(name) / "checkpoint", tmp_path)


def test_deepseek_v3_with_an_mtp_layer_and_yarn_merges_to_deepseeks_release_layout(titan_merged):
    # torchtitan 0.3's mtp_layers.0 is HF's model.layers.3 (num_hidden_layers 3), its mtp_norm shared_head.norm;
    # the embedding and head it shares are copied in, as DeepSeek's release (and vLLM's loader) keeps them
    hf, got, want, result = titan_merged("torchtitan_dsv3mtp_fsdp2")
    assert sorted(set(got) - set(want)) == ["model.layers.3.embed_tokens.weight", "model.layers.3.shared_head.head.weight"]
    assert torch.equal(got["model.layers.3.embed_tokens.weight"], got["model.embed_tokens.weight"])
    assert torch.equal(got["model.layers.3.shared_head.head.weight"], got["lm_head.weight"])
    for part in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "mlp.experts.3.down_proj.weight", "mlp.gate.e_score_correction_bias", "self_attn.q_b_proj.weight"):
        assert f"model.layers.3.{part}" in want, part
    assert result.audit is not None and not result.audit.findings  # the MTP layer whole: no mtp-missing finding
    assert any("MTP layer model.layers.3 written with copies" in note for note in result.plan.notes)
    # YaRN changes no tensor: the config carries it (rope_type yarn, mscale = mscale_all_dim as torchtitan scales)
    assert json.loads((hf / "config.json").read_text())["rope_parameters"]["rope_type"] == "yarn"


def test_an_mtp_layer_the_config_does_not_declare_is_refused_naming_it(cli, tmp_path):
    name = "torchtitan_dsv3mtp_fsdp2"
    config = {**json.loads((fixture_dir(name) / "reference" / "config.json").read_text()), "num_nextn_predict_layers": 0}
    assert_merge_refused_with_config(
        cli, tmp_path, fixture_dir(name) / "checkpoint", config,
        "and 20 more tensors of MTP layer 0: the deepseek_v3 config declares 0 MTP layers (num_nextn_predict_layers), "
        "so they have no place", "One with num_nextn_predict_layers 1 carries them to model.layers.3")


def test_experts_fsdp_cut_along_dim_1_merge_and_split_back_in_torchtitans_chunks(titan_merged, tmp_path):
    # 2 experts on FSDP 4: torchtitan 0.3 shards each expert along dim 1 (Shard(1)) rather than pad dim 0
    name = "torchtitan_qwen3moe2_fsdp4"
    src = fixture_dir(name) / "checkpoint"
    assert _chunks(src)["layers.0.moe.routed_experts.inner_experts.w1_EFD"][1] == [
        ((0, r, 0), (2, 4, 32)) for r in (0, 4, 8, 12)]
    hf, got, want, _ = titan_merged(name)
    assert sorted(got) == sorted(want)
    ckpttool.split(hf, tmp_path / "back", names="torchtitan", fsdp=4)
    assert_same_dcp(tmp_path / "back", src, tmp_path, unequal=("expert_bias_E",))


def test_the_mtp_layer_splits_back_to_torchtitans_own_save_in_the_same_chunks(titan_merged, tmp_path):
    name = "torchtitan_dsv3mtp_fsdp2"
    hf = titan_merged(name)[0]
    before = tree_digest(hf)
    result = ckpttool.split(hf, tmp_path / "back", names="torchtitan", fsdp=2)
    assert tree_digest(hf) == before
    assert_same_dcp(tmp_path / "back", fixture_dir(name) / "checkpoint", tmp_path)
    assert "MTP layer model.layers.3 written as torchtitan's mtp_layers.0 (not its copies of the embedding and head" \
        in " ".join(result.notes)


def test_experts_cut_along_dim_1_under_ep_split_back_in_torchtitans_chunks(titan_merged, tmp_path):
    # 2 experts on FSDP 4 x EP 2: ep Shard(0) (one expert each), efsdp 2 Shard(1) within it
    name = "torchtitan_qwen3moe2_fsdp4ep2"
    src = fixture_dir(name) / "checkpoint"
    assert _chunks(src)["layers.0.moe.routed_experts.inner_experts.w2_EDF"][1] == [
        ((e, r, 0), (1, 16, 16)) for e in (0, 1) for r in (0, 16)]
    ckpttool.split(titan_merged(name)[0], tmp_path / "back", names="torchtitan", fsdp=4, ep=2)
    assert_same_dcp(tmp_path / "back", src, tmp_path, unequal=("expert_bias_E",))


def test_mtp_layers_in_torchtitan_0_2s_names_are_refused(cli, titan_merged, tmp_path):
    hf = titan_merged("torchtitan_dsv3mtp_fsdp2")[0]
    before = tree_digest(hf)
    out = tmp_path / "out"
    result = cli("split", hf, out, "--to", "dcp", "--names", "torchtitan-0.2", "--fsdp", "2")
    assert_failed_cleanly(result, out, "'model.layers.3': an MTP layer (num_nextn_predict_layers), which torchtitan "
                          "0.2's DeepSeek-V3 does not have (torchtitan 0.3 added mtp_layers); write its names "
                          "(names='torchtitan'); nothing was written")
    assert tree_digest(hf) == before
