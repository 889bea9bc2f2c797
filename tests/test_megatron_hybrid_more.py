"""Nemotron-H and Megatron-Core, beyond the dense merge (issue 30): Nemotron-H with MoE layers from megatron-core's
hybrid ``MambaModel``, ``split --to megatron`` of both, and the audit's root causes on a damaged one.

Fixtures (``fixtures/make_megatron_hybrid.py``, megatron-core 0.16.1 on CPU): ``megatron_nemotron_h_tp2_pp2``
(pattern ``M*M-``, TP=2 x PP=2) and ``megatron_nemotron_h_moe_tp2_ep2`` (pattern ``ME*E``: 4 routed experts top-2,
sigmoid router with an FP32 expert bias, scaling 2.5, one shared expert, squared-ReLU experts; TP=2 x EP=2, expert
TP 1). The MoE one merges bit for bit into transformers' ``NemotronHForCausalLM`` names
(``mixer.gate.{weight,e_score_correction_bias}``, ``mixer.experts.{e}.{up,down}_proj``, ``mixer.shared_experts.*``),
loads strictly and gives Megatron's logits.

The producer is the judge of the split: splitting a fixture's HF reference at the layout megatron-core saved it at
gives megatron-core's own checkpoint: the same global tensors bit for bit (the Mamba-2 mixer's
``in_proj.weight.{z,x,B,C,dt}`` and ``conv1d.{weight,bias}.{x,B,C}`` parts cut by the merge's own table, the experts
stacked), the same keys (``_extra_state`` included), the same chunks, each on a rank of the same pipeline stage.
Merging the split back gives the reference. megatron-core itself loads the split strictly and its forward gives
transformers' logits (marked slow; skipped without ``/work/venv-megatron``).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, load_output, tree_digest
from safetensors.torch import load_file
from test_megatron_hybrid import logits_of, megatron_as_dcp
from test_split_megatron_dsv3 import read_all

import ckpttool

MEGATRON_VENV = Path(os.environ.get("CKPTTOOL_MEGATRON_VENV", "/work/venv-megatron"))
CONSUMER = Path(__file__).with_name("megatron_hybrid_consumer.py")
FIXTURE = FIXTURES / "megatron_nemotron_h_tp2_pp2"
MOE = FIXTURES / "megatron_nemotron_h_moe_tp2_ep2"
#: case -> the split options of the layout megatron-core saved it at
LAYOUTS = {"nemotron_h_tp2_pp2": dict(tp=2, pp=2, make_vocab_size_divisible_by=64),
           "nemotron_h_moe_tp2_ep2": dict(tp=2, ep=2, etp=1, make_vocab_size_divisible_by=64),
           # the MoE model at PP=2 with expert TP 2 (tests/test_hybrid_sharded.py merges it)
           "nemotron_h_moe_tp2_pp2_etp2": dict(tp=2, pp=2, etp=2, make_vocab_size_divisible_by=64)}
VOCAB = 251
VOCAB_TENSORS = ("embedding.word_embeddings.weight", "output_layer.weight")

#: transformers is imported here anyway: configs are described in this process (conftest.describe_inline)
pytestmark = pytest.mark.usefixtures("describe_inline")


def fixture(case: str) -> Path:
    return FIXTURES / f"megatron_{case}"


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """Each fixture's reference split once (on first use) at its own layout; the source is not modified."""
    root = tmp_path_factory.mktemp("splits")

    @functools.cache
    def split_once(case: str) -> Path:
        reference, out = fixture(case) / "reference", root / case
        before = tree_digest(reference)
        result = ckpttool.split(reference, out, to="megatron", iteration=10, config=fixture(case) / "config.json",
                                **LAYOUTS[case])
        assert "nemotron_h" in result.adapter and tree_digest(reference) == before
        return out

    return split_once


@pytest.fixture(scope="module")
def split(splits) -> Path:
    return splits("nemotron_h_tp2_pp2")


# ------------------------------------------------------------------------------------------------
# Nemotron-H MoE from megatron-core
# ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def merged_moe(tmp_path_factory) -> Path:
    """The MoE fixture's torch_dist merged once (the Python API); the source is not modified."""
    out = tmp_path_factory.mktemp("nemotron_h_moe") / "out"
    before = tree_digest(MOE / "torch_dist")
    result = ckpttool.merge(MOE / "torch_dist", out, config=MOE / "config.json")
    assert result.adapter == "nemotron_h (Megatron-Core convention)" and tree_digest(MOE / "torch_dist") == before
    return out


