"""Megatron readers (``megatron-legacy``, ``megatron-dist``) against checkpoints megatron-core 0.16.1 wrote.

Every fixture (``fixtures/make_megatron.py``) holds one model saved both ways from the same live sharded model,
the full weights under HuggingFace names as Megatron itself gathered them (reference/), and Megatron's own
forward logits. A merge must equal the reference bit for bit and give Megatron's logits in transformers.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from ckpttool.layout.layout import Padding
from ckpttool import read_layout  # the readers told what the conventions know
from ckpttool.readers import detect_format
from ckpttool.readers.megatron import legacy as megatron_legacy
from conftest import FIXTURES, apply_spec, assert_failed_cleanly, load_output, tree_digest

CASES = ("tp2_padvocab", "tp2_pp2", "pp2_uneven", "pp2_vpp2", "ep2_moe", "qwen2moe_tp2_ep2", "qwen2moe_pp2_ep2")
FORMATS = {"legacy": "megatron-legacy", "torch_dist": "megatron-dist"}
#: every (case, format) on disk; the singleton_local_shards variant is torch_dist only
SOURCES = [(case, fmt) for case in CASES for fmt in sorted(FORMATS)] + [("ep2_moe_singleton", "torch_dist")]
#: what each fixture's args record (tp, pp, ep) and its vocab rows as stored / true
PARALLEL = {"tp2_padvocab": "tp=2 pp=1 ep=1 dp=1", "tp2_pp2": "tp=2 pp=2 ep=1 dp=1",
            "pp2_uneven": "tp=1 pp=2 ep=1 dp=1", "pp2_vpp2": "tp=1 pp=2 ep=1 vpp=2 dp=1",
            "ep2_moe": "tp=1 pp=1 ep=2 dp=2", "ep2_moe_singleton": "tp=1 pp=1 ep=2 dp=2",
            "qwen2moe_tp2_ep2": "tp=2 pp=1 ep=2 dp=2", "qwen2moe_pp2_ep2": "tp=1 pp=2 ep=2 dp=2"}
VOCAB = {"tp2_padvocab": (1280, 1030), "tp2_pp2": (1024, 1000), "pp2_uneven": (1024, 1024), "pp2_vpp2": (1024, 1000),
         "ep2_moe": (1024, 1000), "ep2_moe_singleton": (1024, 1000), "qwen2moe_tp2_ep2": (256, 250),
         "qwen2moe_pp2_ep2": (256, 250)}


def fixture(case: str) -> Path:
    path = FIXTURES / f"megatron_{case}"
    assert (path / "reference").is_dir(), f"fixture {path.name} missing: run fixtures/make_megatron.py"
    return path


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Each (case, format) merged once through the CLI, shared by the tests that read the output."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    done: dict[tuple[str, str], Path] = {}

    def get(case: str, fmt: str) -> Path:
        if (case, fmt) not in done:
            out = tmp_path_factory.mktemp(f"{case}-{fmt}") / "out"
            src = fixture(case) / fmt
            before = tree_digest(src)
            result = CliRunner().invoke(main, ["merge", str(src), str(out), "--config", str(fixture(case) / "config.json")])
            assert result.exit_code == 0, result.output
            assert tree_digest(src) == before
            done[(case, fmt)] = out
        return done[(case, fmt)]

    return get


@pytest.mark.parametrize(("case", "fmt"), SOURCES)
def test_merge_equals_megatrons_own_full_weights(merged, case, fmt):
    got = load_output(merged(case, fmt))
    want = load_file(fixture(case) / "reference" / "model.safetensors")
    assert sorted(got) == sorted(want)
    differ = [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])]
    assert differ == []


@pytest.mark.parametrize(("case", "fmt"), SOURCES)
def test_transformers_gives_megatrons_logits(merged, case, fmt):
    from transformers import AutoModelForCausalLM

    saved = load_file(fixture(case) / "logits.safetensors")
    model = AutoModelForCausalLM.from_pretrained(merged(case, fmt), dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        logits = model(saved["tokens"]).logits
    padded, vocab = VOCAB[case]
    assert saved["logits"].shape[-1] == padded  # Megatron computes logits over the padded vocab
    assert logits.shape[-1] == vocab
    torch.testing.assert_close(logits, saved["logits"][..., :vocab], rtol=0, atol=1e-5)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_dry_run_shows_format_parallel_layout_and_mapping(cli, fmt, tmp_path):
    src = fixture("tp2_pp2") / fmt
    result = cli("merge", src, tmp_path / "out", "--config", fixture("tp2_pp2") / "config.json", "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"({FORMATS[fmt]})" in result.output
    assert "parallel: tp=2 pp=2 ep=1 dp=1" in result.output
    stacked = fmt == "torch_dist"
    qkv = "decoder.layers.self_attention.linear_qkv.weight" if stacked else "decoder.layers.3.self_attention.linear_qkv.weight"
    assert f"model.layers.3.self_attn.q_proj.weight  F32 [32x32]  <- {qkv} (2 pieces)" in result.output
    assert "model.embed_tokens.weight  F32 [1000x32]  <- embedding.word_embeddings.weight (2 pieces)" in result.output
    assert "stripped vocab padding: rows 1000..1024 of 'embedding.word_embeddings.weight'" in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(("case", "fmt"), SOURCES)
def test_detection_from_the_root_and_from_the_iteration_directory(case, fmt):
    assert detect_format(fixture(case) / fmt) == FORMATS[fmt]
    assert detect_format(fixture(case) / fmt / "iter_0000010") == FORMATS[fmt]


def test_singleton_local_shards_names_are_cut_too():
    """``singleton_local_shards``: per-layer and per-expert keys, SwiGLU halves under ``_w``/``_v``."""
    layout = read_layout(fixture("ep2_moe_singleton") / "torch_dist")
    assert "decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_w" in layout.tensors
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" not in layout.tensors


@pytest.mark.parametrize(("case", "fmt"), SOURCES)
def test_layout_records_parallel_layout_and_vocab_padding_once(case, fmt):
    from ckpttool.model.architecture import model_info

    info = model_info(json.loads((fixture(case) / "config.json").read_text()))
    layout = read_layout(fixture(case) / fmt, model=info)
    parallel = " ".join(f"{k}={v}" for k, v in layout.parallel.items())
    assert parallel == PARALLEL[case]
    padded, vocab = VOCAB[case]
    for fqn in ("embedding.word_embeddings.weight", "output_layer.weight"):
        tensor = layout.tensors[fqn]
        assert tensor.global_shape[0] == padded
        assert tensor.padding == ((Padding(0, vocab),) if padded != vocab else ())
        assert tensor.true_shape[0] == vocab


def test_naive_concatenation_of_swiglu_tp_pieces_is_wrong():
    """Each TP rank stores [gate_r; up_r]: concatenating the ranks' fc1 and halving it mixes gate and up."""
    root = fixture("tp2_padvocab") / "legacy"
    ref = load_file(fixture("tp2_padvocab") / "reference" / "model.safetensors")
    local = []
    for rank in (0, 1):
        path = root / f"iter_0000010/mp_rank_{rank:02d}/model_optim_rng.pt"
        with open(path, "rb") as f:
            state = megatron_legacy.megatron.scan_checkpoint(f, label=path.name)
        t = state["model"]["decoder.layers.0.mlp.linear_fc1.weight"]
        data = path.read_bytes()
        start = t.byte_offset()
        local.append(torch.frombuffer(bytearray(data[start:start + t.numel * 4]), dtype=torch.float32).reshape(t.shape))
    naive = torch.cat(local)
    ffn = naive.shape[0] // 2
    gate, up = ref["model.layers.0.mlp.gate_proj.weight"], ref["model.layers.0.mlp.up_proj.weight"]
    assert not torch.equal(naive[:ffn], gate) and not torch.equal(naive[ffn:], up)
    half = local[0].shape[0] // 2
    assert torch.equal(torch.cat([local[0][:half], local[1][:half]]), gate)
    assert torch.equal(torch.cat([local[0][half:], local[1][half:]]), up)


