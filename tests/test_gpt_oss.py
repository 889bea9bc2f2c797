"""gpt-oss (transformers ``GptOssForCausalLM``) as a family: attention sinks, expert and router biases, gate and up
interleaved by column in ``mlp.experts.gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]`` stored transposed relative
to ``nn.Linear``.

Fixtures: ``gpt_oss_fsdp2_dcp`` (torch FSDP2 + DCP) and ``gpt_oss_hf_ep2`` (transformers ``DistributedConfig``
tp2/ep2) from ``fixtures/make_gpt_oss.py``; ``megatron_gpt_oss_tp2_ep2`` (megatron-core 0.16.1, TP=2 x EP=2,
legacy and torch_dist) from ``fixtures/make_megatron_gpt_oss.py``, whose per-expert ``linear_fc1 [2I, H]`` is
``[gate; up]`` and ``linear_fc2 [H, I]``: the adapter (``ckpttool/families/gpt_oss.py``) interleaves and
transposes them with the plan's transforms. Every merge equals ``reference/`` bit for bit, loads strictly in
transformers with equal logits, and passes the audit; split goes back bit for bit.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpttool
from conftest import FIXTURES, assert_failed_cleanly, fixture_dir, load_output, tree_digest

DCP_FIXTURES = ("gpt_oss_fsdp2_dcp", "gpt_oss_hf_ep2")
TOKENS = [[5, 17, 199, 3, 250, 42, 7, 100, 11, 128, 64, 2]]


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and got[name].shape == tensor.shape, name
        assert torch.equal(got[name], tensor), name


def logits_of(directory: Path, tokens: list[list[int]] = TOKENS) -> torch.Tensor:
    """transformers' logits on ``tokens``, after a strict load (no missing, unexpected or mismatched key)."""
    from transformers import GptOssForCausalLM

    model, info = GptOssForCausalLM.from_pretrained(str(directory), output_loading_info=True, dtype=torch.float32)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), (key, info[key])
    with torch.no_grad():
        return model.eval()(torch.tensor(tokens)).logits


def audit_of(directory: Path) -> dict:
    return json.loads((directory / "ckpttool-audit.json").read_text())


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Each source merged once through the CLI, shared by the tests that read the output."""
    from click.testing import CliRunner

    from ckpttool.cli import main

    done: dict[Path, Path] = {}

    def get(src: Path, *options: str) -> Path:
        if src not in done:
            out = tmp_path_factory.mktemp(src.parent.name) / "out"
            before = tree_digest(src)
            result = CliRunner().invoke(main, ["merge", str(src), str(out), *options])
            assert result.exit_code == 0, result.output
            assert tree_digest(src) == before
            done[src] = out
        return done[src]

    return get


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_a_torch_or_transformers_checkpoint_merges_to_the_reference_bit_for_bit(name, merged):
    out = merged(fixture_dir(name) / "checkpoint")
    assert_bit_exact(load_output(out), load_output(fixture_dir(name) / "reference"))
    summary = audit_of(out)["summary"]
    assert (summary["verdict"], summary["errors"], summary["warnings"]) == ("pass", 0, 0), summary


@pytest.mark.parametrize("name", DCP_FIXTURES)
def test_the_merged_model_loads_strictly_with_the_reference_logits(name, merged):
    out = merged(fixture_dir(name) / "checkpoint")
    assert torch.equal(logits_of(out), logits_of(fixture_dir(name) / "reference"))


@pytest.mark.parametrize("mesh", [dict(fsdp=2), dict(fsdp=3), dict(fsdp=8), dict(tp=2), dict(fsdp=2, tp=2)],
                         ids=lambda m: "-".join(f"{k}{n}" for k, n in m.items()))
def test_split_to_dcp_then_merge_gives_the_reference_back_bit_for_bit(mesh, tmp_path):
    source = fixture_dir("gpt_oss_fsdp2_dcp") / "reference"
    ckpttool.split(source, tmp_path / "dcp", **mesh)
    ckpttool.merge(tmp_path / "dcp", tmp_path / "hf")
    assert_bit_exact(load_output(tmp_path / "hf"), load_output(source))


def test_split_writes_what_fsdp2_saved(tmp_path):
    """The same tensors, chunks and values as torch's own FSDP2 save of the same model over 2 ranks."""
    from torch.distributed.checkpoint import FileSystemReader

    fixture = fixture_dir("gpt_oss_fsdp2_dcp")
    ckpttool.split(fixture / "reference", tmp_path / "out", fsdp=2)
    ours, theirs = (FileSystemReader(d).read_metadata() for d in (tmp_path / "out", fixture / "checkpoint"))
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
    for name, md in theirs.state_dict_metadata.items():
        mine = ours.state_dict_metadata[name]
        assert mine.size == md.size and mine.properties.dtype == md.properties.dtype, name
        assert [(c.offsets, c.sizes) for c in mine.chunks] == [(c.offsets, c.sizes) for c in md.chunks], name


