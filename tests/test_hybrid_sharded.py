"""Hybrid families from real sharded producers (issue 30): Qwen3.5's language model (``qwen3_5_text``), Qwen3.5-MoE's
(``qwen3_5_moe_text``) and Nemotron-H with MoE layers, saved by torch FSDP2 + DCP and by transformers'
``DistributedConfig(tp_size=2)`` on gloo (``fixtures/make_hybrid.py``).

Each merge equals the producer's unsharded model (``reference/``) bit for bit, loads strictly into its class with
equal logits and passes the audit; ``split --to dcp`` on the producer's mesh writes the producer's own chunks; the
audit of a sharded source with a dropped linear-attention (or Mamba-2) layer, or a TP rank's piece of a grouped
projection saved as the whole, names the right root cause.
"""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch

import ckpttool
from conftest import FIXTURES, assert_same_dcp, dcp_chunks, fixture_dir, load_output, tree_digest
from test_hybrid import assert_bit_exact, logits_of

#: fixture -> the adapter that serves it (as the audit names it) and the class transformers builds
SOURCES = {
    "qwen3_5_fsdp2_dcp": ("qwen3_5_text (its rules)", "Qwen3_5ForCausalLM"),
    "qwen3_5_hf_tp2": ("qwen3_5_text (its rules)", "Qwen3_5ForCausalLM"),
    # transformers converts Qwen3.5-MoE's weights as qwen3_5_text's
    "qwen3_5_moe_fsdp2_dcp": ("qwen3_5_moe_text as qwen3_5_text (its rules)", "Qwen3_5MoeForCausalLM"),
    "nemotron_h_moe_fsdp2_dcp": ("nemotron_h (its rules)", "NemotronHForCausalLM"),
    "nemotron_h_moe_hf_tp2": ("nemotron_h (its rules)", "NemotronHForCausalLM"),
}

#: transformers is imported here anyway: configs are described in this process (conftest.describe_inline)
pytestmark = pytest.mark.usefixtures("describe_inline")


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """Each source merged once (the source unchanged), shared by the tests that read the output."""
    done: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in done:
            src = fixture_dir(name) / "checkpoint"
            before = tree_digest(src)
            done[name] = tmp_path_factory.mktemp(name) / "out"
            ckpttool.merge(src, done[name])
            assert tree_digest(src) == before
        return done[name]

    return get


# ------------------------------------------------------------------------------------------------
# merge: bit for bit, strict load with the right class, equal logits, audit PASS
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", SOURCES)
def test_a_sharded_hybrid_merges_bit_for_bit_loads_strictly_and_passes_the_audit(name, merged):
    out = merged(name)
    reference = fixture_dir(name) / "reference"
    assert_bit_exact(load_output(out), load_output(reference))
    summary = json.loads((out / "ckpttool-audit.json").read_text())["summary"]
    assert (summary["verdict"], summary["errors"], summary["warnings"]) == ("pass", 0, 0), summary
    assert json.loads((out / "config.json").read_text())["architectures"] == [SOURCES[name][1]]
    assert torch.equal(logits_of(out), logits_of(reference))


@pytest.mark.parametrize("name", SOURCES)
def test_the_audit_of_the_clean_sharded_source_passes_with_its_adapter(name):
    report = ckpttool.audit(fixture_dir(name) / "checkpoint")
    assert report.data_checked and report.adapter == SOURCES[name][0]
    assert not [f.message for f in report.findings if f.severity in ("error", "warning")]


# ------------------------------------------------------------------------------------------------
# split --to dcp on the producer's mesh: the producer's own chunks
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", [n for n in SOURCES if n.endswith("_fsdp2_dcp")])
def test_split_fsdp2_writes_the_fsdp2_producers_checkpoint(name, tmp_path):
    """The same tensors bit for bit in the same chunks as ``fully_shard`` over 2 ranks saved them."""
    fixture = fixture_dir(name)
    ckpttool.split(fixture / "reference", tmp_path / "dcp", fsdp=2)
    assert_same_dcp(tmp_path / "dcp", fixture / "checkpoint", tmp_path)


