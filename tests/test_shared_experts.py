"""Shared experts (Qwen2-MoE's ``mlp.shared_expert`` and its sigmoid ``mlp.shared_expert_gate``).

Megatron-Core's ``SharedExpertMLP`` is a dense MLP inside the MoE layer: ``linear_fc1`` column-parallel with each TP
rank holding ``[gate_r; up_r]`` (torch_dist stores the global ``[gate; up]``), ``linear_fc2`` row-parallel, and with
``moe_shared_expert_gate`` a replicated ``gate_weight (1, H)``. The Megatron fixtures' bit-exact merges and
Megatron's logits are tested with the other Megatron cases (``qwen2moe_*`` in tests/test_megatron.py); here: the
cut itself, and the shared-expert pieces a broken checkpoint lacks, named.
"""

from __future__ import annotations

import pickle
import shutil
from pathlib import Path

import torch

from conftest import FIXTURES, apply_spec, assert_failed_cleanly

CASE = FIXTURES / "megatron_qwen2moe_tp2_ep2"


def _copy(fmt: str, tmp_path: Path) -> Path:
    shutil.copytree(CASE / fmt, tmp_path / "ckpt" / fmt)
    shutil.copy(CASE / "config.json", tmp_path / "ckpt" / "config.json")
    return tmp_path / "ckpt" / fmt


def test_dry_run_shows_the_shared_expert_cut(cli, tmp_path):
    for fmt, layer in (("torch_dist", "layers."), ("legacy", "layers.1.")):
        result = cli("merge", CASE / fmt, tmp_path / "out", "--config", CASE / "config.json", "--dry-run")
        assert result.exit_code == 0, result.output
        m = f"decoder.{layer}mlp.shared_experts."
        for line in (f"model.layers.1.mlp.shared_expert.gate_proj.weight  F32 [48x32]  <- {m}linear_fc1.weight (2 pieces)",
                     f"model.layers.1.mlp.shared_expert.up_proj.weight  F32 [48x32]  <- {m}linear_fc1.weight (2 pieces)",
                     f"model.layers.1.mlp.shared_expert.down_proj.weight  F32 [32x48]  <- {m}linear_fc2.weight (2 pieces)",
                     f"model.layers.1.mlp.shared_expert_gate.weight  F32 [1x32]  <- {m}gate_weight (1 piece)"):
            assert line in result.output, (fmt, line, result.output)


def test_missing_tp_rank_files_name_the_shared_expert_rows(cli, tmp_path):
    src = _copy("legacy", tmp_path)
    for ep in (0, 1):  # TP rank 1 of both EP ranks: the shared expert's second halves are nowhere else
        shutil.rmtree(src / "iter_0000010" / f"mp_rank_01_{ep:03d}")
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out,
                          "'model.layers.0.mlp.shared_expert.gate_proj.weight': rows 24..48 covered by no piece",
                          "'model.layers.0.mlp.shared_expert.up_proj.weight': rows 24..48 covered by no piece",
                          "'model.layers.0.mlp.shared_expert.down_proj.weight': columns 24..48 covered by no piece",
                          "'iter_0000010/mp_rank_01_000/model_optim_rng.pt'")


def test_missing_distcp_file_names_the_shared_expert_rows_and_the_file(cli, tmp_path):
    src = _copy("torch_dist", tmp_path)
    (src / "iter_0000010" / "__1_0.distcp").unlink()  # TP rank 1's shared-expert chunks
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out,
                          "'model.layers.0.mlp.shared_expert.gate_proj.weight': rows 24..48 covered by no piece "
                          "(shape [48, 32]; found 1 piece in 'iter_0000010/__0_0.distcp'). The metadata places them "
                          "in 'iter_0000010/__1_0.distcp', which is missing.",
                          "'model.layers.0.mlp.shared_expert.down_proj.weight': columns 24..48 covered by no piece")


def test_a_checkpoint_without_the_shared_expert_gate_is_refused_for_qwen2_moe(cli, tmp_path):
    """A Megatron model trained without ``moe_shared_expert_gate`` has no ``gate_weight``: Qwen2-MoE always applies
    ``sigmoid(shared_expert_gate)``, so it is not that model, and the merge says which tensor is missing."""
    from torch.distributed.checkpoint import FileSystemReader

    src = _copy("torch_dist", tmp_path)
    directory = src / "iter_0000010"
    metadata = FileSystemReader(directory).read_metadata()
    drop = "decoder.layers.mlp.shared_experts.gate_weight"
    del metadata.state_dict_metadata[drop]
    metadata.storage_data = {k: v for k, v in metadata.storage_data.items() if k.fqn != drop}
    (directory / ".metadata").write_bytes(pickle.dumps(metadata))
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "does not match its qwen2_moe config (2 problems)",
                          "'model.layers.0.mlp.shared_expert_gate.weight': expected by the config but not in the checkpoint",
                          "'model.layers.1.mlp.shared_expert_gate.weight': expected by the config but not in the checkpoint")


