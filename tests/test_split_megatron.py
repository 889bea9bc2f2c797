"""``ckpttool split --to megatron``: HuggingFace -> Megatron-Core ``torch_dist`` for TP x PP x EP.

The producer is the judge: for the exact layout of each Megatron fixture (written by megatron-core 0.16.1 itself,
``fixtures/make_megatron.py``), the split of the fixture's HF reference holds the same tensors as Megatron's own
``torch_dist`` checkpoint: the same keys, global shapes, dtypes, the same chunks, and the same bytes (the padded
vocab rows aside: Megatron's hold its random init, ours zeros). Round trips (split, then merge) give the
reference back bit for bit over other layouts. The consumer is the final judge: megatron-core loads the output with
``dist_checkpointing.load`` at TP=2 x PP=2 and at TP=2 x EP=2 (4 ranks, gloo) and its forward gives transformers'
logits (``tests/megatron_consumer.py``; skipped without ``/work/venv-megatron``).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, load_output, tree_digest
from safetensors.torch import load_file
from torch.distributed.checkpoint import FileSystemReader

import ckpttool
from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.families.conventions import megatron_core

MEGATRON_VENV = Path(os.environ.get("CKPTTOOL_MEGATRON_VENV", "/work/venv-megatron"))
CONSUMER = Path(__file__).with_name("megatron_consumer.py")
#: fixture -> the layout megatron-core saved it at (tp, pp, ep, make_vocab_size_divisible_by)
LAYOUTS = {"tp2_pp2": (2, 2, 1, 128), "tp2_padvocab": (2, 1, 1, 640), "pp2_vpp2": (1, 2, 1, 128),
           "ep2_moe": (1, 1, 2, 128), "qwen2moe_tp2_ep2": (2, 1, 2, 128), "qwen2moe_pp2_ep2": (1, 2, 2, 128)}


#: layers of each fixture's model
LAYERS = {"tp2_pp2": 4, "tp2_padvocab": 2, "pp2_vpp2": 4, "ep2_moe": 2, "qwen2moe_tp2_ep2": 2, "qwen2moe_pp2_ep2": 2}


def fixture(case: str) -> Path:
    path = FIXTURES / f"megatron_{case}"
    assert (path / "reference").is_dir(), f"fixture {path.name} missing: run fixtures/make_megatron.py"
    return path


def split_case(case: str, out: Path, tp: int, pp: int, ep: int, divisible_by: int = 128, **kw) -> ckpttool.SplitResult:
    return ckpttool.split(fixture(case) / "reference", out, to="megatron", tp=tp, pp=pp, ep=ep,
                          make_vocab_size_divisible_by=divisible_by, config=fixture(case) / "config.json", **kw)


def full_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, whole (torch's own reader, no process group)."""
    import torch.distributed.checkpoint as dcp

    metadata = FileSystemReader(directory).read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(state, storage_reader=FileSystemReader(directory), no_dist=True)
    return state


def chunk_lists(directory: Path) -> dict[str, list]:
    metadata = FileSystemReader(directory).read_metadata()
    return {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)
            for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_split_for_a_fixture_layout_holds_what_megatron_saved(case, tmp_path):
    tp, pp, ep, divisible_by = LAYOUTS[case]
    split_case(case, tmp_path / "out", tp, pp, ep, divisible_by, iteration=10)
    ours, theirs = tmp_path / "out" / "iter_0000010", fixture(case) / "torch_dist" / "iter_0000010"
    mine, real = full_tensors(ours), full_tensors(theirs)
    assert sorted(mine) == sorted(real)  # the same keys (.metadata lists them in the order ranks first write them)
    assert chunk_lists(ours) == chunk_lists(theirs)  # one chunk per layer, expert and TP half, as megatron-core cuts
    # the linear layers' _extra_state objects too, per layer (and expert), with the bytes of [None] megatron-core
    # saves; not the RNG state (a converted checkpoint is loaded with --no-load-rng or --finetune)
    objects = [k for k, m in FileSystemReader(ours).read_metadata().state_dict_metadata.items() if not hasattr(m, "size")]
    theirs_objects = [k for k, m in FileSystemReader(theirs).read_metadata().state_dict_metadata.items()
                      if not hasattr(m, "size") and not k.startswith("rng_state/")]
    assert objects and sorted(objects) == sorted(theirs_objects)
    assert all(o.endswith((f"_{LAYERS[case]}", f"_{LAYERS[case]}.4")) for o in objects)
    import torch.distributed.checkpoint as dcp

    state = {objects[0]: None}
    dcp.load(state, storage_reader=FileSystemReader(ours), no_dist=True)
    assert state[objects[0]] == [None]  # torch reads the object back as megatron-core saved it
    vocab = json.loads((fixture(case) / "config.json").read_text())["vocab_size"]
    for name, want in real.items():
        got = mine[name]
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(got[:vocab], want[:vocab]), name
            assert not got[vocab:].any(), name  # the padding rows: zeros (Megatron's hold their random init)
        else:
            assert torch.equal(got, want), name