def _hf_distributed_chunks(checkpoint: Path) -> dict[str, tuple]:
    from torch.distributed.checkpoint.hf_storage import HuggingFaceStorageReader

    meta = HuggingFaceStorageReader(str(checkpoint)).read_metadata().state_dict_metadata
    return {k: (tuple(v.size), sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks)) for k, v in meta.items()}


@pytest.mark.parametrize("name, differ", [
    ("qwen3_5_hf_tp2", []),
    # transformers' Nemotron-H plan cuts the stacked experts (moe_tp_experts: up_proj rows, down_proj columns), and
    # split cuts them where that plan does (ckpttool.families.expert_tp)
    ("nemotron_h_moe_hf_tp2", []),
])
def test_split_tp2_writes_the_chunks_transformers_tp_plan_saved(name, differ, tmp_path):
    fixture = fixture_dir(name)
    ckpttool.split(fixture / "reference", tmp_path / "dcp", tp=2)
    ours, theirs = dcp_chunks(tmp_path / "dcp"), _hf_distributed_chunks(fixture / "checkpoint")
    assert sorted(ours) == sorted(theirs)
    assert sorted(k for k in theirs if ours[k] != theirs[k]) == differ
    ckpttool.merge(tmp_path / "dcp", tmp_path / "hf", config=fixture / "reference")
    assert_bit_exact(load_output(tmp_path / "hf"), load_output(fixture / "reference"))


# ------------------------------------------------------------------------------------------------
# audit of a damaged sharded source: a dropped linear-attention / Mamba-2 layer, a TP rank's piece missing
# ------------------------------------------------------------------------------------------------
def _drop_from_dcp(src: Path, part: str) -> None:
    """Every tensor whose name holds ``part`` dropped from a DCP's ``.metadata`` (our own fixture, trusted, so plain
    pickle may load it in the test): as if the saver had left that module out."""
    metadata = pickle.loads((src / ".metadata").read_bytes())
    for fqn in [k for k in metadata.state_dict_metadata if part in k]:
        del metadata.state_dict_metadata[fqn]
    for index in [i for i in metadata.storage_data if part in i.fqn]:
        del metadata.storage_data[index]
    (src / ".metadata").write_bytes(pickle.dumps(metadata))


@pytest.mark.parametrize("name, part, cause", [
    ("qwen3_5_fsdp2_dcp", ".layers.2.linear_attn.",
     "the gated DeltaNet linear-attention mixer 'model.layers.{L}.linear_attn' is missing (config layer_types: "
     "'linear_attention'): 9 tensors in layer 2"),
    ("qwen3_5_moe_fsdp2_dcp", ".layers.0.linear_attn.",
     "the gated DeltaNet linear-attention mixer 'model.layers.{L}.linear_attn' is missing (config layer_types: "
     "'linear_attention'): 9 tensors in layer 0"),
    ("nemotron_h_moe_fsdp2_dcp", ".layers.3.mixer.",
     "the Mamba-2 mixer 'backbone.layers.{L}.mixer' is missing (config layers_block_type: "
     "'linear_attention'): 8 tensors in layer 3"),
])
def test_a_dropped_linear_attention_layer_of_a_sharded_source_is_one_cause(cli, tmp_path, name, part, cause):
    src = tmp_path / "checkpoint"
    shutil.copytree(fixture_dir(name) / "checkpoint", src)
    _drop_from_dcp(src, part)
    before = tree_digest(src)
    result = cli("audit", src, "--json")
    assert result.exit_code == 3, result.output
    causes = json.loads(result.stdout)["causes"]
    assert [(c["code"], c["cause"]) for c in causes] == [("tensor-missing", cause)]
    assert tree_digest(src) == before  # the audit writes nothing into the source