def test_pipeline_stages_and_experts_are_renumbered():
    layout = read_layout(fixture("pp2_uneven") / "legacy")
    files = {fqn: {p.file for p in t.pieces} for fqn, t in layout.tensors.items()}
    # uneven stages: stage 0 holds layer 0, stage 1 holds layers 1 and 2 (its local 0 and 1)
    assert files["decoder.layers.0.self_attention.linear_qkv.weight"] == {"iter_0000010/mp_rank_00_000/model_optim_rng.pt"}
    assert files["decoder.layers.2.self_attention.linear_qkv.weight"] == {"iter_0000010/mp_rank_00_001/model_optim_rng.pt"}
    # virtual stages: stage 0 holds chunks model0 (layer 0) and model1 (layer 2), stage 1 layers 1 and 3
    vpp = read_layout(fixture("pp2_vpp2") / "legacy")
    stage0, stage1 = "iter_0000010/mp_rank_00_000/model_optim_rng.pt", "iter_0000010/mp_rank_00_001/model_optim_rng.pt"
    where = {layer: {(p.file, p.key) for p in vpp.tensors[f"decoder.layers.{layer}.self_attention.linear_qkv.weight"].pieces}
             for layer in range(4)}
    assert where == {0: {(stage0, "model0.decoder.layers.0.self_attention.linear_qkv.weight")},
                     1: {(stage1, "model0.decoder.layers.0.self_attention.linear_qkv.weight")},
                     2: {(stage0, "model1.decoder.layers.0.self_attention.linear_qkv.weight")},
                     3: {(stage1, "model1.decoder.layers.0.self_attention.linear_qkv.weight")}}
    moe = read_layout(fixture("ep2_moe") / "legacy")
    assert {p.file for p in moe.tensors["decoder.layers.1.mlp.experts.3.linear_fc2.weight"].pieces} == {
        "iter_0000010/mp_rank_00_001/model_optim_rng.pt"}
    assert dict(moe.tensors["decoder.layers.1.mlp.experts.2.linear_fc1.weight"].pieces[0].tags)["ep_rank"] == 1