@pytest.mark.parametrize(("case", "tp", "pp", "ep", "divisible_by"), [
    ("tp2_pp2", 1, 1, 1, 128), ("tp2_pp2", 2, 2, 1, 128), ("tp2_pp2", 1, 4, 1, 128), ("tp2_pp2", 2, 4, 1, 8),
    ("tp2_padvocab", 2, 1, 1, 640), ("tp2_padvocab", 1, 2, 1, 128),
    ("ep2_moe", 1, 1, 4, 128), ("ep2_moe", 2, 2, 2, 128),
    ("qwen2moe_tp2_ep2", 2, 2, 2, 128), ("qwen2moe_tp2_ep2", 1, 1, 4, 64),
])
def test_split_then_merge_gives_the_reference_bit_for_bit(case, tp, pp, ep, divisible_by, tmp_path):
    src = fixture(case) / "reference"
    before = tree_digest(src)
    split_case(case, tmp_path / "out", tp, pp, ep, divisible_by)
    assert tree_digest(src) == before
    result = ckpttool.merge(tmp_path / "out", tmp_path / "back")  # config.json travels with the split
    assert result.parallel["tp"] == tp and result.parallel["pp"] == pp and result.parallel["ep"] == ep
    got, want = load_output(tmp_path / "back"), load_file(src / "model.safetensors")
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []


def test_common_pt_metadata_json_and_tracker_are_what_megatron_reads(tmp_path):
    split_case("qwen2moe_tp2_ep2", tmp_path / "out", 2, 1, 2, iteration=7)
    out = tmp_path / "out"
    assert (out / "latest_checkpointed_iteration.txt").read_text() == "7"
    assert sorted(p.name for p in out.iterdir()) == [".ckpttool-split.json", "config.json", "iter_0000007", "latest_checkpointed_iteration.txt"]
    directory = out / "iter_0000007"
    assert json.loads((directory / "metadata.json").read_text()) == json.loads(
        (fixture("qwen2moe_tp2_ep2") / "torch_dist" / "iter_0000010" / "metadata.json").read_text())
    with torch.serialization.safe_globals([argparse.Namespace]):  # megatron-core lists Namespace as safe
        common = torch.load(directory / "common.pt", weights_only=True)
    assert sorted(common) == ["args", "checkpoint_version", "iteration"]
    assert (common["checkpoint_version"], common["iteration"]) == (3.0, 7)
    args = vars(common["args"])
    assert {k: args[k] for k in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size",
                                 "padded_vocab_size", "num_experts", "num_query_groups", "add_qkv_bias",
                                 "moe_shared_expert_intermediate_size", "moe_shared_expert_gate")} == {
        "tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1, "expert_model_parallel_size": 2,
        "padded_vocab_size": 256, "num_experts": 4, "num_query_groups": 2, "add_qkv_bias": True,
        "moe_shared_expert_intermediate_size": 48, "moe_shared_expert_gate": True}


