"""The families layer as adapter objects in one registry (ckpttool.families.registry): lookups, conventions recognised
from tensor names whatever the reader's format name, and the refusal of a layout no convention recognises."""

from __future__ import annotations

import dataclasses
import json
import re
import shutil

import pytest
import torch
from safetensors.torch import save_file

from ckpttool.errors import ConfigError
from ckpttool.families import (
    ADAPTERS,
    CONVENTIONS,
    FamilyAdapter,
    adapter_for,
    convention_for,
    convention_of,
    map_from_hf,
    map_to_hf,
    recognised,
)
from ckpttool.families import glm4v, gpt_oss, llama4, llava, mixtral, nemotron_h, qwen2_moe, qwen2_vl, qwen3_5, qwen3_next
from ckpttool.families.adapter import HF_TP_RULES, REPLICATE, SHARD0, SHARD1
from ckpttool.families.conventions import deepspeed_moe, hf, megatron_core
from ckpttool.families.rules import Rename
from ckpttool.layout.layout import Layout, TensorLayout
from ckpttool.model.description import ModelInfo
from ckpttool.model.architecture import model_info
from ckpttool.model.config_file import read_config
from ckpttool import read_layout  # the readers told what the conventions know
from conftest import FIXTURES, assert_failed_cleanly

MEGATRON = FIXTURES / "megatron_tp2_pp2"


def _layout(fmt: str, *names: str) -> Layout:
    return Layout("/ckpt", fmt, {n: TensorLayout(n, (4, 4), "F32", ()) for n in names})


def _llama() -> ModelInfo:
    return model_info(read_config(MEGATRON / "config.json"), label="config.json")


# --- the registry -------------------------------------------------------------------------------------------------

def test_every_family_and_convention_is_registered_once_by_its_name():
    assert [a.name for a in ADAPTERS] == ["mixtral", "qwen3_next", "glm4v", "qwen2_moe", "qwen2_5_vl", "llava",
                                          "gpt_oss", "nemotron_h", "qwen3_5_text", "llama4"]
    assert ADAPTERS == [mixtral.ADAPTER, qwen3_next.ADAPTER, glm4v.ADAPTER, qwen2_moe.ADAPTER, qwen2_vl.ADAPTER,
                        llava.ADAPTER, gpt_oss.ADAPTER, nemotron_h.ADAPTER, qwen3_5.ADAPTER, llama4.ADAPTER]
    assert [c.name for c in CONVENTIONS] == ["Megatron-Core", "DeepSpeed MoE", "torchtitan", "HuggingFace"]
    assert CONVENTIONS[-1] is hf.CONVENTION  # the catch-all is asked last


def test_the_adapter_of_a_model_is_looked_up_by_its_family():
    info = ModelInfo("qwen3_moe", {}, {}, {}, family="qwen2_moe")
    assert adapter_for(info) is qwen2_moe.ADAPTER
    assert adapter_for(ModelInfo("mixtral", {}, {}, {}, family="mixtral")) is mixtral.ADAPTER


def test_a_model_no_adapter_serves_gets_transformers_names_and_the_llama_tp_plan():
    adapter = adapter_for(ModelInfo("llama", {}, {}, {}, family="llama"))
    assert adapter == FamilyAdapter("llama")
    assert adapter.rules == ()
    assert adapter.tp_placement("model.layers.0.self_attn.q_proj.weight") == SHARD0
    assert adapter.tp_placement("model.layers.0.mlp.down_proj.weight") == SHARD1
    assert adapter.tp_placement("model.layers.0.input_layernorm.weight") == REPLICATE
    assert adapter.tp_placement("model.layers.0.self_attn.rotary.inv_freq") is None
    assert adapter.tp_rules is HF_TP_RULES


