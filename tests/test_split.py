"""``ckpttool split --to dcp``: the way back from any source to a PyTorch Distributed Checkpoint for a mesh.

The strongest check is torch itself: splitting the HuggingFace reference of each torch-made DCP fixture for
the mesh that fixture was saved on gives the same ``.metadata`` (every chunk, file, offset and length, and
which rank writes a replicated chunk) and the same ``.distcp`` bytes, but for the random serialization id
``torch.save`` puts in each item. Then round trips (HF -> split -> merge == HF, bit for bit, over uneven
meshes), re-sharding a DCP checkpoint, torch reading the output without a process group, the dry run, and
every error with its message. Loading into parallelized models is ``tests/test_split_torch.py``.
"""

from __future__ import annotations

import json
import math

import pytest
import torch
from conftest import HYPOTHESIS_EXAMPLES
from hypothesis import given, settings
from test_placements import _by_torch, sharded
from test_split_archive import masked
from torch.distributed.checkpoint import FileSystemReader

import ckpttool
from ckpttool.layout.layout import Box
from ckpttool.errors import ArgumentError, ConfigError, OutputError
from ckpttool.commands.meshes import Sharding
from conftest import assert_failed_cleanly, fixture_dir, load_output, tree_digest

LLAMA = fixture_dir("llama_fsdp2_dcp") / "reference"
MIXTRAL = fixture_dir("mixtral_fsdp2_dcp") / "reference"
QWEN2MOE = fixture_dir("qwen2moe_fsdp2_dcp") / "reference"


def chunks(metadata) -> dict[str, list[tuple[tuple[int, ...], tuple[int, ...]]]]:
    return {k: [(tuple(c.offsets), tuple(c.sizes)) for c in m.chunks] for k, m in metadata.state_dict_metadata.items()}


def storage(metadata) -> dict[tuple[str, tuple[int, ...]], tuple[str, int, int, int]]:
    return {(k.fqn, tuple(k.offset)): (v.relative_path, v.offset, v.length, k.index) for k, v in metadata.storage_data.items()}


@pytest.mark.parametrize("fixture, mesh", [
    ("llama_fsdp2_dcp", dict(fsdp=4)), ("llama_tp2_dcp", dict(tp=2)), ("llama_tp2_fsdp2_dcp", dict(fsdp=2, tp=2)),
    ("mixtral_fsdp2_dcp", dict(fsdp=2)), ("mixtral_fsdp8_dcp_zero_chunk", dict(fsdp=8)),
])
def test_split_writes_what_torch_saved_for_the_same_mesh(fixture, mesh, tmp_path):
    torch_dir = fixture_dir(fixture) / "checkpoint"
    ckpttool.split(fixture_dir(fixture) / "reference", tmp_path / "out", **mesh)
    ours, theirs = FileSystemReader(tmp_path / "out").read_metadata(), FileSystemReader(torch_dir).read_metadata()
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
    assert chunks(ours) == chunks(theirs)  # FSDP2's uneven and empty shards, _StridedShard, TP's Shard(0|1)
    for name, md in theirs.state_dict_metadata.items():
        assert (ours.state_dict_metadata[name].size, ours.state_dict_metadata[name].properties) == (md.size, md.properties)
    assert storage(ours) == storage(theirs)  # the same file, offset, length; replicated chunks by the same rank
    assert ours.planner_data == theirs.planner_data
    for (name, _), (file, offset, length, _) in storage(theirs).items():
        mine, real = (d / file for d in (tmp_path / "out", torch_dir))
        assert mine.stat().st_size == real.stat().st_size
        with open(mine, "rb") as a, open(real, "rb") as b:
            a.seek(offset), b.seek(offset)
            assert masked(a.read(length)) == masked(b.read(length)), name


@pytest.mark.parametrize("source, mesh", [
    (LLAMA, dict(fsdp=3)), (LLAMA, dict(tp=3)), (LLAMA, dict(fsdp=2, tp=3)), (MIXTRAL, dict(fsdp=2, ep=2)),
    (MIXTRAL, dict(fsdp=4, ep=2)), (MIXTRAL, dict(fsdp=3, tp=2, ep=2)), (QWEN2MOE, dict(tp=2, ep=2)),
], ids=lambda v: v.parent.name if hasattr(v, "parent") else "-".join(f"{k}{n}" for k, n in v.items()))
def test_split_then_merge_gives_the_source_back_bit_for_bit(source, mesh, tmp_path):
    ckpttool.split(source, tmp_path / "dcp", **mesh)
    ckpttool.merge(tmp_path / "dcp", tmp_path / "hf")
    got, want = load_output(tmp_path / "hf"), load_output(source)
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_torch_reads_the_in_memory_names_without_a_process_group(tmp_path):
    """Stacked experts as transformers holds them in memory, from per-expert tensors on disk."""
    import torch.distributed.checkpoint as dcp
    from transformers import AutoModelForCausalLM

    ckpttool.split(MIXTRAL, tmp_path / "dcp", tp=2, ep=2)
    want = AutoModelForCausalLM.from_pretrained(MIXTRAL, dtype=torch.float32).state_dict()
    state = {name: torch.full_like(tensor, float("nan")) for name, tensor in want.items()}
    dcp.load(state, storage_reader=FileSystemReader(tmp_path / "dcp"), no_dist=True)
    assert "model.layers.0.mlp.experts.gate_up_proj" in state
    for name, tensor in want.items():
        assert torch.equal(state[name], tensor), name


