"""``split --to megatron`` for gpt-oss (issue 29): HuggingFace gpt-oss -> Megatron-Core ``torch_dist`` and back.

The producer is the judge: the split of the fixture's HF reference (``fixtures/megatron_gpt_oss_tp2_ep2``, written by
megatron-core 0.16.1) holds megatron-core's own global tensors bit for bit: the sinks as
``core_attention.softmax_offset``, every bias, the router's, the experts' ``linear_fc1`` as ``[gate; up]`` taken apart
from HF's interleaved columns and transposed back, ``linear_fc2`` transposed back. Merging the split gives the
merge of the fixture back bit for bit at several meshes. megatron-core itself loads the split strictly and its
forward gives the producer's logits (marked slow; skipped without ``/work/venv-megatron``).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, load_output, tree_digest
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

import ckpttool
from ckpttool.errors import ConfigError
from ckpttool.families.adapter import REPLICATE
from ckpttool.families.conventions import megatron_back
from ckpttool.plan.transforms import transform_tensor

CASE = FIXTURES / "megatron_gpt_oss_tp2_ep2"
VOCAB = 251
MEGATRON_VENV = Path(os.environ.get("CKPTTOOL_MEGATRON_VENV", "/work/venv-megatron"))
CONSUMER = Path(__file__).with_name("megatron_gpt_oss_consumer.py")
FC1 = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def split(out: Path, tp: int = 2, pp: int = 1, ep: int = 2, source: Path = CASE / "reference", **kw):
    return ckpttool.split(source, out, to="megatron", tp=tp, pp=pp, ep=ep, make_vocab_size_divisible_by=64,
                          config=CASE / "config.json", **kw)


def full_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP directory, whole (torch's own reader, no process group)."""
    import torch.distributed.checkpoint as dcp

    metadata = FileSystemReader(directory).read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(state, storage_reader=FileSystemReader(directory), no_dist=True)
    return state


@pytest.fixture(scope="module")
def tp2_ep2(tmp_path_factory) -> Path:
    """The fixture's reference split at the layout megatron-core saved it at, iteration 10."""
    out = tmp_path_factory.mktemp("gptback") / "out"
    split(out, iteration=10)
    return out


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> Path:
    """The fixture's own torch_dist checkpoint merged to HF."""
    out = tmp_path_factory.mktemp("gptback") / "merged"
    ckpttool.merge(CASE / "torch_dist", out)
    return out


def test_the_split_holds_megatrons_own_global_tensors_bit_for_bit(tp2_ep2):
    mine = full_tensors(tp2_ep2 / "iter_0000010")
    real = full_tensors(CASE / "torch_dist" / "iter_0000010")
    assert sorted(mine) == sorted(real)
    for name, want in real.items():
        got = mine[name]
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(got[:VOCAB], want[:VOCAB]), name
            assert not got[VOCAB:].any(), name  # padding rows: zeros (Megatron's hold their random init)
        else:
            assert torch.equal(got, want), name


def test_the_linear_layers_extra_state_keys_are_megatrons(tp2_ep2):
    def objects(directory: Path) -> list[str]:
        return sorted(k for k, m in FileSystemReader(directory).read_metadata().state_dict_metadata.items()
                      if not hasattr(m, "size") and not k.startswith("rng_state/"))

    assert objects(tp2_ep2 / "iter_0000010") == objects(CASE / "torch_dist" / "iter_0000010")


def test_experts_are_whole_chunks_on_every_tp_rank(tp2_ep2):
    """Expert TP 1: one chunk per layer and expert, [gate; up] together (the de-interleave's blocks stay whole)."""
    chunks = FileSystemReader(tp2_ep2 / "iter_0000010").read_metadata().state_dict_metadata[FC1].chunks
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [
        ((layer, e, 0, 0), (1, 1, 64, 64)) for layer in range(2) for e in range(4)]


def test_common_pt_records_gpt_oss_args_the_merge_checks(tp2_ep2):
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(tp2_ep2 / "iter_0000010" / "common.pt", weights_only=True)
    args = vars(common["args"])
    assert {k: args[k] for k in ("softmax_type", "add_bias_linear", "add_qkv_bias", "quick_geglu", "swiglu",
                                 "glu_linear_offset", "activation_func_clamp_value", "moe_router_pre_softmax",
                                 "window_size", "expert_tensor_parallel_size", "num_experts",
                                 "padded_vocab_size")} == {
        "softmax_type": "learnable", "add_bias_linear": True, "add_qkv_bias": True, "quick_geglu": True,
        "swiglu": False, "glu_linear_offset": 1.0, "activation_func_clamp_value": 7.0,
        "moe_router_pre_softmax": False, "window_size": (7, 0), "expert_tensor_parallel_size": 1, "num_experts": 4,
        "padded_vocab_size": 256}


@pytest.mark.parametrize(("tp", "pp", "ep"), [(2, 1, 2), (1, 2, 4), (2, 2, 1)])
def test_merge_split_merge_is_bit_exact(merged, tp, pp, ep, tmp_path):
    """merge(fixture) -> split --to megatron -> merge gives the first merge back, bit for bit."""
    before = tree_digest(merged)
    split(tmp_path / "out", tp, pp, ep, source=merged)
    assert tree_digest(merged) == before  # the source is never modified
    result = ckpttool.merge(tmp_path / "out", tmp_path / "back")
    assert (result.parallel["tp"], result.parallel["pp"], result.parallel["ep"]) == (tp, pp, ep)
    got, want = load_output(tmp_path / "back"), load_output(merged)
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k].dtype != want[k].dtype or not torch.equal(got[k], want[k])] == []