def test_a_familys_own_cut_for_a_convention_replaces_the_conventions():
    def own(layout, info):
        return [], ["cut by the toy family"], []

    toy = FamilyAdapter("toy", cuts=(("Megatron-Core", own),))
    layout = _layout("megatron-legacy", "decoder.layers.0.mlp.linear_fc2.weight")
    info = ModelInfo("toy", {}, {}, {}, family="toy")
    assert megatron_core.CONVENTION.to_hf(layout, info, toy) == ([], ["cut by the toy family"], [])
    assert toy.cut_for("DeepSpeed MoE") is None


def test_a_familys_args_checks_are_collected():
    toy = FamilyAdapter("toy", args_checks=(lambda args, info: ["one"], lambda args, info: [], lambda args, info: ["two"]))
    assert toy.check_args({}, ModelInfo("toy", {}, {}, {})) == ["one", "two"]


def test_map_from_hf_runs_the_adapters_rules_backwards():
    info = ModelInfo("mixtral", {}, {"model.layers.0.mlp.gate.weight": (2, 4)}, {}, family="mixtral")
    (tensor,) = map_from_hf(info)
    assert [s.source for s in tensor.slices] == ["model.layers.0.block_sparse_moe.gate.weight"]


# --- recognition --------------------------------------------------------------------------------------------------

def test_the_format_name_is_one_signal():
    assert convention_for(_layout("megatron-dist", "anything")) is megatron_core.CONVENTION
    assert convention_for(_layout("deepspeed-moe", "model.layers.0.mlp.w1.weight")) is deepspeed_moe.CONVENTION
    assert convention_of(_layout("megatron-legacy", "x")) == "Megatron-Core"
    assert convention_of(_layout("dcp", "model.embed_tokens.weight")) is None  # transformers' own names


def test_megatron_core_names_are_recognised_under_a_format_name_no_convention_lists():
    layout = _layout("some-new-reader", "embedding.word_embeddings.weight", "decoder.layers.0.mlp.linear_fc1.weight",
                     "decoder.final_layernorm.weight", "output_layer.weight")
    assert convention_for(layout) is megatron_core.CONVENTION
    assert convention_of(layout) == "Megatron-Core"
    # one name that is no Megatron-Core GPT name: not this convention's layout
    mixed = _layout("some-new-reader", "decoder.layers.0.mlp.linear_fc1.weight", "model.norm.weight")
    assert convention_of(mixed) is None


def test_deepspeed_moe_names_are_recognised_under_a_format_name_no_convention_lists():
    layout = _layout("some-new-reader", "model.layers.0.block_sparse_moe.deepspeed_moe.gate.wg.weight")
    assert convention_for(layout) is deepspeed_moe.CONVENTION


def test_a_megatron_layout_under_another_format_name_maps_as_the_megatron_reader_s():
    layout = read_layout(MEGATRON / "legacy", model=None)
    info = _llama()
    renamed = dataclasses.replace(layout, format="some-new-reader")
    before, after = map_to_hf(layout, info), map_to_hf(renamed, info)
    assert after.adapter == before.adapter == "llama (Megatron-Core convention)"
    assert after.specs == before.specs
    assert after.problems == before.problems == []
    assert len(after.specs) > 10


# --- what no convention recognises --------------------------------------------------------------------------------

#: a framework's own names no registered convention knows (nanoGPT's; torchtitan's were the example until it got
#: its convention, ckpttool/families/conventions/torchtitan.py)
TITAN = ("wte.weight", "h.0.attn.c_attn.weight", "h.0.mlp.c_fc.weight", "ln_f.weight", "head.weight")


