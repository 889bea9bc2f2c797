"""gpt-oss with expert tensor parallelism (issue 29): Megatron-Core at ``--expert-tensor-parallel-size 2``, both ways.

The fixture ``megatron_gpt_oss_tp2_etp2`` (``fixtures/make_megatron_gpt_oss.py --case gpt_oss_tp2_etp2``) is
megatron-core 0.16.1's own save at TP 2 x expert TP 2 (EP 1, 2 ranks): a rank's expert ``linear_fc1`` is
``[gate_r; up_r]`` (in torch_dist two chunks of the global ``[gate; up]``, in the legacy files one local tensor), its
``linear_fc2`` a column half. Its reference is megatron-core's own unsharded load of that save, cut to transformers'
names and loaded strictly by transformers. megatron-core refuses to *train* gpt-oss at expert TP > 1 (its
``TransformerConfig`` allows expert biases only at expert TP 1); the producer only saves, setting the size after
that check.

- merge: torch_dist and legacy give the reference bit for bit (legacy: a rank's fc1 holds halves of gate and up,
  since gpt-oss's GLU is ``quick_geglu``; it was read as one block of rows before), and transformers computes
  Megatron's logits from it;
- ``split --to megatron --etp 2``: holds megatron-core's own global tensors bit for bit, in its own chunks (a rank's
  gate rows and up rows apart: each is one part, :class:`~ckpttool.plan.transforms.Take`, of the rank's contiguous
  HuggingFace columns), records expert TP 2 in ``common.pt`` and merges back bit for bit; megatron-core loads it
  strictly (slow).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
import transformers  # noqa: F401  (loaded for the logits test anyway: ckpttool then describes the config in-process)
from conftest import FIXTURES, assert_failed_cleanly, load_output
from safetensors.torch import load_file
from test_gpt_oss_megatron_split import full_tensors
from torch.distributed.checkpoint import FileSystemReader

import ckpttool
from ckpttool.errors import ConfigError
from ckpttool.layout.layout import Box
from ckpttool.plan.transforms import Chain, Take, Transpose, interleave, transform_tensor, within_part

CASE = FIXTURES / "megatron_gpt_oss_tp2_etp2"
VOCAB = 251
ITER = "iter_0000010"
EXPERTS = "decoder.layers.mlp.experts.experts."
MEGATRON_VENV = Path(os.environ.get("CKPTTOOL_MEGATRON_VENV", "/work/venv-megatron"))
CONSUMER = Path(__file__).with_name("megatron_gpt_oss_consumer.py")


def chunks(directory: Path, name: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    md = FileSystemReader(directory).read_metadata().state_dict_metadata[name]
    return sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)


def assert_bit_exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    """The fixture's torch_dist and legacy checkpoints merged to HF, once each."""
    done: dict[str, Path] = {}

    def merge(fmt: str) -> Path:
        if fmt not in done:
            done[fmt] = tmp_path_factory.mktemp("etp") / fmt
            ckpttool.merge(CASE / fmt, done[fmt], config=CASE / "config.json")
        return done[fmt]

    return merge


@pytest.fixture(scope="module")
def split_etp2(tmp_path_factory) -> Path:
    """The fixture's reference split at the layout megatron-core saved it at: TP 2, expert TP 2, iteration 10."""
    out = tmp_path_factory.mktemp("etp") / "split"
    ckpttool.split(CASE / "reference", out, to="megatron", tp=2, etp=2, make_vocab_size_divisible_by=64,
                   iteration=10, config=CASE / "config.json")
    return out


# ------------------------------------------------------------------------------------------------
# merge
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["torch_dist", "legacy"])
def test_an_expert_tp2_checkpoint_merges_to_the_reference_bit_for_bit(fmt, merged):
    assert_bit_exact(load_output(merged(fmt)), load_output(CASE / "reference"))


def test_the_fixture_cuts_the_experts_by_expert_tp():
    """The fixture is what the tests say: expert TP 2 in the args, fc1 saved as each rank's gate and up halves."""
    producer = json.loads((CASE / "producer.json").read_text())
    assert producer["parallel"] == {"tp": 2, "pp": 1, "ep": 1, "etp": 2}
    assert chunks(CASE / "torch_dist" / ITER, EXPERTS + "linear_fc1.weight") == [
        ((layer, e, start, 0), (1, 1, 16, 64)) for layer in range(2) for e in range(4) for start in (0, 16, 32, 48)]