def test_a_dcp_checkpoint_reshards_to_another_mesh(tmp_path):
    source = fixture_dir("llama_tp2_fsdp2_dcp") / "checkpoint"  # torch's own save on a (dp=2, tp=2) mesh
    result = ckpttool.split(source, tmp_path / "fsdp3", fsdp=3)
    assert result.format == "dcp" and len(result.files) == 3
    assert ckpttool.diff(source, tmp_path / "fsdp3").equal


def test_two_expert_layouts_hold_the_same_model(tmp_path):
    """One expert per rank (fsdp=4, ep=4) and two per rank under TP (tp=2, ep=2): diff proves them equal."""
    ckpttool.split(MIXTRAL, tmp_path / "ep4", fsdp=4, ep=4)
    ckpttool.split(MIXTRAL, tmp_path / "tp2ep2", tp=2, ep=2)
    assert ckpttool.diff(tmp_path / "ep4", tmp_path / "tp2ep2").equal


def test_the_same_split_writes_the_same_bytes(tmp_path):
    for name in ("a", "b"):
        ckpttool.split(LLAMA, tmp_path / name, fsdp=2, tp=2, workers=3)
    assert tree_digest(tmp_path / "a") == tree_digest(tmp_path / "b")


def test_dry_run_prints_the_placements_and_writes_nothing(cli, tmp_path):
    result = cli("split", MIXTRAL, tmp_path / "out", "--to", "dcp", "--fsdp", "2", "--tp", "2", "--ep", "2", "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "mesh:     fsdp=2 tp=2 ep=2 (4 ranks)" in out
    assert "coverage: ok, every chunk of 21 tensors covered exactly once" in out
    assert "  model.embed_tokens.weight  [1001x32]  (_StridedShard(0, sf=2), Shard(0)) over fsdp=2 x tp=2  local 251x32, 250x32 x3" in out
    assert "  model.layers.0.self_attn.o_proj.weight  [32x32]  (Shard(0), Shard(1)) over fsdp=2 x tp=2  local 16x16 x4" in out
    assert ("  model.layers.0.mlp.experts.gate_up_proj  [4x96x32]  (_StridedShard(0, sf=2), Shard(0)) over efsdp=2 x ep=2"
            "  local 1x96x32 x4") in out
    assert "peak memory: at most" in out and "__3_0.distcp" in out
    assert not (tmp_path / "out").exists()


def test_json_is_one_document_with_every_local_shape(cli):
    result = cli("split", LLAMA, "--to", "dcp", "--tp", "2", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "ok" and doc["mesh"] == {"dp": 1, "fsdp": 1, "tp": 2, "ep": 1, "world": 2}
    embed = next(t for t in doc["tensors"] if t["name"] == "model.embed_tokens.weight")
    assert embed["local_shapes"] == [[501, 32], [500, 32]] and embed["placements"] == "(Shard(0)) over tp=2"
    assert [f["name"] for f in doc["files"]] == ["__0_0.distcp", "__1_0.distcp"]
    assert doc["predicted_peak_bytes"] > 0


def test_the_command_writes_a_checkpoint_with_its_config(cli, tmp_path):
    result = cli("split", LLAMA, tmp_path / "out", "--to", "dcp", "--fsdp", "2", "-q")
    assert result.exit_code == 0, result.output
    names = sorted(p.name for p in (tmp_path / "out").iterdir())
    assert names == [".ckpttool-split.json", ".metadata", "__0_0.distcp", "__1_0.distcp", "config.json", "generation_config.json",
                     "tokenizer.json", "tokenizer_config.json"]
    assert "wrote" in result.stdout and "2 rank files + .metadata" in result.stdout


# ---- errors: each with its message -----------------------------------------------------------------------


def test_experts_that_ep_does_not_divide_are_refused(cli, tmp_path):
    result = cli("split", MIXTRAL, tmp_path / "out", "--to", "dcp", "--fsdp", "3", "--ep", "3")
    assert_failed_cleanly(result, tmp_path / "out", "Error: the mesh fsdp=3 ep=3 (3 ranks) does not fit the model (4 problems)",
                          "'model.layers.0.mlp.experts.gate_up_proj': its 4 experts (dim 0) cannot be split evenly over "
                          "ep=3 ranks; choose an ep that divides 4")


def test_ep_must_divide_the_ranks(cli, tmp_path):
    result = cli("split", MIXTRAL, tmp_path / "out", "--to", "dcp", "--ep", "2")
    assert_failed_cleanly(result, tmp_path / "out", "Error: ep=2 does not divide the 1 rank of fsdp=1 x tp=1",
                          "or more ranks (fsdp=2 or tp=2)")
    with pytest.raises(ArgumentError, match=r"^tp=0: a mesh dim is a whole number of ranks"):
        ckpttool.split(LLAMA, tmp_path / "out", tp=0)


def test_ep_on_a_model_without_experts_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"ep=2: the model has no stacked expert tensors to place over ep ranks"):
        ckpttool.split(LLAMA, tmp_path / "out", fsdp=2, ep=2)


def test_a_tensor_without_a_tensor_parallel_placement_is_refused(cli, tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=8)).save_pretrained(tmp_path / "gpt2")
    result = cli("split", tmp_path / "gpt2", tmp_path / "out", "--to", "dcp", "--tp", "2")
    assert_failed_cleanly(result, tmp_path / "out", "'transformer.h.0.attn.c_attn.weight': no tensor-parallel placement "
                          "is known for it (tp=2)", "split with tp=1 for a model it does not know")
    assert cli("split", tmp_path / "gpt2", tmp_path / "out", "--to", "dcp", "--fsdp", "2", "-q").exit_code == 0


