"""A config described from one decoder layer of each kind (ckpttool.families.layers, ckpttool.model.reduced) equals
its full description exactly: names, shapes and order in memory and on disk, MTP layers, buffers, ties, on tiny
configs of every family with a layer rule and on the real-size configs of the true-scale benchmarks (built on the
meta device: no bytes)."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import pytest

from ckpttool.families import reduced_layers
from ckpttool.families.layers import LayerRule, alike, reduce
from ckpttool.model.architecture import model_info
from ckpttool.model.description import ModelInfo
from ckpttool.model.reduced import LayerReduction, expand

pytestmark = pytest.mark.usefixtures("describe_inline")

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

_SMALL = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
          "vocab_size": 128, "max_position_embeddings": 64, "tie_word_embeddings": False}
_MLA = {"q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
        "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "n_group": 1, "topk_group": 1}
_LINEAR = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "head_dim": 16}
_MAMBA = {"mamba_num_heads": 4, "mamba_head_dim": 8, "ssm_state_size": 8, "n_groups": 2, "chunk_size": 8, "expand": 1,
          "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
          "moe_shared_expert_intermediate_size": 16, "head_dim": 16}
_QWEN_MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48}

#: name -> (tiny config, the number of layers its reduced config keeps)
TINY = {
    "deepseek_v3": ({**_SMALL, **_MLA, "model_type": "deepseek_v3", "num_hidden_layers": 5, "first_k_dense_replace": 2,
                     "num_nextn_predict_layers": 1}, 2),
    "deepseek_v3 all MoE": ({**_SMALL, **_MLA, "model_type": "deepseek_v3", "num_hidden_layers": 3,
                             "first_k_dense_replace": 0}, 1),
    "deepseek_v2": ({**_SMALL, **_MLA, "model_type": "deepseek_v2", "num_hidden_layers": 4, "first_k_dense_replace": 1,
                     "q_lora_rank": None}, 2),
    "glm4_moe": ({**_SMALL, "model_type": "glm4_moe", "num_hidden_layers": 4, "first_k_dense_replace": 1,
                  "head_dim": 16, "moe_intermediate_size": 32, "n_routed_experts": 4, "n_shared_experts": 1,
                  "num_experts_per_tok": 2, "n_group": 1, "topk_group": 1}, 2),
    "qwen2_moe": ({**_SMALL, **_QWEN_MOE, "model_type": "qwen2_moe", "num_hidden_layers": 6, "mlp_only_layers": [4],
                   "decoder_sparse_step": 2}, 2),
    "qwen3_moe": ({**_SMALL, **_QWEN_MOE, "model_type": "qwen3_moe", "num_hidden_layers": 4, "mlp_only_layers": [0],
                   "head_dim": 16}, 2),
    "mixtral": ({**_SMALL, "model_type": "mixtral", "num_hidden_layers": 3, "num_local_experts": 4,
                 "num_experts_per_tok": 2}, 1),
    "gpt_oss": ({**_SMALL, "model_type": "gpt_oss", "num_hidden_layers": 4, "num_local_experts": 4, "head_dim": 16,
                 "num_experts_per_tok": 2, "sliding_window": 16, "layer_types": ["sliding_attention", "full_attention"] * 2},
                2),
    "qwen3_next": ({**_SMALL, **_QWEN_MOE, **_LINEAR, "model_type": "qwen3_next", "num_hidden_layers": 5,
                    "mlp_only_layers": [1], "layer_types": ["linear_attention"] * 3 + ["full_attention"] * 2}, 3),
    "qwen3_5_text": ({**_SMALL, **_LINEAR, "model_type": "qwen3_5_text", "num_hidden_layers": 4,
                      "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"]}, 2),
    "nemotron_h pattern": ({**_SMALL, **_MAMBA, "model_type": "nemotron_h", "num_hidden_layers": 6,
                            "hybrid_override_pattern": "M*EM-E"}, 4),
    "nemotron_h layers_block_type": ({**_SMALL, **_MAMBA, "model_type": "nemotron_h",
                                      "layers_block_type": ["mamba", "moe", "attention", "mamba", "moe"]}, 3),
    "llama tied": ({**_SMALL, "model_type": "llama", "num_hidden_layers": 3, "tie_word_embeddings": True}, 1),
    "qwen3 layer_types": ({**_SMALL, "model_type": "qwen3", "num_hidden_layers": 4, "head_dim": 16,
                           "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 2,
                           "layer_types": ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]},
                          2),
}


def _describe_both(config: dict, tmp_path: Path, monkeypatch) -> tuple[ModelInfo, ModelInfo]:
    """(full, reduced) descriptions of ``config``, each in a cache of its own (both are keyed by the config)."""
    monkeypatch.setenv("CKPTTOOL_CACHE", str(tmp_path / "full"))
    full = model_info(config, label="full")
    monkeypatch.setenv("CKPTTOOL_CACHE", str(tmp_path / "reduced"))
    reduced = model_info(config, label="reduced", reduce=reduced_layers)
    return full, reduced


def _assert_same(full: ModelInfo, reduced: ModelInfo) -> None:
    for field in ("memory_shapes", "disk_shapes", "mtp_shapes", "buffers", "tied"):
        assert list(getattr(reduced, field).items()) == list(getattr(full, field).items()), field
    assert (reduced.model_type, reduced.family, reduced.architecture, reduced.config) == \
        (full.model_type, full.family, full.architecture, full.config)


@pytest.mark.parametrize("name", TINY)
def test_the_reduced_description_of_a_tiny_config_is_the_full_one(name, tmp_path, monkeypatch):
    config, kept = TINY[name]
    reduction = reduced_layers(config)
    assert reduction is not None and len(reduction.layer_of) == config.get("num_hidden_layers", 5)
    assert reduction.config["num_hidden_layers"] == kept == max(reduction.layer_of) + 1
    _assert_same(*_describe_both(config, tmp_path, monkeypatch))


def _bench(name: str):
    """``benchmarks/<name>.py`` as a module (the folder is no package; its scripts import each other by name)."""
    if str(BENCHMARKS) not in sys.path:
        sys.path.insert(0, str(BENCHMARKS))
    return importlib.import_module(name)


def test_deepseek_v3_671b_is_described_from_three_layers_as_in_full(tmp_path, monkeypatch):
    """The true-scale benchmarks' config (61 layers: 3 dense, 58 MoE of 256 experts, 1 MTP; FP8 release config)."""
    config = _bench("truescale").config()
    reduction = reduced_layers(config)
    assert reduction.config["num_hidden_layers"] == 2 and reduction.config["first_k_dense_replace"] == 1
    assert reduction.layer_of == (0, 0, 0) + (1,) * 58
    full, reduced = _describe_both(config, tmp_path, monkeypatch)
    assert len(full.disk_shapes) == 45395 and len(full.mtp_shapes) > 0
    _assert_same(full, reduced)