def _drop_from_rank_file(src: Path, rank: int, fqn: str) -> str:
    """``fqn`` dropped from rank ``rank``'s file of a transformers distributed save (its tensor and its sharding
    info): as if that rank had not saved its piece. Returns the file's name."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    path = sorted(src.glob("shard-*.safetensors"))[rank]
    with safe_open(path, "pt") as f:
        metadata = f.metadata()
    tensors = load_file(path)
    del tensors[fqn]
    info = json.loads(metadata["DCP_SHARDING_INFO"])
    del info[fqn]
    save_file(tensors, path, metadata={**metadata, "DCP_SHARDING_INFO": json.dumps(info)})
    return path.name


@pytest.mark.parametrize("name, fqn, rows", [
    ("qwen3_5_hf_tp2", "model.layers.0.linear_attn.in_proj_qkv.weight", "32..64"),
    ("qwen3_next_hf_tp2", "model.layers.0.linear_attn.in_proj_qkvz.weight", "48..96"),
])
def test_a_tp_rank_piece_of_a_grouped_projection_missing_from_a_sharded_source_is_named(cli, tmp_path, name, fqn, rows):
    """The other half of a TP=2 cut of the gated DeltaNet's input projection left out of a distributed save: the
    audit names the rows no rank holds and the file that holds the rest, one cause."""
    src = tmp_path / "checkpoint"
    shutil.copytree(fixture_dir(name) / "checkpoint", src)
    kept = _drop_from_rank_file(src, 1, fqn)
    other = sorted(p.name for p in src.glob("shard-*.safetensors") if p.name != kept)[0]
    before = tree_digest(src)
    result = cli("audit", src, "--json")
    assert result.exit_code == 3, result.output
    causes = json.loads(result.stdout)["causes"]
    assert [c["code"] for c in causes] == ["coverage"], causes
    assert causes[0]["cause"].startswith(f"'{fqn}': rows {rows} covered by no piece")
    assert f"found 1 piece in '{other}'" in causes[0]["cause"]
    assert tree_digest(src) == before


# ------------------------------------------------------------------------------------------------
# Nemotron-H MoE from megatron-core 0.16.1 at TP=2 x PP=2 with expert TP 2 (the split: test_megatron_hybrid_more)
# ------------------------------------------------------------------------------------------------
def test_megatron_nemotron_h_moe_at_pp2_and_expert_tp2_merges_bit_for_bit_with_megatrons_logits(tmp_path):
    from safetensors.torch import load_file

    fixture = FIXTURES / "megatron_nemotron_h_moe_tp2_pp2_etp2"
    before = tree_digest(fixture / "torch_dist")
    result = ckpttool.merge(fixture / "torch_dist", tmp_path / "out", config=fixture / "config.json")
    assert result.adapter == "nemotron_h (Megatron-Core convention)"
    assert tree_digest(fixture / "torch_dist") == before
    assert_bit_exact(load_output(tmp_path / "out"), load_output(fixture / "reference"))
    summary = json.loads((tmp_path / "out" / "ckpttool-audit.json").read_text())["summary"]
    assert (summary["verdict"], summary["errors"], summary["warnings"]) == ("pass", 0, 0), summary
    megatron = load_file(fixture / "logits.safetensors")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(megatron["tokens"]).logits
    torch.testing.assert_close(logits[0], megatron["logits"][0, :, :251], atol=1e-4, rtol=0)


@pytest.mark.parametrize("case, layout", [
    ("megatron_nemotron_h_tp2_pp2", dict(tp=2, pp=2)),
    ("megatron_nemotron_h_moe_tp2_pp2_etp2", dict(tp=2, pp=2, etp=2)),
])
def test_split_to_megatron_writes_the_vocab_chunks_from_the_stage_megatron_core_does(case, layout, tmp_path):
    """At pp > 1 the word embedding's TP chunks are written by the first stage's ranks and the output layer's by
    the last's (megatron-core builds each only there), into the same rank files as megatron-core's own save."""
    from torch.distributed.checkpoint import FileSystemReader

    fixture = FIXTURES / case
    ckpttool.split(fixture / "reference", tmp_path / "split", to="megatron", iteration=10,
                   config=fixture / "config.json", make_vocab_size_divisible_by=64, **layout)

    def files(directory: Path) -> dict:
        storage = FileSystemReader(str(directory / "iter_0000010")).read_metadata().storage_data
        return {(i.fqn, tuple(i.offset)): info.relative_path for i, info in storage.items()
                if i.fqn in ("embedding.word_embeddings.weight", "output_layer.weight")}

    assert files(tmp_path / "split") == files(fixture / "torch_dist") == {
        ("embedding.word_embeddings.weight", (0, 0)): "__0_0.distcp",
        ("embedding.word_embeddings.weight", (128, 0)): "__1_0.distcp",
        ("output_layer.weight", (0, 0)): "__2_0.distcp", ("output_layer.weight", (128, 0)): "__3_0.distcp"}