def test_split_needs_a_config(cli, tmp_path):
    import shutil

    shutil.copytree(fixture_dir("llama_tp2_dcp") / "checkpoint", tmp_path / "ckpt")  # its config lies beside it
    result = cli("split", tmp_path / "ckpt", tmp_path / "out", "--to", "dcp", "--fsdp", "2")
    assert_failed_cleanly(result, tmp_path / "out", "split needs the model's config.json, as transformers builds it: it "
                          "names the tensors as the parallelized model holds them in memory (none was found in or next "
                          "to the source); give --config PATH")
    with pytest.raises(ConfigError, match=r"\(none was found in or next to the source\); give config='PATH'$"):
        ckpttool.split(tmp_path / "ckpt", tmp_path / "out", fsdp=2)
    ckpttool.split(tmp_path / "ckpt", tmp_path / "out", fsdp=2, config=fixture_dir("llama_tp2_dcp"))


def test_a_source_missing_a_rank_file_is_refused_naming_it(cli, tmp_path):
    import shutil

    shutil.copytree(fixture_dir("llama_tp2_dcp"), tmp_path / "src")
    (tmp_path / "src" / "checkpoint" / "__1_0.distcp").unlink()
    result = cli("split", tmp_path / "src" / "checkpoint", tmp_path / "out", "--to", "dcp", "--fsdp", "2")
    assert_failed_cleanly(result, tmp_path / "out", "'model.embed_tokens.weight': rows 501..1001 covered by no piece",
                          "The metadata places them in '__1_0.distcp', which is missing")


def test_usage_errors(cli, tmp_path):
    assert cli("split", LLAMA, tmp_path / "out", "--to", "parquet").exit_code == 2
    assert cli("split", LLAMA, tmp_path / "out", "--fsdp", "2").exit_code == 2  # --to is required
    result = cli("split", LLAMA, "--to", "dcp")
    assert result.exit_code == 2 and "Missing argument 'OUT' (only --dry-run runs without one)" in result.stderr
    with pytest.raises(ArgumentError, match=r"^to='parquet': split writes 'dcp', 'megatron'"):
        ckpttool.split(LLAMA, tmp_path / "out", to="parquet")


# ---- OUT: the merge's rules ------------------------------------------------------------------------------