def test_dry_run_shows_the_mesh_placements_and_peak_and_writes_nothing(cli, tmp_path):
    case = fixture("qwen2moe_tp2_ep2")
    result = cli("split", case / "reference", tmp_path / "out", "--to", "megatron", "--tp", "2", "--ep", "2",
                 "--config", case / "config.json", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "mesh:     tp=2 ep=2 (4 ranks)" in result.output
    assert "peak memory: at most" in result.output
    assert ("decoder.layers.mlp.experts.experts.linear_fc1.weight  [2x4x64x32]  (Shard(1), _StridedShard(2, sf=2)) "
            "over ep=2 x tp=2  local 2x2x32x32 x4") in result.output
    # dense tensors are replicated over ep (those ranks are data parallel for them)
    assert "embedding.word_embeddings.weight  [256x32]  (Replicate(), Shard(0)) over ep=2 x tp=2  local 128x32 x4" in result.output
    assert not (tmp_path / "out").exists()


def test_force_replaces_only_an_earlier_split(cli, tmp_path):
    case, out = fixture("tp2_pp2"), tmp_path / "out"
    args = ["split", case / "reference", out, "--to", "megatron", "--tp", "2", "--config", case / "config.json"]
    assert cli(*args).exit_code == 0
    again = cli(*args)
    assert again.exit_code == 1 and "not empty" in again.stderr
    assert cli(*args, "--force").exit_code == 0
    (out / "iter_0000000" / "notes.txt").write_text("mine")
    refused = cli(*args, "--force")
    assert refused.exit_code == 1 and "iter_0000000/" in refused.stderr
    assert (out / "iter_0000000" / "notes.txt").read_text() == "mine"


@pytest.mark.parametrize(("case", "mesh", "message"), [
    ("tp2_pp2", ["--tp", "4"], ("tp=4 does not divide the 4 attention heads and 2 query groups (num_attention_heads, "
                                "num_key_value_heads): megatron-core gives each rank whole groups")),
    ("tp2_pp2", ["--pp", "8"], "pp=8 does not split the 4 layers (num_hidden_layers) into equal stages"),
    ("tp2_pp2", ["--pp", "3"], "pp=3 does not split the 4 layers (num_hidden_layers) into equal stages"),
    ("tp2_pp2", ["--ep", "2"], "ep=2: the model has no experts to place over ep ranks"),
    ("ep2_moe", ["--ep", "3"], "ep=3 does not divide the 4 experts; choose an ep that divides 4"),
])
def test_a_mesh_that_does_not_fit_is_refused_with_its_reason(cli, case, mesh, message, tmp_path):
    src = fixture(case)
    result = cli("split", src / "reference", tmp_path / "out", "--to", "megatron", *mesh, "--config", src / "config.json")
    assert_failed_cleanly(result, tmp_path / "out", "Error: the mesh ", message)


def test_tp_that_does_not_divide_the_ffn_is_refused(cli, tmp_path):
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=6, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, head_dim=4)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    result = cli("split", tmp_path / "hf", tmp_path / "out", "--to", "megatron", "--tp", "4")
    assert_failed_cleanly(result, tmp_path / "out", "tp=4 does not divide the intermediate_size 6 of "
                                                     "'decoder.layers.mlp.linear_fc1.weight'")


def test_a_tensor_with_no_megatron_place_is_refused_never_dropped(cli, tmp_path):
    import transformers

    config = transformers.LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, attention_bias=True)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    result = cli("split", tmp_path / "hf", tmp_path / "out", "--to", "megatron")
    assert_failed_cleanly(result, tmp_path / "out", "llama: 2 tensors of the model have no place in the Megatron-Core "
                                                     "form ckpttool writes: 'model.layers.0.self_attn.o_proj.bias', "
                                                     "'model.layers.1.self_attn.o_proj.bias'")


def test_a_family_with_no_megatron_form_is_refused(cli, tmp_path):
    src = FIXTURES / "qwen3_next_hf_tp2" / "checkpoint"  # deepseek_v3 was refused here before issue 31
    result = cli("split", src, tmp_path / "out", "--to", "megatron")
    assert_failed_cleanly(result, tmp_path / "out", "model_type 'qwen3_next': ckpttool knows no Megatron-Core form for "
                                                     "it; split --to megatron writes llama, mistral, qwen2, mixtral, qwen2_moe")