def test_a_layout_no_convention_recognises_is_refused_with_what_was_looked_for():
    layout = _layout("dcp", *TITAN)
    info = _llama()
    assert convention_for(layout, info) is None
    with pytest.raises(ConfigError) as caught:
        recognised(layout, info)
    assert str(caught.value) == (
        "'/ckpt': no source convention recognises its tensor names of a llama model ('wte.weight', "
        "'h.0.attn.c_attn.weight', 'h.0.mlp.c_fc.weight' and 2 more; format 'dcp'). Looked for:\n"
        "  - Megatron-Core: embedding.*, decoder.layers.*, output_layer.*, mtp.layers.* (Megatron-Core's GPT names)\n"
        "  - DeepSpeed MoE: *.deepspeed_moe.experts.deepspeed_experts.*, *.deepspeed_moe.gate.wg.weight (DeepSpeed MoE)\n"
        "  - torchtitan: tok_embeddings.weight, layers.N.attention[.qkv_linear].wq.weight, "
        "layers.N.feed_forward.w1.weight (torchtitan)\n"
        "  - HuggingFace: the model's in-memory or on-disk HuggingFace names (with a config)\n"
        "Is this the config the model was trained with? A framework naming tensors its own way needs a convention "
        "(docs/adding-a-family.md)"
    )


def test_a_layout_with_a_known_name_is_recognised_as_transformers_own():
    assert recognised(_layout("dcp", "model.norm.weight", *TITAN), _llama()) is hf.CONVENTION


def test_merging_names_no_convention_recognises_is_refused_and_writes_nothing(cli, tmp_path):
    src = tmp_path / "titan"
    src.mkdir()
    save_file({name: torch.zeros(2, 2) for name in TITAN}, str(src / "model.safetensors"))
    shutil.copy(MEGATRON / "config.json", src / "config.json")
    before = {p.name: p.read_bytes() for p in src.iterdir()}
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(
        result, out,
        f"'{src}': no source convention recognises its tensor names of a llama model ('h.0.attn.c_attn.weight'",
        "  - Megatron-Core: embedding.*, decoder.layers.*",
        "Is this the config the model was trained with?",
    )
    assert {p.name: p.read_bytes() for p in src.iterdir()} == before


def test_a_dry_run_names_the_adapter_of_a_recognised_layout(cli, tmp_path):
    result = cli("merge", MEGATRON / "legacy", tmp_path / "out", "--config", MEGATRON / "config.json", "--dry-run",
                 "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["adapter"] == "llama (Megatron-Core convention)"
    assert not (tmp_path / "out").exists()


def test_a_rule_added_to_a_family_is_what_map_to_hf_applies():
    toy = FamilyAdapter("toy", rules=(Rename(r"^(.*)\.w$", r"\1.weight"),))
    layout = _layout("dcp", "a.w", "b.weight")
    info = ModelInfo("toy", {}, {}, {"a.weight": (4, 4), "b.weight": (4, 4)}, family="toy")
    specs, notes, problems = hf.CONVENTION.to_hf(layout, info, toy)
    assert sorted(s.name for s in specs) == ["a.weight", "b.weight"]
    assert re.fullmatch(r"toy \(its rules\)", hf.CONVENTION.describe(info, toy, True))


# --- placements: the adapter's, asked by split ---------------------------------------------------------------------

def test_split_places_tensors_by_the_family_adapters_tp_rules():
    from ckpttool.commands.meshes import Mesh, shard_tensors

    toy = FamilyAdapter("toy", tp_rules=((r"\.foo\.weight$", SHARD1),))
    (sharding,) = shard_tensors([("m.foo.weight", (4, 6), False)], Mesh(tp=2), toy.tp_placement)
    assert sharding.placements == (REPLICATE, SHARD1)
    with pytest.raises(ConfigError) as caught:
        shard_tensors([("m.bar.weight", (4, 6), False)], Mesh(tp=2), toy.tp_placement)
    assert "'m.bar.weight': no tensor-parallel placement is known for it (tp=2)" in str(caught.value)


def test_the_megatron_way_back_names_a_tensor_it_cannot_place():
    from ckpttool.families.conventions import megatron_back

    assert megatron_back.tp_placement("decoder.layers.self_attention.linear_qkv.weight") == megatron_back.TP_RULES[3][1]
    with pytest.raises(ConfigError, match=r"^'decoder.layers.foo.weight': the Megatron-Core convention knows no "
                                          r"tensor-parallel placement for it$"):
        megatron_back.tp_placement("decoder.layers.foo.weight")