def test_qwen3_moe_235b_is_described_from_one_layer_as_in_full(tmp_path, monkeypatch):
    """benchmarks/first_run_bench.py's Qwen3-MoE-235B-shaped config: 94 MoE layers of 128 experts."""
    config = _bench("first_run_bench").QWEN3_MOE_235B
    reduction = reduced_layers(config)
    assert reduction.config["num_hidden_layers"] == 1 and reduction.layer_of == (0,) * 94
    full, reduced = _describe_both(config, tmp_path, monkeypatch)
    assert len(full.disk_shapes) == 94 * (128 * 3 + 9) + 3
    _assert_same(full, reduced)


# the rule alone, without transformers


def test_a_model_type_without_a_rule_is_not_reduced():
    assert reduced_layers({**_SMALL, "model_type": "gemma3_text", "num_hidden_layers": 8}) is None


def test_a_config_whose_layers_are_all_different_kinds_is_not_reduced():
    assert reduced_layers({**TINY["deepseek_v3"][0], "num_hidden_layers": 2, "first_k_dense_replace": 1}) is None


@pytest.mark.parametrize("change", [{"first_k_dense_replace": None}, {"num_hidden_layers": "61"},
                                    {"layer_types": ["full_attention"]}])
def test_a_config_the_rule_cannot_read_is_described_in_full(change, caplog):
    config = {**TINY["deepseek_v3"][0], **change}
    with caplog.at_level("INFO", logger="ckpttool.families.layers"):
        assert reduced_layers(config) is None
    assert "described in full" in caplog.text