def test_shared_expert_cut_follows_megatrons_glu_chunk():
    """Property: stacked, per-layer and singleton (``_w``/``_v``) shared experts cut like ``chunk(2)`` of fc1."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from ckpttool.model.description import ModelInfo
    from ckpttool.families.conventions import megatron_core
    from ckpttool.layout.layout import Layout, TensorLayout

    @settings(max_examples=30, deadline=None)
    @given(st.integers(1, 3), st.integers(1, 6), st.integers(1, 4), st.booleans())
    def check(layers, ffn, hidden, plural):
        fc1 = torch.arange(layers * 2 * ffn * hidden, dtype=torch.float32).reshape(layers, 2 * ffn, hidden)
        fc2 = -torch.arange(layers * hidden * ffn, dtype=torch.float32).reshape(layers, hidden, ffn) - 1
        gate = torch.randn(layers, 1, hidden)
        m = "decoder.layers.mlp.shared_experts."
        single = f"decoder.layers.{layers}.mlp.shared_experts."  # one more layer under its own index
        names = {m + "linear_fc1.weight": fc1, m + "linear_fc2.weight": fc2, m + "gate_weight": gate,
                 single + "linear_fc1.weight_w": fc1[0, :ffn] + 0.5, single + "linear_fc1.weight_v": fc1[0, ffn:] + 0.5,
                 single + "linear_fc2.weight": fc2[0] + 0.5}
        layout = Layout("", "megatron-dist", {n: TensorLayout(n, tuple(t.shape), "F32", ()) for n, t in names.items()})
        word = "shared_experts" if plural else "shared_expert"  # DeepSeek-style or Qwen2-MoE names on disk
        disk = {f"model.layers.{i}.mlp.{word}.{p}_proj.weight": () for i in range(layers + 1) for p in ("gate", "up", "down")}
        specs, _, problems = megatron_core.to_hf(layout, ModelInfo("qwen2_moe", {"hidden_size": hidden}, {}, disk))
        assert problems == []
        got = {s.name: apply_spec(s, names) for s in specs}
        for i in range(layers):
            h = f"model.layers.{i}.mlp."
            g, u = fc1[i].chunk(2)
            assert torch.equal(got[h + f"{word}.gate_proj.weight"], g) and torch.equal(got[h + f"{word}.up_proj.weight"], u)
            assert torch.equal(got[h + f"{word}.down_proj.weight"], fc2[i])
            assert torch.equal(got[h + "shared_expert_gate.weight"], gate[i])
        h = f"model.layers.{layers}.mlp.{word}."
        assert torch.equal(got[h + "gate_proj.weight"], names[single + "linear_fc1.weight_w"])
        assert torch.equal(got[h + "up_proj.weight"], names[single + "linear_fc1.weight_v"])
        assert torch.equal(got[h + "down_proj.weight"], names[single + "linear_fc2.weight"])

    check()


# ------------------------------------------------------------------------------------------------
# DCP: transformers' Qwen2MoeForCausalLM in memory, FSDP2 over 2 ranks (fixtures/make_fixtures.py)
# ------------------------------------------------------------------------------------------------

DCP = FIXTURES / "qwen2moe_fsdp2_dcp"
#: within the fixture's vocab of 251
TOKENS = torch.tensor([[1, 5, 17, 250, 42, 7, 3, 128], [2, 200, 125, 126, 0, 9, 64, 11]])


def test_dcp_names_of_the_shared_expert_are_already_its_on_disk_names():
    """transformers keeps routed experts stacked in memory but the shared expert as on disk: no rule renames it."""
    import json

    from ckpttool.model.architecture import model_info
    from ckpttool.readers import read_layout

    info = model_info(json.loads((DCP / "checkpoint" / "config.json").read_text()))
    layout = read_layout(DCP / "checkpoint", model=info)
    shared = sorted(n for n in layout.tensors if ".shared_expert" in n)
    assert shared == sorted(n for n in info.disk_shapes if ".shared_expert" in n)
    assert all(info.memory_shapes[n] == info.disk_shapes[n] == layout.tensors[n].global_shape for n in shared)
    assert "model.layers.0.mlp.experts.gate_up_proj" in layout.tensors  # the routed experts are cut by the rules


def test_dcp_merge_equals_the_producers_weights_and_logits(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import ckpttool
    from conftest import load_output, tree_digest

    before = tree_digest(DCP)
    ckpttool.merge(DCP / "checkpoint", tmp_path / "hf")
    assert tree_digest(DCP) == before
    got = load_output(tmp_path / "hf")
    want = load_file(DCP / "reference" / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []
    assert got["model.layers.1.mlp.shared_expert.down_proj.weight"].shape == (32, 48)
    ours = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(DCP / "reference", dtype=torch.float32).eval()
    with torch.no_grad():
        assert torch.equal(ours(TOKENS).logits, reference(TOKENS).logits)


def test_dcp_missing_rank_file_names_the_shared_expert_rows(cli, tmp_path):
    src = tmp_path / "checkpoint"
    shutil.copytree(DCP / "checkpoint", src)
    (src / "__1_0.distcp").unlink()  # FSDP2 rank 1: rows 24..48 of the shared expert's gate and up
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out,
                          "'model.layers.0.mlp.shared_expert.gate_proj.weight': rows 24..48 covered by no piece",
                          "'model.layers.0.mlp.shared_expert.up_proj.weight': rows 24..48 covered by no piece",
                          "'__1_0.distcp', which is missing")