def test_options_of_the_other_target_are_refused(tmp_path):
    src = fixture("tp2_pp2") / "reference"
    with pytest.raises(ArgumentError, match="fsdp=2: Megatron-Core torch_dist has no FSDP dim; give tp, pp and ep"):
        ckpttool.split(src, tmp_path / "out", to="megatron", fsdp=2)
    with pytest.raises(ArgumentError, match="pp, make_vocab_size_divisible_by and iteration are for to='megatron'"):
        ckpttool.split(src, tmp_path / "out", to="dcp", pp=2)
    with pytest.raises(ArgumentError, match="make_vocab_size_divisible_by=0: a whole number, 1 or more"):
        ckpttool.split(src, tmp_path / "out", to="megatron", make_vocab_size_divisible_by=0)
    with pytest.raises(ConfigError, match="pp=5 does not split"):
        ckpttool.split(src, None, to="megatron", pp=5, config=fixture("tp2_pp2") / "config.json", dry_run=True)


def test_two_processes_under_torchrun_write_what_one_writes(tmp_path):
    from test_distributed_merge import torchrun

    case = fixture("qwen2moe_tp2_ep2")
    split_case("qwen2moe_tp2_ep2", tmp_path / "one", 2, 1, 2)
    done = torchrun("split", str(case / "reference"), str(tmp_path / "two"), "--to", "megatron", "--tp", "2", "--ep", "2",
                    "--config", str(case / "config.json"))
    assert done.returncode == 0, done.stdout + done.stderr
    # common.pt is torch.save's: its serialization id is drawn at random on every save
    digest = {k: v for k, v in tree_digest(tmp_path / "one").items() if not k.endswith("common.pt")}
    assert {k: v for k, v in tree_digest(tmp_path / "two").items() if not k.endswith("common.pt")} == digest
    assert done.stdout.count("coverage: ok") == 1  # only rank 0 speaks


def test_a_tied_embedding_is_written_once_as_megatron_ties_it(tmp_path):
    """megatron-core shares the embedding with the output layer and saves no ``output_layer.weight``."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=101, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=True)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "hf")
    result = ckpttool.split(tmp_path / "hf", tmp_path / "out", to="megatron", tp=2, pp=2,
                            make_vocab_size_divisible_by=16)
    assert [s.name for s in result.tensors if "embedding" in s.name or "output" in s.name] == [
        "embedding.word_embeddings.weight"]
    assert result.tensors[0].shape == (128, 16)  # 101 padded to a multiple of 16 x tp 2
    ckpttool.merge(tmp_path / "out", tmp_path / "back")
    got, want = load_output(tmp_path / "back"), load_output(tmp_path / "hf")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_json_dry_run_reports_the_megatron_mesh(cli, tmp_path):
    case = fixture("tp2_pp2")
    result = cli("split", case / "reference", "--to", "megatron", "--tp", "2", "--pp", "2", "--iteration", "5",
                 "--config", case / "config.json", "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["mesh"] == {"tp": 2, "pp": 2, "ep": 1, "world": 4, "make_vocab_size_divisible_by": 128, "iteration": 5}
    assert doc["to"] == "megatron" and doc["dry_run"] and len(doc["files"]) == 4
    qkv = next(t for t in doc["tensors"] if t["name"] == "decoder.layers.self_attention.linear_qkv.weight")
    assert qkv["shape"] == [4, 64, 32] and qkv["local_shapes"] == [[2, 32, 32]] * 4


def test_the_megatron_names_come_from_the_merge_cut_turned_around():
    """from_hf is to_hf's boxes reversed: cutting the Megatron tensors it describes gives back every HF element."""
    from ckpttool.families.conventions.megatron_back import from_hf
    from ckpttool.commands.merge import prepare

    case = fixture("qwen2moe_tp2_ep2")
    info = prepare(case / "reference", config=case / "config.json").model
    tensors = from_hf(info, 256)
    covered: dict[str, int] = {}
    for _, _, slices, _ in tensors:
        for sl in slices:
            covered[sl.source] = covered.get(sl.source, 0) + sl.src.numel
    assert covered == {name: int(torch.Size(shape).numel()) for name, shape in info.disk_shapes.items()}


# ------------------------------------------------------------------------------------------------
# the real consumer: megatron-core loads the output and runs its forward
# ------------------------------------------------------------------------------------------------

needs_megatron = pytest.mark.skipif(not (MEGATRON_VENV / "bin" / "python").is_file(),
                                    reason=f"megatron-core venv not at {MEGATRON_VENV} (set CKPTTOOL_MEGATRON_VENV)")