def test_the_legacy_reader_places_a_quick_geglu_fc1_as_gate_and_up_halves():
    """A rank's local fc1 ``[gate_r; up_r]`` lands as gate rows r*f.. and up rows F + r*f.. of the global tensor:
    gpt-oss's args say ``quick_geglu`` (``swiglu`` False), which pairs the halves as SwiGLU does."""
    from ckpttool.commands.merge import prepare

    layout = prepare(CASE / "legacy", config=CASE / "config.json").layout
    pieces = layout.tensors["decoder.layers.0.mlp.experts.1.linear_fc1.weight"].pieces
    assert sorted((p.box.offsets, p.box.sizes, p.tags[0]) for p in pieces) == [
        ((0, 0), (16, 64), ("tp_rank", 0)), ((16, 0), (16, 64), ("tp_rank", 1)),
        ((32, 0), (16, 64), ("tp_rank", 0)), ((48, 0), (16, 64), ("tp_rank", 1))]


def test_transformers_computes_megatrons_logits_from_the_merge(merged):
    model, info = transformers.GptOssForCausalLM.from_pretrained(str(merged("torch_dist")), output_loading_info=True,
                                                    dtype=torch.float32)
    assert not any(info.values()), info  # strict: nothing missing, unexpected or mismatched
    megatron = load_file(CASE / "logits.safetensors")
    with torch.no_grad():
        logits = model.eval()(megatron["tokens"]).logits
    torch.testing.assert_close(logits[0], megatron["logits"][0, :, :VOCAB], atol=1e-4, rtol=0)


# ------------------------------------------------------------------------------------------------
# split --to megatron --etp 2
# ------------------------------------------------------------------------------------------------


def test_the_split_holds_megatrons_own_global_tensors_bit_for_bit(split_etp2):
    """Vocab padding rows aside (zeros here; Megatron's hold their random init)."""
    vocab = ("embedding.word_embeddings.weight", "output_layer.weight")
    mine, real = full_tensors(split_etp2 / ITER), full_tensors(CASE / "torch_dist" / ITER)
    assert {k: v.shape for k, v in mine.items()} == {k: v.shape for k, v in real.items()}
    assert [n for n in vocab if mine[n][VOCAB:].any()] == []
    assert_bit_exact({k: v[:VOCAB] if k in vocab else v for k, v in mine.items()},
                     {k: v[:VOCAB] if k in vocab else v for k, v in real.items()})


@pytest.mark.parametrize("part", ["linear_fc1.weight", "linear_fc1.bias", "linear_fc2.weight", "linear_fc2.bias"])
def test_the_experts_are_in_megatrons_own_chunks(split_etp2, part):
    """fc1 (and its bias): a rank's gate rows and up rows, apart; fc2 a column half; fc2's bias whole."""
    assert chunks(split_etp2 / ITER, EXPERTS + part) == chunks(CASE / "torch_dist" / ITER, EXPERTS + part)


def test_common_pt_records_expert_tp_2(split_etp2):
    with torch.serialization.safe_globals([argparse.Namespace]):
        args = vars(torch.load(split_etp2 / ITER / "common.pt", weights_only=True)["args"])
    assert (args["tensor_model_parallel_size"], args["expert_tensor_parallel_size"]) == (2, 2)


def test_the_split_merges_back_bit_for_bit(split_etp2, tmp_path):
    result = ckpttool.merge(split_etp2, tmp_path / "back")
    assert (result.parallel["tp"], result.parallel["ep"]) == (2, 1)
    assert_bit_exact(load_output(tmp_path / "back"), load_output(CASE / "reference"))


def test_an_expert_tp2_split_at_ep2_and_pp2_merges_back_bit_for_bit(tmp_path):
    ckpttool.split(CASE / "reference", tmp_path / "out", to="megatron", tp=2, ep=2, pp=2, etp=2,
                   make_vocab_size_divisible_by=64, config=CASE / "config.json")
    ckpttool.merge(tmp_path / "out", tmp_path / "back")
    assert_bit_exact(load_output(tmp_path / "back"), load_output(CASE / "reference"))