# ------------------------------------------------------------------------------------------------
# Megatron-Core (megatron-core 0.16.1, TP=2 x EP=2, legacy and torch_dist)
# ------------------------------------------------------------------------------------------------
MEGATRON = FIXTURES / "megatron_gpt_oss_tp2_ep2"
#: Megatron's logits against transformers' on the merged output: fp32 on CPU, different kernels
ATOL = 1e-4


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_a_megatron_core_checkpoint_merges_to_the_reference_bit_for_bit(fmt, merged):
    """torch_dist (global tensors) and legacy (per-rank files: the sinks are TP pieces of the heads) alike."""
    out = merged(MEGATRON / fmt, "--config", str(MEGATRON / "config.json"))
    assert_bit_exact(load_output(out), load_output(MEGATRON / "reference"))
    summary = audit_of(out)["summary"]
    assert (summary["verdict"], summary["errors"], summary["warnings"]) == ("pass", 0, 0), summary


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_the_megatron_merge_computes_what_megatron_computed(fmt, merged):
    """Strict load, the reference's logits exactly, and Megatron's own forward within float tolerance (sinks,
    clamped SwiGLU, YaRN, the sliding window, the router's top-2 all agree)."""
    out = merged(MEGATRON / fmt, "--config", str(MEGATRON / "config.json"))
    megatron = load_file(MEGATRON / "logits.safetensors")
    tokens = megatron["tokens"].tolist()
    logits = logits_of(out, tokens)
    assert torch.equal(logits, logits_of(MEGATRON / "reference", tokens))
    vocab = logits.shape[-1]
    torch.testing.assert_close(logits[0], megatron["logits"][0, :, :vocab], atol=ATOL, rtol=0)