def megatron_logits(torchrun, case: str, checkpoint: Path, out: Path,
                    layout: tuple[int, int, int] | None = None) -> torch.Tensor:
    """megatron-core 0.16.1 loads ``checkpoint`` at the case's layout, or at ``layout`` (tp, pp, ep), with gloo, one
    process per rank, and runs it (``torchrun``: conftest's ``megatron_torchrun``)."""
    tp, pp, ep = layout or LAYOUTS[case][:3]
    done = torchrun(CONSUMER, case, checkpoint, out, ",".join(map(str, (tp, pp, ep))), nproc=tp * pp * ep)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return load_file(out)["logits"]


def transformers_logits(case: str, tmp_path: Path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    hf = tmp_path / "hf"
    shutil.copytree(fixture(case) / "reference", hf)
    shutil.copy(fixture(case) / "config.json", hf / "config.json")
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="eager")
    tokens = load_file(fixture(case) / "logits.safetensors")["tokens"]
    with torch.no_grad():
        return model(tokens).logits


@needs_megatron
@pytest.mark.parametrize("case", ["tp2_pp2", "qwen2moe_tp2_ep2"])
def test_megatron_core_loads_the_split_and_gives_transformers_logits(case, megatron_torchrun, tmp_path):
    tp, pp, ep, divisible_by = LAYOUTS[case]
    split_case(case, tmp_path / "out", tp, pp, ep, divisible_by)
    got = megatron_logits(megatron_torchrun, case, tmp_path / "out" / "iter_0000000", tmp_path / "logits.safetensors")
    want = transformers_logits(case, tmp_path)
    vocab = want.shape[-1]
    assert got.shape[-1] == LAYOUTS[case][3] * tp * -(-vocab // (LAYOUTS[case][3] * tp))  # the padded vocab
    # Megatron's own forward of its own checkpoint differs from transformers' by up to 3e-7 here
    torch.testing.assert_close(got[..., :vocab], want, rtol=0, atol=1e-5)


@needs_megatron
def test_megatron_core_loads_a_tp2_pp2_ep2_split_and_gives_transformers_logits(megatron_torchrun, tmp_path):
    """All three at once, on 8 ranks: the Qwen2-MoE fixture (shared expert, QKV bias) at a layout it was not saved at."""
    split_case("qwen2moe_pp2_ep2", tmp_path / "out", 2, 2, 2)
    got = megatron_logits(megatron_torchrun, "qwen2moe_pp2_ep2", tmp_path / "out" / "iter_0000000", tmp_path / "logits.safetensors",
                          (2, 2, 2))
    want = transformers_logits("qwen2moe_pp2_ep2", tmp_path)
    torch.testing.assert_close(got[..., :want.shape[-1]], want, rtol=0, atol=1e-5)  # 3.0e-7 observed


@needs_megatron
def test_negative_control_a_wrong_qkv_interleave_changes_megatrons_logits(monkeypatch, megatron_torchrun, tmp_path):
    """Query groups laid out key-then-value swapped: every shape still fits, megatron-core still loads it, the
    forward is wrong. The consumer test above would catch such a mapping."""
    right = megatron_core._cut_qkv

    def swapped(cut, fqn, h, kind, lead, shape, heads, groups, head_dim):
        right(cut, fqn, h, kind, lead, shape, heads, groups, head_dim)
        k, v = f"{h}self_attn.k_proj.{kind}", f"{h}self_attn.v_proj.{kind}"
        cut.specs[k], cut.specs[v] = cut.specs[v], cut.specs[k]

    monkeypatch.setattr(megatron_core, "_cut_qkv", swapped)
    split_case("tp2_pp2", tmp_path / "out", 2, 2, 1)
    got = megatron_logits(megatron_torchrun, "tp2_pp2", tmp_path / "out" / "iter_0000000", tmp_path / "logits.safetensors")
    want = transformers_logits("tp2_pp2", tmp_path)
    difference = (got[..., :want.shape[-1]] - want).abs().max().item()
    assert difference > 1e-2, difference  # 1.37 on megatron-core 0.16.1 (3e-7 with the right interleave)