def test_the_dry_run_names_the_part_taken_and_counts_its_buffers(cli):
    """Each fc1 chunk reads the rank's whole columns (gate and up interleaved) and takes its part: the dry run
    names it, and its peak counts the columns read, the transposed copy and the chunk."""
    from ckpttool.commands.split import split
    from ckpttool.execute.buffers import buffer_sizes
    from ckpttool.writers.dcp import item_chunks

    result = cli("split", CASE / "reference", "--to", "megatron", "--tp", "2", "--etp", "2", "--dry-run", "--json",
                 "--make-vocab-size-divisible-by", "64", "--config", CASE / "config.json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["mesh"]["etp"] == 2
    named = {t["name"]: t.get("transform") for t in doc["tensors"]}
    assert named[EXPERTS + "linear_fc1.weight"].startswith("transpose dims 2 and 3, then take part ")
    assert named[EXPERTS + "linear_fc1.bias"].startswith("take part ")
    plan = split(CASE / "reference", None, to="megatron", tp=2, etp=2, make_vocab_size_divisible_by=64,
                 config=CASE / "config.json", dry_run=True)
    item = next(i for f in plan.files for i in f.items if i.fqn == EXPERTS + "linear_fc1.weight")
    assert item.box.sizes == (1, 1, 16, 64) and item.target.transform.source_shape(item.box.sizes) == (1, 1, 64, 32)
    sizes = buffer_sizes(item_chunks(item))
    assert sizes["transform"] == 16 * 64 * 4 and sizes["transform.0"] == 32 * 64 * 4, sizes
    assert doc["predicted_peak_bytes"] >= sum(sizes.values())


def test_without_etp_gpt_oss_experts_stay_whole(tmp_path):
    """The default is unchanged: expert TP 1 for gpt-oss, one chunk per layer and expert."""
    plan = ckpttool.split(CASE / "reference", None, to="megatron", tp=2, make_vocab_size_divisible_by=64,
                          config=CASE / "config.json", dry_run=True)
    boxes = sorted({i.box.offsets + i.box.sizes for f in plan.files for i in f.items
                    if i.fqn == EXPERTS + "linear_fc1.weight"})
    assert boxes == [(layer, e, 0, 0, 1, 1, 64, 64) for layer in range(2) for e in range(4)]


@pytest.mark.parametrize(("args", "needle"), [
    (["--to", "megatron", "--tp", "2", "--etp", "3"], "etp=3: the expert tensor-parallel size is 1"),
    (["--to", "megatron", "--etp", "2"], "etp=2: the expert tensor-parallel size is 1"),
])
def test_an_expert_tp_other_than_1_or_tp_is_refused(cli, tmp_path, args, needle):
    out = tmp_path / "out"
    result = cli("split", CASE / "reference", out, *args, "--config", CASE / "config.json")
    assert_failed_cleanly(result, out, needle, "or tp=")


def test_etp_for_a_dcp_split_is_a_usage_error(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("split", CASE / "reference", out, "--to", "dcp", "--tp", "2", "--etp", "2",
                 "--config", CASE / "config.json")
    assert result.exit_code == 2, result.output
    assert "etp=2 is for to='megatron'" in result.output
    assert not out.exists()


# ------------------------------------------------------------------------------------------------
# the part of a de-interleave (plan/transforms/take.py, chain.py)
# ------------------------------------------------------------------------------------------------


def test_take_is_one_part_of_an_interleave():
    rows = torch.arange(24).reshape(8, 3)  # g0 u0 g1 u1 ...
    assert torch.equal(transform_tensor(Take(0, 2, 1), rows), rows[1::2])
    assert torch.equal(transform_tensor(Take(1, 3, 2), rows.reshape(4, 6)), rows.reshape(4, 6)[:, 2::3])
    with pytest.raises(ConfigError, match="take part 1 of 2 interleaved along dim 0: drops the other parts"):
        Take(0, 2, 1).inverse()
    with pytest.raises(ConfigError, match="'t': take part 2 of 2 interleaved along dim 0: the part is not one of 0..1"):
        Take(0, 2, 2).bound((4,), "t")


def test_a_merge_plan_refuses_a_target_made_through_a_take():
    """A merge reads every stored element: a family cut whose transform drops some (a split's Take) is refused."""
    from ckpttool.layout.layout import Layout, TensorLayout
    from ckpttool.plan.tiling import Slice
    from ckpttool.plan.plan import TargetSpec, plan_merge

    layout = Layout("", "dcp", {"s": TensorLayout("s", (8, 3), "F32", ())})
    spec = TargetSpec("t", (4, 3), (Slice("s", Box((0, 0), (8, 3)), Box((0, 0), (8, 3))),), transform=Take(0, 2, 0))
    with pytest.raises(ConfigError, match="'t': take part 0 of 2 interleaved along dim 0 leaves the other parts unread"):
        plan_merge(layout, [spec])


def test_within_part_gives_a_box_of_one_part_whose_source_is_a_box():
    """gate rows 2..4 of ``[gate; up]`` taken apart from interleaved columns: pre columns 4..8, part 0; a box
    across gate and up is no part's."""
    hf = torch.arange(48.0).reshape(1, 6, 8)  # [E, H, 2I] with gate/up interleaved by column
    fc1 = Chain((interleave(2, 8, dim=1), Transpose(1, 2))).bound((1, 6, 8), "x").inverse()
    whole = transform_tensor(fc1, hf)  # [E, 2I, H]: [gate; up]
    for start, part in ((2, 0), (6, 1)):
        taken, shape, inner = within_part(fc1, (1, 8, 6), Box((0, start, 0), (1, 2, 6)))
        assert (shape, inner, taken.steps[-1]) == ((1, 4, 6), Box((0, start - 4 * part, 0), (1, 2, 6)), Take(1, 2, part))
        pre = taken.bound(shape, "x").pre_box(shape, inner)
        assert pre == Box((0, 0, 2 * inner.offsets[1]), (1, 6, 4))
        source = hf[:, :, pre.offsets[2]:pre.ends[2]].contiguous()
        assert torch.equal(transform_tensor(taken.bound(inner.sizes, "x"), source), whole[:, start:start + 2])
    assert within_part(fc1, (1, 8, 6), Box((0, 3, 0), (1, 2, 6))) is None
    assert within_part(Transpose(1, 2), (1, 8, 6), Box((0, 2, 0), (1, 2, 6))) is None


# ------------------------------------------------------------------------------------------------
# the real consumer
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not (MEGATRON_VENV / "bin" / "python").is_file(),
                    reason=f"megatron-core venv not at {MEGATRON_VENV} (set CKPTTOOL_MEGATRON_VENV)")
def test_megatron_core_loads_the_etp2_split_strictly_into_the_producers_own_weights(megatron_torchrun, tmp_path):
    """megatron-core, built at TP 2 x expert TP 2 as the producer saved, loads the split with
    ``strict="raise_all"``, and each rank then holds what its own legacy file of the producer holds (local tensors:
    fc1 ``[gate_r; up_r]``), bit for bit."""
    ckpttool.split(CASE / "reference", tmp_path / "out", to="megatron", tp=2, etp=2, make_vocab_size_divisible_by=64,
                   config=CASE / "config.json")
    out = tmp_path / "logits.safetensors"
    done = megatron_torchrun(CONSUMER, tmp_path / "out" / "iter_0000000", out, "gpt_oss_tp2_etp2", nproc=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for rank in range(2):
        got = load_file(f"{out}.rank{rank}")
        want = load_file(f"{out}.legacy{rank}")  # the producer's own legacy file of this rank, as the consumer read it
        assert sorted(got) == sorted(want)
        for name, tensor in want.items():
            if "word_embeddings" in name or "output_layer" in name:  # padding rows: zeros here, random there
                rows = max(0, min(tensor.shape[0], VOCAB - rank * tensor.shape[0]))
                assert torch.equal(got[name][:rows], tensor[:rows]), name
            else:
                assert torch.equal(got[name], tensor), name