def test_the_plan_interleaves_and_transposes_the_experts():
    """One box per expert tiles each stacked pre tensor; the transforms make HF's layout of it: fc1 ``[gate; up]``
    interleaved then transposed, fc2 transposed, the fc1 bias interleaved, the fc2 bias as it is."""
    from ckpttool.families import map_to_hf
    from ckpttool.model.architecture import model_info
    from ckpttool.readers import read_layout

    info = model_info(json.loads((MEGATRON / "config.json").read_text()))
    mapping = map_to_hf(read_layout(MEGATRON / "torch_dist", model=info), info)
    assert mapping.adapter == "gpt_oss (Megatron-Core convention)" and not mapping.problems
    specs = {s.name: s for s in mapping.specs}
    layer = "model.layers.1.mlp.experts."
    transforms = {part: specs[layer + part].transform for part in
                  ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")}
    assert transforms["gate_up_proj"].name == "interleave 2 parts of 32 along dim 1, then transpose dims 1 and 2"
    assert transforms["gate_up_proj_bias"].name == "interleave 2 parts of 32 along dim 1"
    assert transforms["down_proj"].name == "transpose dims 1 and 2"
    assert transforms["down_proj_bias"] is None
    assert specs[layer + "gate_up_proj"].shape == (4, 64, 64) and specs[layer + "down_proj"].shape == (4, 32, 64)
    assert [sl.dst.offsets[0] for sl in specs[layer + "gate_up_proj"].slices] == [0, 1, 2, 3]
    assert specs["model.layers.0.self_attn.sinks"].slices[0].source == (
        "decoder.layers.self_attention.core_attention.softmax_offset")


def megatron_as_dcp(tmp_path: Path, edit=None) -> Path:
    """The Megatron fixture's tensors re-saved as a plain DCP (torch's own ``dcp.save``, no Megatron metadata), the
    vocab padding cut off, after ``edit(state_dict)``: a Megatron-Core source recognised by its names alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = FileSystemReader(next((MEGATRON / "torch_dist").glob("iter_*")))
    metadata = reader.read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    dcp.load(state, storage_reader=reader, no_dist=True)
    vocab = json.loads((MEGATRON / "config.json").read_text())["vocab_size"]
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        state[name] = state[name][:vocab].clone()
    if edit is not None:
        edit(state)
    out = tmp_path / "megatron-dcp"
    dcp.save(state, checkpoint_id=out, no_dist=True)
    (out / "config.json").write_text((MEGATRON / "config.json").read_text())
    return out


def test_megatron_core_names_in_a_plain_dcp_merge_the_same(tmp_path):
    """The adapter follows the names, not the reader: the same tensors saved by torch's dcp.save merge to the
    same model."""
    src = megatron_as_dcp(tmp_path)
    ckpttool.merge(src, tmp_path / "out")
    assert_bit_exact(load_output(tmp_path / "out"), load_output(MEGATRON / "reference"))


FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def test_fc1_rows_that_do_not_halve_are_refused(cli, tmp_path):
    def odd(state):
        state[FC1] = state[FC1][:, :, :-1].clone()

    src = megatron_as_dcp(tmp_path, odd)
    before = tree_digest(src)
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"'{FC1}': 63 rows cannot be split into gate and up halves "
                          "(gpt-oss's fc1 is [gate; up])")
    assert tree_digest(src) == before


def test_a_missing_expert_is_refused(cli, tmp_path):
    """Experts saved one by one (``local_experts.E``), expert 3 of layer 1 absent: its rows are covered by nothing."""
    def per_expert(state):
        for name in [n for n in state if ".experts.experts." in n]:
            stacked = state.pop(name)
            for layer in range(stacked.shape[0]):
                for e in range(stacked.shape[1]):
                    if (layer, e) != (1, 3):
                        per = name.replace("decoder.layers.", f"decoder.layers.{layer}.").replace(
                            ".experts.experts.", f".experts.local_experts.{e}.")
                        state[per] = stacked[layer, e].clone()

    src = megatron_as_dcp(tmp_path, per_expert)
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", "the checkpoint does not cover its tensors exactly (4 problems)",
                          "'model.layers.1.mlp.experts.gate_up_proj': rows 3..4 covered by no piece (shape [4, 64, 64]",
                          "'model.layers.1.mlp.experts.down_proj_bias': rows 3..4 covered by no piece")


def test_megatron_args_that_compute_something_else_are_named():
    """The recorded args of the fixture pass; a run without sinks, with plain SwiGLU or another clamp, is named."""
    import argparse

    from ckpttool.families.gpt_oss import ADAPTER
    from ckpttool.model.architecture import model_info
    from ckpttool.readers.megatron.common import scan_checkpoint

    info = model_info(json.loads((MEGATRON / "config.json").read_text()))
    with open(next((MEGATRON / "torch_dist").glob("iter_*")) / "common.pt", "rb") as f:
        fixture_args = scan_checkpoint(f, label="common.pt")["args"]  # as the reader sees them: nothing executed
    assert ADAPTER.check_args(fixture_args, info) == []
    wrong = argparse.Namespace(**{**vars(fixture_args), "softmax_type": "vanilla", "swiglu": True,
                                  "activation_func_clamp_value": 10.0, "window_size": [127, 0]})
    assert ADAPTER.check_args(wrong, info) == [
        "softmax_type: 'learnable' expected (gpt-oss's attention sinks), found 'vanilla' in the args",
        "swiglu: False expected (gpt-oss's experts use quick_geglu, not swiglu), found True in the args",
        "activation_func_clamp_value: 7.0 expected (config.json swiglu_limit), found 10.0 in the args",
        "window_size: (7, 0) expected (config.json sliding_window - 1), found (127, 0) in the args",
    ]


def test_more_stacked_layers_than_the_config_declares_are_refused(cli, tmp_path):
    src = megatron_as_dcp(tmp_path)
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1,
                                                 "layer_types": ["sliding_attention"]}))
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", "does not match its gpt_oss config",
                          "'decoder.layers.mlp.router.weight': 2 stacked layers, expected at most 1 (the config's "
                          "num_hidden_layers)",
                          f"'{FC1}': 2 stacked layers, expected at most 1")


def test_tensor_parallel_placements_of_the_in_memory_names():
    """For split's tensor parallelism (meshes.py asks the family): sinks by heads, like q_proj's rows; router and
    the row-parallel o_proj's bias replicated; experts replicated (ep shards them)."""
    from ckpttool.families.adapter import REPLICATE, SHARD0, SHARD1
    from ckpttool.families.gpt_oss import ADAPTER

    layer = "model.layers.0."
    assert {part: ADAPTER.tp_placement(layer + part) for part in (
        "self_attn.sinks", "self_attn.q_proj.bias", "self_attn.o_proj.weight", "self_attn.o_proj.bias",
        "mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj", "mlp.experts.down_proj_bias",
    )} == {
        "self_attn.sinks": SHARD0, "self_attn.q_proj.bias": SHARD0, "self_attn.o_proj.weight": SHARD1,
        "self_attn.o_proj.bias": REPLICATE, "mlp.router.weight": REPLICATE, "mlp.router.bias": REPLICATE,
        "mlp.experts.gate_up_proj": REPLICATE, "mlp.experts.down_proj_bias": REPLICATE,
    }


def test_the_dry_run_names_each_transform(cli):
    result = cli("merge", MEGATRON / "torch_dist", "--config", MEGATRON / "config.json", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["adapter"] == "gpt_oss (Megatron-Core convention)"
    targets = {t["name"]: t for t in doc["targets"]}
    assert targets["model.layers.0.mlp.experts.gate_up_proj"]["transform"] == (
        "interleave 2 parts of 32 along dim 1, then transpose dims 1 and 2")
    assert targets["model.layers.0.mlp.experts.down_proj"]["transform"] == "transpose dims 1 and 2"
    assert "transform" not in targets["model.layers.0.mlp.experts.down_proj_bias"]
    assert "transform" not in targets["model.layers.0.self_attn.sinks"]
