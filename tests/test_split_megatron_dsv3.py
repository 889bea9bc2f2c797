"""``split --to megatron`` for DeepSeek-V3 (issue 31): MLA (with and without ``q_lora_rank``), first-k dense layers,
shared experts, the router's expert bias, MTP layers, and uneven / virtual pipeline stages.

The producer is the judge: splitting a fixture's HF reference at the layout megatron-core 0.16.1 saved it at gives
megatron-core's own checkpoint: the same global tensors bit for bit, the same keys (``_extra_state`` included), the
same chunks, each on a rank of the same pipeline stage. The DeepSeek fixtures (``make_megatron_deepseek.py``) are
TP2 x EP2 with q_lora_rank 16 and PP2 (2 + 1 layers, uneven) x EP2 without it, each with one MTP layer; the Llama
ones (``make_megatron.py``) hold uneven stages (1 + 2) and virtual stages (PP2 x VPP2). Merging the split back gives
the HF input bit for bit. ``--etp 1`` keeps experts whole. An FP8 release goes straight to BF16, dequantized while
splitting, and comes back as its ``--dtype`` merge. megatron-core itself loads the splits strictly and runs them
(marked slow; skipped without ``/work/venv-megatron``).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, load_output
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

import ckpttool
from ckpttool.commands.meshes import MegatronMesh
from ckpttool.commands.split_megatron import layer_stages

MEGATRON_VENV = Path(os.environ.get("CKPTTOOL_MEGATRON_VENV", "/work/venv-megatron"))
HERE = Path(__file__).parent
#: fixture -> the split options of the layout megatron-core saved it at
LAYOUTS = {
    "deepseek_tp2_ep2": dict(tp=2, ep=2, make_vocab_size_divisible_by=64),
    "deepseek_pp2_ep2": dict(pp=2, ep=2, pp_first=2, make_vocab_size_divisible_by=64),
    "pp2_uneven": dict(pp=2, pp_first=1),
    "pp2_vpp2": dict(pp=2, vpp=2),
}


#: transformers is imported here anyway: configs are described in this process (conftest.describe_inline)
pytestmark = pytest.mark.usefixtures("describe_inline")


def fixture(case: str) -> Path:
    return FIXTURES / f"megatron_{case}"


def split(case: str, out: Path, source: Path | None = None, **kw) -> ckpttool.SplitResult:
    options = {**LAYOUTS[case], **kw}
    return ckpttool.split(source or fixture(case) / "reference", out, to="megatron", iteration=10,
                          config=fixture(case) / "config.json", **options)


@pytest.fixture(scope="module")
def splits(tmp_path_factory):
    """Each fixture's reference split once at its own layout."""
    done: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in done:
            done[case] = tmp_path_factory.mktemp(case) / "out"
            split(case, done[case])
        return done[case]

    return get


def read_all(directory: Path):
    """Every tensor of a DCP directory, whole, and its metadata (torch's own reader, no process group)."""
    import torch.distributed.checkpoint as dcp

    metadata = FileSystemReader(directory).read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(state, storage_reader=FileSystemReader(directory), no_dist=True)
    return state, metadata


def stages_of(metadata, per_stage: int) -> dict[tuple[str, tuple[int, ...] | None], int]:
    """Every chunk (fqn, offsets) -> the pipeline stage of the rank file holding it (``__{rank}_{n}.distcp``)."""
    return {(index.fqn, tuple(index.offset) if index.offset is not None else None):
            int(info.relative_path.split("_")[2]) // per_stage
            for index, info in metadata.storage_data.items() if not index.fqn.startswith("rng_state")}


@pytest.mark.parametrize("case", sorted(LAYOUTS))
def test_the_split_is_megatrons_own_checkpoint(case, splits):
    """Same tensors bit for bit (vocab padding aside: zeros here), same keys, chunks and pipeline stages."""
    mine, mine_md = read_all(splits(case) / "iter_0000010")
    real, real_md = read_all(fixture(case) / "torch_dist" / "iter_0000010")
    vocab = json.loads((fixture(case) / "producer.json").read_text())["vocab"]
    assert sorted(mine) == sorted(real)
    for name, want in real.items():
        got = mine[name]
        assert (got.shape, got.dtype) == (want.shape, want.dtype), name
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            assert torch.equal(got[:vocab], want[:vocab]) and not got[vocab:].any(), name
        else:
            assert torch.equal(got, want), name
    keys = lambda md: sorted(k for k in md.state_dict_metadata if not k.startswith("rng_state"))  # noqa: E731
    assert keys(mine_md) == keys(real_md)  # the _extra_state objects too
    for name, meta in real_md.state_dict_metadata.items():
        if hasattr(meta, "chunks"):
            chunks = lambda md: sorted((tuple(c.offsets), tuple(c.sizes)) for c in md.state_dict_metadata[name].chunks)  # noqa: E731
            assert chunks(mine_md) == chunks(real_md), name
    options = LAYOUTS[case]
    per_stage = options.get("tp", 1) * options.get("ep", 1)
    assert stages_of(mine_md, per_stage) == stages_of(real_md, per_stage)