def _copy(case: str, fmt: str, tmp_path: Path) -> Path:
    dest = tmp_path / case
    shutil.copytree(fixture(case) / fmt, dest / fmt)
    shutil.copy(fixture(case) / "config.json", dest / "config.json")
    return dest / fmt


def test_missing_rank_directory_names_the_file_and_the_region(cli, tmp_path):
    src = _copy("tp2_pp2", "legacy", tmp_path)
    shutil.rmtree(src / "iter_0000010" / "mp_rank_01_001")
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'model.layers.3.self_attn.o_proj.weight': columns 16..32 covered by no piece",
                          "'iter_0000010/mp_rank_01_001/model_optim_rng.pt', which is missing",
                          "'lm_head.weight': rows 512..1000 covered by no piece")


def test_missing_distcp_file_names_the_file_and_the_region(cli, tmp_path):
    src = _copy("tp2_pp2", "torch_dist", tmp_path)
    (src / "iter_0000010" / "__3_0.distcp").unlink()
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'lm_head.weight': rows 512..1000 covered by no piece",
                          "'iter_0000010/__3_0.distcp', which is missing")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_args_that_disagree_with_the_config_are_an_error(cli, fmt, tmp_path):
    src = _copy("tp2_padvocab", fmt, tmp_path)
    config = json.loads((src.parent / "config.json").read_text())
    config["rms_norm_eps"] = 1e-6  # shapes agree: only the args can tell
    (src.parent / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "training args disagree with the config",
                          "norm_epsilon: config.json rms_norm_eps = 1e-06 expected, found 1e-05 in the args")


@pytest.mark.parametrize("fmt", sorted(FORMATS))
def test_inconsistent_vocab_padding_is_an_error(cli, fmt, tmp_path):
    src = _copy("tp2_padvocab", fmt, tmp_path)
    config = json.loads((src.parent / "config.json").read_text())
    config["vocab_size"] = 1300  # 1280 stored rows: neither 1300 nor its padding 2560
    (src.parent / "config.json").write_text(json.dumps(config))
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'embedding.word_embeddings.weight'", "inconsistent vocab padding: 1280 rows",
                          "expected either the true vocab 1300", "or the padded vocab 2560")


def test_missing_expert_rank_file_names_the_file_and_the_experts(cli, tmp_path):
    src = _copy("ep2_moe", "legacy", tmp_path)
    shutil.rmtree(src / "iter_0000010" / "mp_rank_00_001")  # EP rank 1: experts 2 and 3
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'model.layers.1.block_sparse_moe.experts.3.w2.weight': the whole tensor covered by no piece",
                          "'iter_0000010/mp_rank_00_001/model_optim_rng.pt', which is missing")
    assert "experts.1.w2.weight'" not in result.stderr  # EP rank 0's experts are there


def test_missing_only_file_of_a_stage_is_named(cli, tmp_path):
    src = _copy("pp2_uneven", "legacy", tmp_path)
    shutil.rmtree(src / "iter_0000010" / "mp_rank_00_001")  # stage 1: layers 1 and 2, the final norm, lm_head
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "pipeline stages are missing",
                          "'iter_0000010/mp_rank_00_001/model_optim_rng.pt' (pipeline stage 1, tp rank 0, ep rank 0): "
                          "layers 1..2, decoder.final_layernorm.weight and output_layer.weight")


def test_a_rank_directory_that_does_not_fit_the_args_is_an_error(cli, tmp_path):
    src = _copy("tp2_padvocab", "legacy", tmp_path)
    shutil.copytree(src / "iter_0000010" / "mp_rank_01", src / "iter_0000010" / "mp_rank_01_001")
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'iter_0000010/mp_rank_01_001': does not fit the args' layout tp=2 pp=1 ep=1")


def test_a_pickle_that_asks_for_code_is_refused(cli, tmp_path):
    import argparse
    import os

    src = _copy("tp2_padvocab", "legacy", tmp_path)
    evil = {"args": argparse.Namespace(tensor_model_parallel_size=2), "model": {}, "hook": os.system}
    torch.save(evil, src / "iter_0000010" / "mp_rank_01" / "model_optim_rng.pt")
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'iter_0000010/mp_rank_01/model_optim_rng.pt': refused to unpickle",
                          "system", "nothing was executed")