def test_an_earlier_split_is_replaced_only_with_force(cli, tmp_path):
    out = tmp_path / "out"
    assert cli("split", LLAMA, out, "--to", "dcp", "--fsdp", "4", "-q").exit_code == 0
    result = cli("split", LLAMA, out, "--to", "dcp", "--fsdp", "2")
    assert result.exit_code == 1 and f"Error: destination '{out}' exists and is not empty; pass --force to replace it" in result.stderr
    assert len(list(out.glob("*.distcp"))) == 4
    assert cli("split", LLAMA, out, "--to", "dcp", "--fsdp", "2", "--force", "-q").exit_code == 0
    assert sorted(p.name for p in out.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize("entry", ["notes.txt", "model.safetensors"])
def test_force_never_replaces_what_a_split_did_not_write(cli, tmp_path, entry):
    out = tmp_path / "out"
    out.mkdir()
    (out / ".metadata").write_bytes(b"x")
    (out / entry).write_text("keep me")
    result = cli("split", LLAMA, out, "--to", "dcp", "--fsdp", "2", "--force")
    assert result.exit_code == 1
    assert (f"holds 1 entry that ckpttool did not write ({entry}); --force replaces only an earlier output of a split. "
            "Nothing was touched") in result.stderr
    assert (out / entry).read_text() == "keep me"


def test_out_inside_the_source_is_refused(tmp_path):
    import shutil

    from ckpttool.errors import DestinationError

    shutil.copytree(LLAMA, tmp_path / "src")
    with pytest.raises(DestinationError, match="lies inside the source"):
        ckpttool.split(tmp_path / "src", tmp_path / "src" / "dcp", fsdp=2)


def test_a_failure_before_the_publish_leaves_nothing(tmp_path, monkeypatch):
    from ckpttool.writers import dcp

    def fail(files, directory):
        raise OutputError("'.metadata': cannot write: No space left on device; nothing was published")

    monkeypatch.setattr(dcp, "write_metadata", fail)
    with pytest.raises(OutputError, match="No space left on device"):
        ckpttool.split(LLAMA, tmp_path / "out", fsdp=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_a_written_archive_that_does_not_read_back_is_not_published(tmp_path, monkeypatch):
    from ckpttool.writers import torch_archive

    real = torch_archive.TensorArchive.tail
    monkeypatch.setattr(torch_archive.TensorArchive, "tail", lambda self, crc: b"\0" * len(real(self, crc)))
    with pytest.raises(OutputError, match=r"^the written checkpoint does not read back"):
        ckpttool.split(LLAMA, tmp_path / "out", fsdp=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_the_source_is_never_modified(tmp_path):
    before = tree_digest(MIXTRAL)
    ckpttool.split(MIXTRAL, tmp_path / "out", fsdp=2, ep=2)
    assert tree_digest(MIXTRAL) == before


def test_two_processes_under_torchrun_write_what_one_writes(tmp_path):
    from test_distributed_merge import torchrun

    ckpttool.split(MIXTRAL, tmp_path / "one", fsdp=2, tp=2, ep=2)
    done = torchrun("split", str(MIXTRAL), str(tmp_path / "two"), "--to", "dcp", "--fsdp", "2", "--tp", "2", "--ep", "2")
    assert done.returncode == 0, done.stdout + done.stderr
    assert tree_digest(tmp_path / "two") == tree_digest(tmp_path / "one")
    assert done.stdout.count("coverage: ok") == 1  # only rank 0 speaks


def test_a_tied_head_is_written_under_its_in_memory_name_from_the_embedding(tmp_path):
    """``save_pretrained`` drops a tied ``lm_head.weight``; the model's state dict (what DCP loads) has it."""
    import torch.distributed.checkpoint as dcp
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=101, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                         num_key_value_heads=1, tie_word_embeddings=True)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(tmp_path / "hf")
    result = ckpttool.split(tmp_path / "hf", tmp_path / "dcp", fsdp=2, tp=2)
    assert "lm_head.weight" in [s.name for s in result.tensors]
    state = {name: torch.full_like(t, float("nan")) for name, t in model.state_dict().items()}
    dcp.load(state, storage_reader=FileSystemReader(tmp_path / "dcp"), no_dist=True)
    assert torch.equal(state["lm_head.weight"], model.model.embed_tokens.weight)
    for name, tensor in model.state_dict().items():
        assert torch.equal(state[name], tensor), name


@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None)
@given(case=sharded())
def test_every_rank_holds_the_box_torch_gives_it_empty_or_not(case):
    """With Shard/Replicate placements a rank's chunk is torch's ``compute_local_shape_and_global_offset``, an
    empty shard included (DCP records it there), on the ranks of a row-major mesh."""
    shape, mesh, coordinate, placements = case
    sharding = Sharding("t", tuple(shape), tuple((f"d{i}", n) for i, n in enumerate(mesh)), tuple(placements))
    rank = sum(c * math.prod(mesh[i + 1:]) for i, c in enumerate(coordinate))
    assert sharding.coordinate(rank) == tuple(coordinate)
    torch_shape, torch_offset = _by_torch(shape, mesh, coordinate, placements)
    held = sharding.boxes(rank) or [sharding.empty_box(rank)]
    assert held == [Box(torch_offset, torch_shape)]