@pytest.mark.parametrize("case", ["deepseek_tp2_ep2", "deepseek_pp2_ep2"])
def test_merging_the_split_gives_the_hf_input_bit_for_bit(case, splits, tmp_path):
    """The main model and the MTP layer (model.layers.3, with its copies of the embedding and the head)."""
    ckpttool.merge(splits(case), tmp_path / "back", config=fixture(case) / "config.json")
    got, want = load_output(tmp_path / "back"), load_file(fixture(case) / "reference" / "model.safetensors")
    assert sorted(got) == sorted(want) and any(name.startswith("model.layers.3.") for name in want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_common_pt_records_mla_the_moe_pattern_mtp_and_the_stages(splits):
    with torch.serialization.safe_globals([argparse.Namespace]):
        common = torch.load(splits("deepseek_pp2_ep2") / "iter_0000010" / "common.pt", weights_only=True)
    args = vars(common["args"])
    assert {k: args[k] for k in ("multi_latent_attention", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                                 "qk_pos_emb_head_dim", "v_head_dim", "moe_layer_freq", "moe_router_score_function",
                                 "moe_router_enable_expert_bias", "mtp_num_layers", "moe_shared_expert_intermediate_size",
                                 "pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                                 "decoder_last_pipeline_num_layers", "virtual_pipeline_model_parallel_size")} == {
        "multi_latent_attention": True, "q_lora_rank": None, "kv_lora_rank": 16, "qk_head_dim": 8,
        "qk_pos_emb_head_dim": 4, "v_head_dim": 8, "moe_layer_freq": [0, 1, 1], "moe_router_score_function": "sigmoid",
        "moe_router_enable_expert_bias": True, "mtp_num_layers": 1, "moe_shared_expert_intermediate_size": 16,
        "pipeline_model_parallel_size": 2, "decoder_first_pipeline_num_layers": 2,
        "decoder_last_pipeline_num_layers": None, "virtual_pipeline_model_parallel_size": None}


@pytest.fixture(scope="module")
def etp1(tmp_path_factory) -> Path:
    """The TP2 x EP2 DeepSeek reference split with expert TP 1 (the fixture was saved with expert TP 2)."""
    out = tmp_path_factory.mktemp("etp1") / "out"
    split("deepseek_tp2_ep2", out, etp=1)
    return out


def test_expert_tp_1_writes_every_expert_whole(etp1):
    """The same global tensors as megatron-core's expert-TP-2 save; each expert's fc1 and fc2 one whole chunk."""
    mine, mine_md = read_all(etp1 / "iter_0000010")
    real, _ = read_all(fixture("deepseek_tp2_ep2") / "torch_dist" / "iter_0000010")
    assert sorted(mine) == sorted(real)
    assert all(torch.equal(mine[n][:100], real[n][:100]) for n in real)
    chunks = mine_md.state_dict_metadata["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].chunks
    assert sorted((tuple(c.offsets), tuple(c.sizes)) for c in chunks) == [((e, 0, 0), (1, 32, 32)) for e in range(4)]
    with torch.serialization.safe_globals([argparse.Namespace]):
        args = vars(torch.load(etp1 / "iter_0000010" / "common.pt", weights_only=True)["args"])
    assert (args["tensor_model_parallel_size"], args["expert_tensor_parallel_size"]) == (2, 1)


def test_an_expert_tp_other_than_1_or_tp_is_refused(cli, tmp_path):
    case = fixture("deepseek_tp2_ep2")
    out = tmp_path / "out"
    result = cli("split", case / "reference", out, "--to", "megatron", "--tp", "2", "--etp", "4")
    assert_failed_cleanly(result, out, "etp=4: the expert tensor-parallel size is 1 (experts whole on every TP rank) "
                                       "or tp=2 (cut like the dense layers); ckpttool writes no other")


def test_a_source_without_its_mtp_layer_is_split_without_one(tmp_path):
    """A release saved by transformers (no MTP layer): no mtp.layers.*, mtp_num_layers unset; the merge back warns
    as for any source that lacks the MTP layers its config declares."""
    source = tmp_path / "no-mtp"
    source.mkdir()
    tensors = load_file(fixture("deepseek_tp2_ep2") / "reference" / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if not k.startswith("model.layers.3.")}, str(source / "model.safetensors"))
    split("deepseek_tp2_ep2", tmp_path / "out", source=source)
    metadata = FileSystemReader(tmp_path / "out" / "iter_0000010").read_metadata()
    assert not [k for k in metadata.state_dict_metadata if k.startswith("mtp.")]
    with torch.serialization.safe_globals([argparse.Namespace]):
        args = vars(torch.load(tmp_path / "out" / "iter_0000010" / "common.pt", weights_only=True)["args"])
    assert args["mtp_num_layers"] is None


def test_a_dry_run_shows_each_layer_on_its_stages_ranks():
    case = fixture("deepseek_pp2_ep2")
    result = ckpttool.split(case / "reference", None, to="megatron", config=case / "config.json", dry_run=True,
                            **LAYOUTS["deepseek_pp2_ep2"])
    placed = {s.name: s for s in result.tensors}
    mtp = placed["mtp.layers.0.transformer_layer.mlp.experts.experts.linear_fc1.weight"]
    assert mtp.describe() == "(Replicate(), Shard(0)) over pp=2 x ep=2 on ranks 2..3"
    assert [mtp.local_shape(r) for r in range(4)] == [(0, 0, 0), (0, 0, 0), (2, 32, 32), (2, 32, 32)]
    assert placed["decoder.layers.1.mlp.router.expert_bias"].ranks == (0, 2)  # layer 1: the first stage's 2 layers
    assert not result.files[0].nbytes == 0 and result.mesh.describe() == "pp=2 ep=2 pp_first=2 (4 ranks)"


FP8 = FIXTURES / "quantized_deepseek_v3_fp8" / "checkpoint"


def test_an_fp8_release_is_split_straight_to_bf16_as_its_bf16_merge(tmp_path):
    """Dequantized chunk by chunk while splitting (PP2 x EP3): merged back, it is the release merged with --dtype
    bfloat16, bit for bit; the expert bias stays FP32 and the config loses its quantization_config."""
    ckpttool.split(FP8, tmp_path / "out", to="megatron", pp=2, ep=3, dtype="bfloat16")
    metadata = FileSystemReader(tmp_path / "out" / "iter_0000000").read_metadata().state_dict_metadata
    assert metadata["decoder.layers.1.mlp.experts.experts.linear_fc1.weight"].properties.dtype == torch.bfloat16
    assert metadata["decoder.layers.1.mlp.router.expert_bias"].properties.dtype == torch.float32
    assert "quantization_config" not in json.loads((tmp_path / "out" / "config.json").read_text())
    ckpttool.merge(tmp_path / "out", tmp_path / "back")
    ckpttool.merge(FP8, tmp_path / "bf16", dtype="bfloat16")
    got, want = load_output(tmp_path / "back"), load_output(tmp_path / "bf16")
    assert sorted(got) == sorted(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_layer_stages_number_layers_as_megatron_core():
    assert layer_stages(4, MegatronMesh(pp=2))[:4] == [0, 0, 1, 1]
    assert layer_stages(5, MegatronMesh(pp=3, pp_first=1, pp_last=2))[:5] == [0, 1, 1, 2, 2]
    assert layer_stages(6, MegatronMesh(pp=3, pp_last=2))[:6] == [0, 0, 1, 1, 2, 2]
    assert layer_stages(8, MegatronMesh(pp=2, vpp=2))[:8] == [0, 0, 1, 1, 0, 0, 1, 1]
    assert layer_stages(3, MegatronMesh(pp=2, pp_first=2))[3] == 1  # an MTP layer: the last stage
    assert MegatronMesh(pp=2, pp_first=2, tp=2).describe() == "tp=2 pp=2 pp_first=2 (4 ranks)"


@pytest.mark.parametrize("options, message", [
    (["--pp", "2", "--pp-first", "3"], "3 (pp_first) leave 0 of the 3 layers (num_hidden_layers) for the 1 stage "
                                       "between, which does not share them evenly with at least one layer each"),
    (["--pp", "3", "--pp-first", "2", "--pp-last", "1"], "2 (pp_first) + 1 (pp_last) leave 0 of the 3 layers "
                                                         "(num_hidden_layers) for the 1 stage between"),
    (["--pp", "2", "--vpp", "2"], "pp=2 x vpp=2 does not split the 3 layers (num_hidden_layers) into 4 equal model "
                                  "chunks"),
    (["--pp", "2"], "pp=2 does not split the 3 layers (num_hidden_layers) into equal stages"),
    (["--tp", "8"], "tp=8 does not divide the 20 (dim 0) of "
                    "'decoder.layers.0.self_attention.linear_kv_down_proj.weight'"),
])
def test_layers_or_rows_that_do_not_fit_the_mesh_are_refused(options, message, cli, tmp_path):
    case = fixture("deepseek_pp2_ep2")
    out = tmp_path / "out"
    result = cli("split", case / "reference", out, "--to", "megatron", "--config", case / "config.json", *options)
    assert_failed_cleanly(result, out, message)


@pytest.mark.parametrize("options, message", [
    (["--pp", "2", "--vpp", "2", "--pp-first", "1"], "vpp=2 with pp_first/pp_last: virtual pipeline stages over "
                                                     "uneven stages are not written yet; give one or the other"),
    (["--pp-first", "1"], "pp_first=1, pp_last=0, vpp=1: uneven and virtual pipeline stages need pp above 1"),
])
def test_stage_options_that_contradict_are_refused_before_the_source_is_read(options, message, cli, tmp_path):
    case = fixture("pp2_uneven")
    out = tmp_path / "out"
    result = cli("split", case / "reference", out, "--to", "megatron", "--config", case / "config.json", *options)
    assert_failed_cleanly(result, out, message)


def test_stage_options_for_a_dcp_split_are_a_usage_error(cli, tmp_path):
    case = fixture("pp2_uneven")
    result = cli("split", case / "reference", tmp_path / "out", "--to", "dcp", "--vpp", "2")
    assert result.exit_code == 2, result.output
    assert "pp_first, pp_last and vpp are for to='megatron'" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------
# the real consumer: megatron-core loads the split strictly and runs its forward
# ------------------------------------------------------------------------------------------------

needs_megatron = pytest.mark.skipif(not (MEGATRON_VENV / "bin" / "python").is_file(),
                                    reason=f"megatron-core venv not at {MEGATRON_VENV} (set CKPTTOOL_MEGATRON_VENV)")


def consume(torchrun, script: str, case: str, checkpoint: Path, out: Path, ranks: int,
            *more: str) -> dict[str, torch.Tensor]:
    """``script`` on ``ranks`` gloo ranks (``torchrun``: conftest's ``megatron_torchrun``); the logits it wrote."""
    done = torchrun(HERE / script, case, checkpoint, out, *more, nproc=ranks)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return load_file(out)


@needs_megatron
@pytest.mark.slow
@pytest.mark.parametrize("case", ["deepseek_tp2_ep2", "deepseek_pp2_ep2"])
def test_megatron_core_loads_the_deepseek_split_strictly_and_gives_its_logits(case, splits, megatron_torchrun, tmp_path):
    """At the split's own layout (TP2 x EP2 expert TP 2; PP2 uneven x EP2): main and MTP logits equal those the
    producer's forward gave (fp32 on CPU; the same kernels, other reduction orders)."""
    options = LAYOUTS[case]
    ranks = options.get("tp", 1) * options.get("pp", 1) * options.get("ep", 1)
    got = consume(megatron_torchrun, "megatron_deepseek_consumer.py", case, splits(case) / "iter_0000010", tmp_path / "l.safetensors",
                  ranks)
    want = load_file(fixture(case) / "logits.safetensors")
    vocab = json.loads((fixture(case) / "producer.json").read_text())["vocab"]
    for name in ("logits", "mtp_logits"):  # 3.0e-7 observed; the padding columns: zeros here, random there
        torch.testing.assert_close(got[name][..., :vocab], want[name][..., :vocab], rtol=0, atol=1e-5)


@needs_megatron
@pytest.mark.slow
def test_megatron_core_loads_an_expert_tp_1_split_strictly_and_gives_its_logits(etp1, megatron_torchrun, tmp_path):
    """megatron-core built with expert TP 1 at TP2 x EP2 (3.6e-7 observed)."""
    got = consume(megatron_torchrun, "megatron_deepseek_consumer.py", "deepseek_tp2_ep2", etp1 / "iter_0000010",
                  tmp_path / "l.safetensors", 4, "1")
    want = load_file(fixture("deepseek_tp2_ep2") / "logits.safetensors")
    for name in ("logits", "mtp_logits"):
        torch.testing.assert_close(got[name][..., :100], want[name][..., :100], rtol=0, atol=1e-5)


@needs_megatron
@pytest.mark.slow
@pytest.mark.parametrize("case", ["pp2_uneven", "pp2_vpp2"])
def test_megatron_core_loads_uneven_and_virtual_stages_strictly_and_gives_its_logits(case, splits, megatron_torchrun, tmp_path):
    got = consume(megatron_torchrun, "megatron_stages_consumer.py", case, splits(case) / "iter_0000010",
                  tmp_path / "l.safetensors", 2)
    want = load_file(fixture(case) / "logits.safetensors")["logits"]
    vocab = json.loads((fixture(case) / "producer.json").read_text())["vocab"]
    torch.testing.assert_close(got["logits"][..., :vocab], want[..., :vocab], rtol=0, atol=1e-5)
