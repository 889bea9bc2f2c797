"""The training args of a Megatron checkpoint against its HuggingFace config, for DeepSeek-V3-style models (MLA,
routing, MTP; ckpttool.families.conventions.megatron_args and ckpttool.families.deepseek), and what the legacy reader takes from them for MLA and MTP tensors.

The fixtures are tests/test_megatron_deepseek.py's (fixtures/make_megatron_deepseek.py).
"""

from __future__ import annotations

import json

import pytest

import ckpttool
from ckpttool.model.architecture import model_info
from ckpttool.errors import ConfigError, SourceError
from ckpttool.families.registry import MEGATRON_TP as megatron_args  # the convention's args check, the family's after
from ckpttool.readers.megatron import legacy as megatron_legacy
from conftest import assert_failed_cleanly
from test_megatron_deepseek import ADAPTER, config_of, fixture

# ------------------------------------------------------------------------------------------------
# the args check knows MLA and DeepSeek's routing
# ------------------------------------------------------------------------------------------------


def test_head_dim_is_not_kv_channels_under_mla(tmp_path):
    """transformers writes a DeepseekV3 config's head_dim as qk_rope_head_dim (4); kv_channels (8) is v_head_dim."""
    case = "deepseek_tp2_ep2"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**config_of(case), "head_dim": 4}))
    result = ckpttool.merge(fixture(case) / "torch_dist", tmp_path / "out", config=config)
    assert result.adapter == ADAPTER


@pytest.mark.parametrize("fmt", ["legacy", "torch_dist"])
def test_args_contradicting_the_config_are_refused_each_named(cli, fmt, tmp_path):
    case = "deepseek_pp2_ep2"
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**config_of(case), "kv_lora_rank": 8, "qk_rope_head_dim": 2, "routed_scaling_factor": 1.0,
                                  "topk_group": 2, "first_k_dense_replace": 2, "num_nextn_predict_layers": 0,
                                  "rope_interleave": False, "q_lora_rank": 16}))
    out = tmp_path / "out"
    result = cli("merge", fixture(case) / fmt, out, "--config", config)
    assert_failed_cleanly(
        result, out, "the checkpoint's training args disagree with the config (8):",
        "  - q_lora_rank: config.json q_lora_rank = 16 expected, found None in the args (None: the query is not compressed)",
        "  - kv_lora_rank: config.json kv_lora_rank = 8 expected, found 16 in the args",
        "  - qk_pos_emb_head_dim: config.json qk_rope_head_dim = 2 expected, found 4 in the args",
        "  - moe_router_topk_scaling_factor: config.json routed_scaling_factor = 1.0 expected, found 2.5 in the args",
        "  - moe_router_num_groups/moe_router_group_topk: config.json n_group/topk_group = 'no group limit' expected, "
        "found '1 of 2 groups' in the args",
        "  - mtp_num_layers: config.json num_nextn_predict_layers = 0 expected, found 1 in the args",
        "  - multi_latent_attention: Megatron's MLA rotates the rope dims as interleaved pairs, what transformers does "
        "with rope_interleave true; config.json says False",
        "  - moe_layer_freq: [0, 1, 1] in the args (0: a dense layer, 1: MoE), but config.json first_k_dense_replace = 2 "
        "gives [0, 0, 1]",
        "Pass the config of the model this checkpoint trained (--config).",
    )


ARGS = {  # the fixture's args, as far as the router is concerned
    "multi_latent_attention": True, "num_experts": 4, "moe_router_topk": 2, "moe_router_score_function": "sigmoid",
    "moe_router_enable_expert_bias": True, "moe_router_num_groups": 2, "moe_router_group_topk": 1,
    "moe_router_topk_scaling_factor": 2.5, "rotary_interleaved": False,
}