def test_the_moe_model_merges_to_megatrons_own_gathered_state_bit_for_bit(merged_moe):
    got, want = load_output(merged_moe), load_output(MOE / "reference")
    assert sorted(got) == sorted(want)
    assert "backbone.layers.3.mixer.experts.3.up_proj.weight" in got
    assert "backbone.layers.1.mixer.gate.e_score_correction_bias" in got
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    summary = json.loads((merged_moe / "ckpttool-audit.json").read_text())["summary"]
    assert (summary["verdict"], summary["errors"], summary["warnings"]) == ("pass", 0, 0), summary


def test_the_moe_merge_loads_strictly_and_computes_what_megatron_computed(merged_moe):
    megatron = load_file(MOE / "logits.safetensors")
    logits = logits_of(merged_moe, megatron["tokens"].tolist())
    torch.testing.assert_close(logits[0], megatron["logits"][0, :, :VOCAB], atol=1e-4, rtol=0)


def test_the_moe_source_audits_clean(cli):
    audit = cli("audit", MOE / "torch_dist", "--config", MOE / "config.json")
    assert audit.exit_code == 0, audit.output
    assert "audit: PASS, 0 errors, 0 warnings" in audit.output


def test_a_moe_tensor_the_table_does_not_name_is_refused(cli, tmp_path):
    """A gated shared expert (``shared_experts.gate_weight``): Nemotron-H has none; refused naming it, nothing written."""
    def gated(state):
        state["decoder.layers.3.mlp.shared_experts.gate_weight"] = torch.zeros(1, 32)

    def moe(config):
        config["hybrid_override_pattern"] = "M*ME"

    src = megatron_as_dcp(tmp_path, gated, moe)
    before = tree_digest(src)
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", "'decoder.layers.3.mlp.shared_experts.gate_weight': layer 3 is a "
                          "MoE layer ('E' in the config's hybrid_override_pattern), whose Megatron-Core tensors are "
                          "mlp.experts.experts.linear_fc1.weight, ", "; not 'mlp.shared_experts.gate_weight'")
    assert tree_digest(src) == before


def stages_of(metadata, per_stage: int) -> dict[tuple[str, tuple[int, ...] | None], int]:
    """Every chunk (fqn, offsets) -> the pipeline stage of the rank file holding it (``__{rank}_{n}.distcp``); the
    vocab tensors aside: a chunk every stage's ranks hold is written once, by any of them (megatron-core reads it
    from whichever file has it)."""
    return {(index.fqn, tuple(index.offset) if index.offset is not None else None):
            int(info.relative_path.split("_")[2]) // per_stage
            for index, info in metadata.storage_data.items()
            if not index.fqn.startswith(("rng_state", *VOCAB_TENSORS))}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_the_split_is_megatrons_own_checkpoint(case, splits):
    """Same tensors bit for bit (vocab padding aside: zeros here), same keys, chunks and pipeline stages."""
    mine, mine_md = read_all(splits(case) / "iter_0000010")
    real, real_md = read_all(fixture(case) / "torch_dist" / "iter_0000010")
    assert sorted(mine) == sorted(real)
    assert "decoder.layers.2.mixer.in_proj.weight.dt" in mine or "decoder.layers.3.mlp.router.expert_bias" in mine
    assert "decoder.layers.0.mixer.conv1d.bias.C" in mine
    for name, want in real.items():
        got = mine[name]
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
        if name in VOCAB_TENSORS:
            assert torch.equal(got[:VOCAB], want[:VOCAB]) and not got[VOCAB:].any(), name
        else:
            assert torch.equal(got, want), name
    keys = lambda md: sorted(k for k in md.state_dict_metadata if not k.startswith("rng_state"))  # noqa: E731
    assert keys(mine_md) == keys(real_md)  # the _extra_state objects too, the output layer's among them
    assert "decoder.layers.0.mixer.in_proj._extra_state/shard_0_1" in keys(mine_md)
    for name, meta in real_md.state_dict_metadata.items():
        if hasattr(meta, "chunks"):
            chunks = lambda md: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[name].chunks)  # noqa: E731
            assert chunks(mine_md) == chunks(real_md), name
    per_stage = LAYOUTS[case]["tp"] * LAYOUTS[case].get("ep", 1)
    assert stages_of(mine_md, per_stage) == stages_of(real_md, per_stage)


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_merging_the_split_gives_the_reference_bit_for_bit(case, splits, tmp_path):
    ckpttool.merge(splits(case), tmp_path / "back", config=fixture(case) / "config.json")
    got, want = load_output(tmp_path / "back"), load_output(fixture(case) / "reference")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_common_pt_records_the_layer_pattern_and_the_mamba_sizes(split):
    """What Megatron-LM's ``pretrain_mamba.py`` builds the model from, and what the merge checks on the way back."""
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(split / "iter_0000010" / "common.pt", weights_only=True)
    args = vars(common["args"])
    assert {k: args[k] for k in ("hybrid_override_pattern", "is_hybrid_model", "mamba_state_dim", "mamba_head_dim",
                                 "mamba_num_groups", "mamba_num_heads", "num_layers", "hidden_size", "ffn_hidden_size",
                                 "kv_channels", "num_query_groups", "position_embedding_type", "swiglu",
                                 "squared_relu", "tensor_model_parallel_size", "pipeline_model_parallel_size",
                                 "padded_vocab_size")} == {
        "hybrid_override_pattern": "M*M-", "is_hybrid_model": True, "mamba_state_dim": 8, "mamba_head_dim": 8,
        "mamba_num_groups": 2, "mamba_num_heads": 4, "num_layers": 4, "hidden_size": 32, "ffn_hidden_size": 32,
        "kv_channels": 8, "num_query_groups": 2, "position_embedding_type": "none", "swiglu": False,
        "squared_relu": True, "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 2,
        "padded_vocab_size": 256}