def test_release_tracker_and_generic_merge_without_config(tmp_path):
    import ckpttool

    src = tmp_path / "ckpt"
    shutil.copytree(fixture("tp2_pp2") / "legacy" / "iter_0000010", src / "release")
    (src / "latest_checkpointed_iteration.txt").write_text("release\n")
    result = ckpttool.merge(src, tmp_path / "out", raw_names=True)  # no config anywhere: Megatron-Core's global names
    assert result.format == "megatron-legacy"
    got = load_output(tmp_path / "out")
    ref = load_file(fixture("tp2_pp2") / "reference" / "model.safetensors")
    fc1 = got["decoder.layers.3.mlp.linear_fc1.weight"]
    gate, up = ref["model.layers.3.mlp.gate_proj.weight"], ref["model.layers.3.mlp.up_proj.weight"]
    assert torch.equal(fc1, torch.cat([gate, up]))
    assert got["embedding.word_embeddings.weight"].shape == (1024, 32)  # no config, no true vocab: kept as stored


def test_torch_dist_without_dcp_metadata_is_named(cli, tmp_path):
    src = _copy("tp2_padvocab", "torch_dist", tmp_path)
    (src / "iter_0000010" / ".metadata").unlink()
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "iter_0000010", "no .metadata file")


def test_qkv_and_gate_up_cut_follow_megatrons_views():
    """Property: for any grouping, the cut equals Megatron's own view of the fused rows (stacked layers)."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ckpttool.layout.layout import Layout, TensorLayout
    from ckpttool.model.description import ModelInfo
    from ckpttool.families.conventions import megatron_core as megatron

    @settings(max_examples=40, deadline=None)
    @given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4), st.integers(1, 3), st.integers(1, 5))
    def check(groups, per_group, head_dim, layers, ffn):
        hidden = 3
        heads = groups * per_group
        rows = groups * (per_group + 2) * head_dim
        qkv = torch.arange(layers * rows * hidden, dtype=torch.float32).reshape(layers, rows, hidden)
        fc1 = -torch.arange(layers * 2 * ffn * hidden, dtype=torch.float32).reshape(layers, 2 * ffn, hidden)
        names = {"decoder.layers.self_attention.linear_qkv.weight": qkv, "decoder.layers.mlp.linear_fc1.weight": fc1,
                 # singleton_local_shards: one more layer under its own index, the SwiGLU halves under _w / _v
                 f"decoder.layers.{layers}.mlp.linear_fc1.weight_w": fc1[0, :ffn] + 0.5,
                 f"decoder.layers.{layers}.mlp.linear_fc1.weight_v": fc1[0, ffn:] + 0.5}
        layout = Layout("", "megatron-dist", {n: TensorLayout(n, tuple(t.shape), "F32", ()) for n, t in names.items()})
        config = {"num_attention_heads": heads, "num_key_value_heads": groups, "head_dim": head_dim,
                  "hidden_size": hidden}
        specs, _, problems = megatron.to_hf(layout, ModelInfo("llama", config, {}, {}))
        assert problems == []
        got = {s.name: apply_spec(s, names) for s in specs}
        for layer in range(layers):
            view = qkv[layer].view(groups, per_group + 2, head_dim, hidden)
            h = f"model.layers.{layer}."
            assert torch.equal(got[h + "self_attn.q_proj.weight"], view[:, :per_group].reshape(-1, hidden))
            assert torch.equal(got[h + "self_attn.k_proj.weight"], view[:, per_group].reshape(-1, hidden))
            assert torch.equal(got[h + "self_attn.v_proj.weight"], view[:, per_group + 1].reshape(-1, hidden))
            gate, up = fc1[layer].chunk(2)
            assert torch.equal(got[h + "mlp.gate_proj.weight"], gate) and torch.equal(got[h + "mlp.up_proj.weight"], up)
        h = f"model.layers.{layers}."
        assert torch.equal(got[h + "mlp.gate_proj.weight"], names[f"decoder.layers.{layers}.mlp.linear_fc1.weight_w"])
        assert torch.equal(got[h + "mlp.up_proj.weight"], names[f"decoder.layers.{layers}.mlp.linear_fc1.weight_v"])

    check()


def test_padding_without_args_is_not_guessed(cli, tmp_path):
    src = _copy("tp2_padvocab", "torch_dist", tmp_path)
    (src / "iter_0000010" / "common.pt").unlink()  # the args go with it
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'embedding.word_embeddings.weight'", "1280 rows, but config.json says vocab_size 1030",
                          "records no args")