def test_the_turned_around_cut_reaches_every_hf_element_once():
    """Every HF element is in exactly one Megatron-Core tensor; the experts' through the inverse transforms."""
    from ckpttool.commands.merge import prepare

    info = prepare(CASE / "reference", config=CASE / "config.json").model
    tensors = {t.name: t for t in megatron_back.megatron_tensors(info, 256)}
    covered: dict[str, int] = {}
    for t in tensors.values():
        for sl in t.slices:
            covered[sl.source] = covered.get(sl.source, 0) + sl.src.numel
    assert covered == {name: int(torch.Size(shape).numel()) for name, shape in info.disk_shapes.items()}
    assert tensors[FC1].transform.name == "transpose dims 2 and 3, then de-interleave 2 parts of 32 along dim 2"
    assert tensors["decoder.layers.mlp.experts.experts.linear_fc2.weight"].transform.name == "transpose dims 2 and 3"
    assert tensors["decoder.layers.self_attention.core_attention.softmax_offset"].transform is None


def test_the_inverse_transform_undoes_the_merge_on_real_tensors():
    """The fc1 transform on the reference's gate_up_proj gives the fixture's own fc1, layer by layer."""
    from ckpttool.commands.merge import prepare

    info = prepare(CASE / "reference", config=CASE / "config.json").model
    fc1 = {t.name: t for t in megatron_back.megatron_tensors(info, 256)}[FC1]
    hf = load_file(CASE / "reference" / "model.safetensors")
    pre = torch.stack([hf[f"model.layers.{i}.mlp.experts.gate_up_proj"] for i in range(2)])
    want = full_tensors(CASE / "torch_dist" / "iter_0000010")[FC1]
    assert torch.equal(transform_tensor(fc1.transform, pre, FC1), want)


def test_from_hf_refuses_a_model_made_through_transforms():
    from ckpttool.commands.merge import prepare

    info = prepare(CASE / "reference", config=CASE / "config.json").model
    with pytest.raises(ConfigError, match=r"gpt_oss: .*linear_fc1\.weight.* are made through a transform; from_hf "
                                          r"gives only boxes: use megatron_tensors"):
        megatron_back.from_hf(info, 256)


def test_gpt_oss_placements_put_experts_whole_and_sinks_by_head():
    place = megatron_back.tp_placement
    assert place(FC1, "gpt_oss").kind == "replicate"
    assert place(FC1).kind == "strided"  # other families' experts stay tensor-parallel
    assert place("decoder.layers.self_attention.core_attention.softmax_offset", "gpt_oss").dim == 1
    assert place("decoder.layers.mlp.router.bias", "gpt_oss").kind == "replicate"


def test_experts_cut_by_tensor_parallel_are_refused_naming_the_transform(cli, monkeypatch, tmp_path):
    """Were the experts' fc1 cut in TP halves, a chunk would cut through the de-interleave's blocks: refused,
    naming the tensor and the transform, nothing written."""
    rules = megatron_back.FAMILY_TP_RULES["gpt_oss"]
    kept = tuple(r for r in rules if "experts" not in r[0]) + ((r"experts\.linear_fc[12]\.bias$", REPLICATE),)
    monkeypatch.setattr(megatron_back, "FAMILY_TP_RULES", {"gpt_oss": kept})  # fc1's weight: TP halves
    out = tmp_path / "out"
    result = cli("split", CASE / "reference", out, "--to", "megatron", "--tp", "2", "--config", CASE / "config.json")
    assert_failed_cleanly(result, out, f"'{FC1}'", "cuts through the blocks of",
                          "de-interleave 2 parts of 32 along dim 2")


def test_a_missing_hf_tensor_is_refused_naming_it(cli, tmp_path):
    src = tmp_path / "hf"
    src.mkdir()
    tensors = load_file(CASE / "reference" / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.gate_up_proj"]
    save_file(tensors, src / "model.safetensors", metadata={"format": "pt"})
    (src / "config.json").write_bytes((CASE / "config.json").read_bytes())
    before = tree_digest(src)
    out = tmp_path / "out"
    result = cli("split", src, out, "--to", "megatron", "--tp", "2", "--ep", "2")
    assert_failed_cleanly(result, out, "model.layers.1.mlp.experts.gate_up_proj")
    assert tree_digest(src) == before


def test_an_ep_that_does_not_divide_the_experts_is_refused(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("split", CASE / "reference", out, "--to", "megatron", "--ep", "3", "--config", CASE / "config.json")
    assert_failed_cleanly(result, out, "ep=3 does not divide the 4 experts")


# ------------------------------------------------------------------------------------------------
# the real consumer: megatron-core loads the split and runs gpt-oss
# ------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.skipif(not (MEGATRON_VENV / "bin" / "python").is_file(),
                    reason=f"megatron-core venv not at {MEGATRON_VENV} (set CKPTTOOL_MEGATRON_VENV)")
def test_megatron_core_loads_the_split_strictly_and_gives_its_own_logits(megatron_torchrun, tmp_path):
    split(tmp_path / "out")
    out = tmp_path / "logits.safetensors"
    done = megatron_torchrun(CONSUMER, tmp_path / "out" / "iter_0000000", out, nproc=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    got, want = load_file(out), load_file(CASE / "logits.safetensors")
    assert torch.equal(got["tokens"], want["tokens"])
    # the producer's logits are its one-process (TP 1) forward; TP 2 sums in another order
    torch.testing.assert_close(got["logits"][..., :VOCAB], want["logits"][..., :VOCAB], rtol=0, atol=1e-5)