@pytest.mark.parametrize(("change", "message"), [
    ({"moe_router_score_function": "softmax"},
     "moe_router_score_function: config.json scoring_func = 'sigmoid' expected, found 'softmax' in the args"),
    ({"moe_router_enable_expert_bias": False},
     "moe_router_enable_expert_bias: False in the args, but a deepseek_v3 model adds a router bias "
     "(mlp.gate.e_score_correction_bias)"),
    ({"moe_router_topk": 4, "num_experts": 8},
     "moe_router_group_topk: Megatron scores a group by its top moe_router_topk // moe_router_group_topk = 4 experts, "
     "transformers' deepseek_v3 by its top 2"),
    ({"rotary_interleaved": True},
     "rotary_interleaved: Megatron's MLA then rotates interleaved pairs within de-interleaved halves"),
    ({"rope_type": "yarn"}, "rope_type: config.json rope_parameters.rope_type = 'rope' expected, found 'yarn' in the args"),
    ({"num_layers": 3, "moe_layer_freq": [0, 1, 1], "ffn_hidden_size": 32, "moe_ffn_hidden_size": 16},
     "ffn_hidden_size: config.json intermediate_size = 64 expected, found 32 in the args"),
    ({"moe_shared_expert_intermediate_size": 32},
     "moe_shared_expert_intermediate_size: config.json n_shared_experts x moe_intermediate_size = 16 expected, found 32"),
])
def test_routing_and_rotary_args_transformers_cannot_compute_are_refused(change, message):
    info = model_info(config_of("deepseek_tp2_ep2"))
    with pytest.raises(ConfigError, match="training args disagree") as e:
        megatron_args.check_args({**ARGS, **change}, info, "common.pt")
    assert message in str(e.value)


def test_unnormalised_sigmoid_weights_are_refused():
    info = model_info({**config_of("deepseek_tp2_ep2"), "norm_topk_prob": False})
    with pytest.raises(ConfigError, match="norm_topk_prob: Megatron normalises the sigmoid weights"):
        megatron_args.check_args(ARGS, info, "common.pt")
    megatron_args.check_args(ARGS, model_info(config_of("deepseek_tp2_ep2")), "common.pt")  # the fixture's agree


# ------------------------------------------------------------------------------------------------
# the legacy reader: what the args say of MLA's down projections and of MTP layers
# ------------------------------------------------------------------------------------------------


def test_mla_down_projections_split_on_rows_or_whole_on_every_rank():
    """The local spec splits MLA's down projections over TP (the fixtures); Transformer Engine's keeps them whole
    on every rank ('duplicated'): the rows a rank holds against the args' tell which."""
    from ckpttool.layout.builder import LayoutBuilder

    builder = LayoutBuilder("x", megatron_legacy.NAME)
    builder.set_parallel(tp=2, pp=1, ep=1)
    args = {"num_layers": 3, "kv_lora_rank": 16, "qk_pos_emb_head_dim": 4}
    placer = megatron_legacy._Placer(builder, args, None, "", "mp_rank_00/model_optim_rng.pt", megatron_args)
    down = "decoder.layers.0.self_attention.linear_kv_down_proj.weight"
    assert placer._down_dim("f", "k", down, (10, 32), 2) == 0
    assert placer._down_dim("f", "k", down, (20, 32), 2) is None
    with pytest.raises(SourceError, match=r"'f': 'k' has 12 rows: neither the 20 rows of the args' "
                                          r"kv_lora_rank \+ qk_pos_emb_head_dim nor a 1/2 tensor-parallel share"):
        placer._down_dim("f", "k", down, (12, 32), 2)
    with pytest.raises(SourceError, match=r"'f': 'k' has 8 rows: the args record no q_lora_rank to tell whether "
                                          r"tensor-parallel ranks split it"):
        placer._down_dim("f", "k", "decoder.layers.0.self_attention.linear_q_down_proj.weight", (8, 32), 2)


def test_legacy_mtp_layer_beyond_the_args_is_refused_and_its_experts_renumbered():
    from ckpttool.layout.builder import LayoutBuilder

    builder = LayoutBuilder("x", megatron_legacy.NAME)
    builder.set_parallel(tp=1, pp=2, ep=2)
    placer = megatron_legacy._Placer(builder, {"num_layers": 3, "num_experts": 4, "mtp_num_layers": 1}, None, "", "f",
                                     megatron_args)
    rank = megatron_legacy._Rank(tp=0, pp=1, ep=1)
    expert = "mtp.layers.0.transformer_layer.mlp.experts.local_experts.1.linear_fc2.weight"
    assert placer._global_name(expert, rank, 2, "f") == ("mtp.layers.0.transformer_layer.mlp.experts.3.linear_fc2.weight", True)
    with pytest.raises(SourceError, match=r"^'f': 'mtp.layers.1.transformer_layer.input_layernorm.weight' is MTP layer 1, "
                                          r"but the args say mtp_num_layers 1$"):
        placer._global_name("mtp.layers.1.transformer_layer.input_layernorm.weight", rank, 2, "f")