def test_a_rule_whose_shrink_loses_the_kinds_is_not_used(caplog):
    rule = LayerRule(("x",), kinds=lambda c: ["a", "a", "b"][: c["num_hidden_layers"]],
                     shrink=lambda c, layers: {**c, "num_hidden_layers": 1})  # keeps "a" only
    with caplog.at_level("INFO", logger="ckpttool.families.layers"):
        assert reduce(rule, {"model_type": "x", "num_hidden_layers": 3}) is None
    assert "not the kinds it was cut to" in caplog.text


def test_layer_types_are_part_of_a_layers_kind():
    config = {"model_type": "llama", "num_hidden_layers": 4, "layer_types": ["s", "f", "s", "f"]}
    reduction = reduce(alike("llama"), config)
    assert reduction.layer_of == (0, 1, 0, 1)
    assert reduction.config["layer_types"] == ["s", "f"] and reduction.config["num_hidden_layers"] == 2


# the repeating, on plain data


def _info(memory: dict, tied: dict | None = None) -> ModelInfo:
    return ModelInfo("x", {}, memory, dict(memory), tied or {})


def test_layers_are_repeated_by_index_between_what_comes_before_and_after():
    info = _info({"model.embed_tokens.weight": (8, 4), "model.layers.0.a": (4,), "model.layers.1.b": (2,),
                  "model.layers.1.c": (3,), "model.norm.weight": (4,)})
    full = expand(info, LayerReduction({}, (0, 1, 1)), {"n": 3})
    assert list(full.memory_shapes.items()) == [
        ("model.embed_tokens.weight", (8, 4)), ("model.layers.0.a", (4,)), ("model.layers.1.b", (2,)),
        ("model.layers.1.c", (3,)), ("model.layers.2.b", (2,)), ("model.layers.2.c", (3,)), ("model.norm.weight", (4,))]
    assert full.disk_shapes == full.memory_shapes and full.config == {"n": 3}


@pytest.mark.parametrize("memory, tied", [
    ({"model.layers.1.a": (1,), "model.layers.0.a": (1,)}, None),  # layers out of order
    ({"model.layers.0.a": (1,), "model.norm.weight": (1,), "model.layers.1.a": (1,)}, None),  # a name between layers
    ({"model.layers.0.a": (1,)}, None),  # reduced layer 1 holds nothing
    ({"model.layers.0.a": (1,), "model.layers.1.a": (1,)}, {"model.layers.1.a": "model.layers.0.a"}),  # a tie inside
])
def test_what_cannot_be_repeated_faithfully_is_refused(memory, tied):
    assert expand(_info(memory, tied), LayerReduction({}, (0, 1, 1)), {}) is None


def test_a_refused_reduction_is_described_in_full(tmp_path, monkeypatch):
    """A reduction whose reduced config transformers rejects: the full config is described, and its answer cached."""
    config, _ = TINY["llama tied"]
    monkeypatch.setenv("CKPTTOOL_CACHE", str(tmp_path))
    broken = LayerReduction({**config, "hidden_size": 63}, (0, 0, 0))  # 63 is no multiple of 4 heads
    info = model_info(config, reduce=lambda c: broken)
    assert len([n for n in info.memory_shapes if n.startswith("model.layers.")]) == 3 * 9
    assert info.config == config and len(list((tmp_path / "models").iterdir())) == 1