def test_a_tp_that_cuts_through_the_mamba_groups_is_refused(cli, tmp_path):
    """tp=4: megatron-core gives each rank whole Mamba heads and groups (2 groups here) and whole query groups."""
    out = tmp_path / "out"
    result = cli("split", FIXTURE / "reference", out, "--to", "megatron", "--tp", "4", "--config",
                 FIXTURE / "config.json")
    assert_failed_cleanly(result, out, "the mesh tp=4", "tp=4 does not divide the Mamba-2 mixer's 2 n_groups: "
                          "megatron-core gives each rank whole heads and groups")


def test_virtual_pipeline_stages_are_refused(cli, tmp_path):
    """megatron-core's MambaStack asserts it has none: such a checkpoint would not load."""
    out = tmp_path / "out"
    result = cli("split", FIXTURE / "reference", out, "--to", "megatron", "--pp", "2", "--vpp", "2", "--config",
                 FIXTURE / "config.json")
    assert_failed_cleanly(result, out, "vpp=2: megatron-core's MambaStack (the hybrid model) has no virtual pipeline "
                          "stages")


def test_common_pt_records_the_moe_routing(splits):
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(splits("nemotron_h_moe_tp2_ep2") / "iter_0000010" / "common.pt", weights_only=True)
    args = vars(common["args"])
    assert {k: args[k] for k in ("hybrid_override_pattern", "num_experts", "moe_router_topk", "moe_ffn_hidden_size",
                                 "moe_shared_expert_intermediate_size", "moe_router_score_function",
                                 "moe_router_enable_expert_bias", "moe_router_topk_scaling_factor",
                                 "expert_model_parallel_size", "expert_tensor_parallel_size")} == {
        "hybrid_override_pattern": "ME*E", "num_experts": 4, "moe_router_topk": 2, "moe_ffn_hidden_size": 16,
        "moe_shared_expert_intermediate_size": 24, "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "moe_router_topk_scaling_factor": 2.5,
        "expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}


def test_a_latent_moe_is_not_written_naming_it(cli, tmp_path):
    """``moe_latent_size`` (fc1/fc2 latent projections around the experts): megatron-core 0.16 has no such tensors."""
    from ckpttool.families.conventions import megatron_back_hybrid

    config = {**json.loads((MOE / "config.json").read_text()), "moe_latent_size": 8}
    disk = {"backbone.embeddings.weight": (251, 32), "backbone.layers.0.norm.weight": (32,)}
    with pytest.raises(ckpttool.ConfigError, match=r"'backbone.layers.1.mixer' projects its experts through "
                                                   r"moe_latent_size 8"):
        megatron_back_hybrid._moe(disk, "backbone.layers.1.", "decoder.layers.1.", config)


# ------------------------------------------------------------------------------------------------
# the real consumer: megatron-core loads the split and runs the hybrid MambaModel
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not (MEGATRON_VENV / "bin" / "python").is_file(),
                    reason=f"megatron-core venv not at {MEGATRON_VENV} (set CKPTTOOL_MEGATRON_VENV)")
@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_megatron_core_loads_the_split_strictly_and_computes_what_transformers_computes(case, splits,
                                                                                       megatron_torchrun, tmp_path):
    from transformers import NemotronHForCausalLM

    out = tmp_path / "logits.safetensors"
    done = megatron_torchrun(CONSUMER, case, splits(case) / "iter_0000010", out, nproc=4)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    got = load_file(out)
    model = NemotronHForCausalLM.from_pretrained(str(fixture(case) / "reference"), dtype=torch.float32).eval()
    with torch.no_grad():
        want = model(got["tokens"]).logits
    # Megatron's scan (the producer's stand-in, TP 2 sums) against transformers' torch path, fp32 on CPU
    torch.testing.assert_close(got["logits"][..., :VOCAB], want, rtol=0, atol=1e-4)
    assert torch.equal(got["tokens"], load_file(fixture(case) / "logits.safetensors")["tokens"])


# ------------------------------------------------------------------------------------------------
# the audit's root causes on a damaged Megatron-Core hybrid (the fixture's tensors re-saved as a plain DCP)
# ------------------------------------------------------------------------------------------------


def audited(cli, tmp_path: Path, edit) -> dict:
    """``audit --json`` of the fixture's tensors after ``edit(state)``: exit 3 (errors found), the source unchanged."""
    src = megatron_as_dcp(tmp_path, edit)
    before = tree_digest(src)
    result = cli("audit", src, "--json")
    assert result.exit_code == 3, result.output
    assert tree_digest(src) == before
    return json.loads(result.stdout)


def causes(report: dict) -> list[str]:
    """The error root causes, each in words (the findings gathered under them)."""
    return [c["cause"] for c in report["causes"] if c["severity"] == "error"]


def test_a_dropped_mamba_layer_is_one_root_cause(cli, tmp_path):
    def drop(state):
        for name in [n for n in state if n.startswith("decoder.layers.2.mixer.")]:
            del state[name]

    found = causes(audited(cli, tmp_path, drop))
    assert ("the Mamba-2 mixer 'backbone.layers.{L}.mixer' is missing (config hybrid_override_pattern: "
            "'linear_attention'): 8 tensors in layer 2") in found, found
    assert len(found) == 1, found


def test_a_half_tp_cut_in_proj_is_named_as_one_ranks_piece(cli, tmp_path):
    """Every ``in_proj`` part of layer 2 holds one TP rank's rows (of 2) as if they were the whole."""
    def half(state):
        for part in ("z", "x", "B", "C", "dt"):
            name = f"decoder.layers.2.mixer.in_proj.weight.{part}"
            state[name] = state[name][: state[name].shape[0] // 2].clone()

    found = causes(audited(cli, tmp_path, half))
    assert ("'decoder.layers.2.mixer.in_proj.weight.B': 8 rows, expected 16 for the Mamba-2 mixer's "
            "'in_proj.weight.B' from the config (mamba_num_heads, mamba_head_dim, n_groups, ssm_state_size); 8 rows "
            "is one of 2 TP pieces: was one tensor-parallel rank's part saved as the whole?") in found, found
    assert sum("is one of 2 TP pieces" in m for m in found) == 5, found


def test_a_model_whose_embedding_is_not_model_embed_tokens_is_refused_with_one_line(cli, tmp_path):
    """Gemma 3's VLM (``model.language_model.embed_tokens``): no Megatron-Core form, said as such, not a KeyError."""
    out, src = tmp_path / "out", FIXTURES / "gemma3_vl_fsdp2_dcp" / "checkpoint"
    before = tree_digest(src)
    result = cli("split", src, out, "--to", "megatron", "--tp", "2")
    assert_failed_cleanly(result, out, "model_type 'gemma3': ckpttool knows no Megatron-Core form for it; split --to "
                          "megatron writes llama, mistral, qwen2, mixtral, qwen2_moe, gpt_oss, deepseek_v3, nemotron_h")
    assert "internal error" not in result.output
    assert tree_digest(src) == before
