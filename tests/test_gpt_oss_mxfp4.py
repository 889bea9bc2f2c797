"""gpt-oss to the MXFP4 release layout (issue 29): the encoder against its reference, ``merge --quantize mxfp4``
(the experts' ``_blocks``/``_scales``, the release's ``quantization_config``), and ``split --to dcp --ep``.

Oracle of the encoder: triton_kernels' ``downcast_to_mxfp_torch`` (what transformers' ``quantize_to_mxfp4``
calls), whose bytes ``fixtures/make_mxfp4_oracle.py`` recorded in ``fixtures/mxfp4_encode_oracle``; the release
layout's decoder is transformers' ``convert_moe_packed_tensors``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, load_output
from safetensors.torch import load_file

from ckpttool.quant.encode import mxfp4_encode

ORACLE = FIXTURES / "mxfp4_encode_oracle" / "tensors.safetensors"
RELEASE = FIXTURES / "quantized_gpt_oss_mxfp4" / "checkpoint"
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "I32": torch.int32, "U8": torch.uint8}


def scratch(name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    return torch.empty(shape, dtype=_DTYPES[dtype])


def encode(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Named ``[E, A, B]`` -> blocks ``[E, B, A/32, 16]`` and scales ``[E, B, A/32]``."""
    experts, cols, rows = x.shape
    blocks = torch.empty(experts, rows, cols // 32, 16, dtype=torch.uint8)
    scales = torch.empty(experts, rows, cols // 32, dtype=torch.uint8)
    mxfp4_encode(x, blocks, scales, scratch)
    return blocks, scales


def decode(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    return convert_moe_packed_tensors(blocks, scales, dtype=dtype)


def test_the_encoder_gives_the_reference_encoders_bytes():
    """Random values at five scales (1e-30 included), E2M1's ties and saturation, signed zeros, an all-zero group."""
    recorded = load_file(ORACLE)
    names = [n for n in recorded if not n.endswith(("_blocks", "_scales"))]
    assert len(names) == 7
    for name in names:
        blocks, scales = encode(recorded[name])
        assert torch.equal(blocks, recorded[name + "_blocks"]), name
        assert torch.equal(scales, recorded[name + "_scales"]), name


def test_values_on_the_grid_encode_to_themselves():
    g = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 24, 4, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 140, (3, 24, 4), dtype=torch.uint8, generator=g)
    values = decode(blocks, scales, torch.float32)
    again_blocks, again_scales = encode(values)
    assert torch.equal(decode(again_blocks, again_scales, torch.float32), values)


def test_a_release_decoded_and_encoded_again_gives_its_bytes():
    stored = load_output(RELEASE)
    names = [n.removesuffix("_blocks") for n in stored if n.endswith("_blocks")]
    assert len(names) == 4
    for name in names:
        blocks, scales = encode(decode(stored[name + "_blocks"], stored[name + "_scales"]))
        assert torch.equal(blocks, stored[name + "_blocks"]), name
        assert torch.equal(scales, stored[name + "_scales"]), name


def test_the_round_trip_is_measured_against_the_values_encoded():
    x = torch.tensor([[7.0] + [0.0] * 31]).reshape(1, 32, 1)
    blocks, scales = torch.empty(1, 1, 1, 16, dtype=torch.uint8), torch.empty(1, 1, 1, dtype=torch.uint8)
    trip = mxfp4_encode(x, blocks, scales, scratch)
    # 7/6 rounds up to the scale 2 (byte 128); 7/2 = 3.5 is a tie that goes to the even code, 4: read back as 8
    assert int(scales) == 128 and int(blocks[0, 0, 0, 0]) == 0x06
    assert trip is not None and trip.max_abs_error == 1.0 and math.isclose(trip.relative_error, 1 / 7)


# ------------------------------------------------------------------------------------------------
# merge --quantize mxfp4: the release layout
# ------------------------------------------------------------------------------------------------
DCP = FIXTURES / "gpt_oss_fsdp2_dcp"
MEGATRON = FIXTURES / "megatron_gpt_oss_tp2_ep2"
EXPERTS = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2) for p in ("gate_up_proj", "down_proj")]
TOKENS = [[5, 17, 199, 3, 250, 42, 7, 100, 11, 128, 64, 2]]


@pytest.fixture(scope="module")
def quantized(tmp_path_factory):
    """Each source merged once through the CLI with --quantize mxfp4 (the source checked unchanged)."""
    from click.testing import CliRunner
    from conftest import tree_digest

    from ckpttool.cli import main

    done: dict[Path, Path] = {}

    def get(src: Path, *options: str) -> Path:
        if src not in done:
            out = tmp_path_factory.mktemp(src.parent.name) / "out"
            before = tree_digest(src)
            result = CliRunner().invoke(main, ["merge", str(src), str(out), "--quantize", "mxfp4", *options])
            assert result.exit_code == 0, result.output
            assert "mxfp4:    4 weights quantized" in result.output
            assert tree_digest(src) == before
            done[src] = out
        return done[src]

    return get


def on_the_grid(reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``reference`` in bfloat16 (router bias as ckpttool keeps it), each expert tensor put on the MXFP4 grid:
    encoded, then decoded by transformers' own loader."""
    from ckpttool.families import keeps_dtype

    out = {n: t if keeps_dtype(n) else t.to(torch.bfloat16) for n, t in reference.items()}
    for name in EXPERTS:
        out[name] = decode(*encode(out[name]))
    return out


def logits_of(directory: Path) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """transformers' logits (float32) and weights after a load with no missing or unexpected key."""
    from transformers import GptOssForCausalLM

    model, info = GptOssForCausalLM.from_pretrained(str(directory), output_loading_info=True, dtype=torch.float32)
    for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"):
        assert not info.get(key), (key, info[key])
    with torch.no_grad():
        return model.eval()(torch.tensor(TOKENS)).logits, {k: v.clone() for k, v in model.state_dict().items()}


def test_the_release_layout_is_written(quantized):
    out = quantized(DCP / "checkpoint")
    written = load_output(out)
    release = load_output(RELEASE)
    for name in EXPERTS:  # the release's names, dtypes and [E, out, in/32, 16] shapes
        blocks, scales = written.pop(name + "_blocks"), written.pop(name + "_scales")
        assert blocks.dtype == scales.dtype == torch.uint8
        assert blocks.shape[:-1] == scales.shape and blocks.shape[-1] == 16
    assert {t.dtype for n, t in written.items() if "router.bias" not in n} == {torch.bfloat16}
    assert sorted(n for n in release if n.endswith(("_blocks", "_scales"))) == sorted(
        n for n in load_output(out) if n.endswith(("_blocks", "_scales")))
    config = json.loads((out / "config.json").read_text())
    assert config["quantization_config"] == json.loads((RELEASE / "config.json").read_text())["quantization_config"]
    summary = json.loads((out / "ckpttool-audit.json").read_text())["summary"]
    assert (summary["verdict"], summary["errors"], summary["warnings"]) == ("pass", 0, 0), summary


def test_the_experts_are_the_encoders_bytes(quantized):
    written = load_output(quantized(DCP / "checkpoint"))
    reference = load_output(DCP / "reference")
    for name in EXPERTS:
        blocks, scales = encode(reference[name])
        assert torch.equal(written[name + "_blocks"], blocks), name
        assert torch.equal(written[name + "_scales"], scales), name


def test_transformers_loads_it_with_the_logits_of_the_bf16_merge_put_on_the_grid(quantized, tmp_path):
    """transformers dequantizes the MXFP4 experts on load on CPU: the same weights and logits as a plain bfloat16
    checkpoint of the reference with its experts put on the grid."""
    from safetensors.torch import save_file

    reference = tmp_path / "on-grid"
    reference.mkdir()
    config = json.loads((DCP / "reference" / "config.json").read_text())
    (reference / "config.json").write_text(json.dumps({**config, "dtype": "bfloat16"}))
    save_file(on_the_grid(load_output(DCP / "reference")), reference / "model.safetensors", metadata={"format": "pt"})
    expected, expected_state = logits_of(reference)
    logits, state = logits_of(quantized(DCP / "checkpoint"))
    assert sorted(state) == sorted(expected_state)
    for name, tensor in expected_state.items():
        assert torch.equal(state[name], tensor), name
    assert torch.equal(logits, expected)


def test_merged_back_to_bf16_it_equals_the_decoded_experts_bit_for_bit(quantized, tmp_path):
    import ckpttool

    ckpttool.merge(quantized(DCP / "checkpoint"), tmp_path / "bf16", dtype="bfloat16")
    back = load_output(tmp_path / "bf16")
    expected = on_the_grid(load_output(DCP / "reference"))
    assert sorted(back) == sorted(expected)
    for name, tensor in expected.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_a_megatron_source_is_quantized_after_its_interleave_and_transpose(quantized):
    """fc1 ``[gate; up]`` per expert, interleaved and transposed chunk by chunk, then encoded: the bytes of the
    reference's experts encoded."""
    written = load_output(quantized(MEGATRON / "torch_dist", "--config", str(MEGATRON / "config.json")))
    reference = load_output(MEGATRON / "reference")
    for name in EXPERTS:
        blocks, scales = encode(reference[name])
        assert torch.equal(written[name + "_blocks"], blocks), name
        assert torch.equal(written[name + "_scales"], scales), name


def test_quantizing_after_a_transform_streams_expert_by_expert_within_the_predicted_buffers():
    """One expert a chunk: the pre rows gathered, interleaved and transposed, encoded; every per-thread buffer is
    allocated once at the size buffer_sizes predicts (what --dry-run's peak sums); the bytes are the reference
    executor's (whole tensors)."""
    from ckpttool.commands.merge import prepare
    from ckpttool.execute.reads import Reader
    from ckpttool.execute.buffers import buffer_sizes, chunks, piece_uses
    from ckpttool.execute.assembly import build
    from ckpttool.execute.reference import PieceLoader, assemble

    plan = prepare(MEGATRON / "torch_dist", config=MEGATRON / "config.json", dtype="bfloat16", quantize="mxfp4").plan
    computed = [t for t in plan.targets if t.dequant is not None]
    assert len(computed) == 8 and all(t.transform is not None for t in computed if "gate_up_proj" in t.name)
    small = [c for t in computed for c in chunks(t, 0, rows=1)]
    sizes = buffer_sizes(small)
    assert {"chunk", "transform", "work", "abs", "amax", "bf16", "mxfp4-temporaries"} <= set(sizes)
    reader, loader = Reader(plan.root, piece_uses(small), sizes), PieceLoader(plan.root)
    try:
        parts: dict[str, list[torch.Tensor]] = {t.name: [] for t in computed}
        for chunk in small:
            parts[chunk.target.name].append(build(chunk, reader).clone())
        allocated = {name: len(buffer) for name, buffer in reader._local.buffers.items()}
        for target in computed:
            assert len(parts[target.name]) == target.shape[0] == 4  # one chunk per expert
            assert torch.equal(torch.cat(parts[target.name]), assemble(target, loader)), target.name
    finally:
        reader.close()
    assert allocated == {name: max(n, 1) for name, n in sizes.items() if name in allocated}


def test_the_dry_run_names_the_transform_and_counts_the_encoder_in_its_peak():
    import ckpttool

    config = str(MEGATRON / "config.json")
    plain = ckpttool.merge(MEGATRON / "torch_dist", config=config, dry_run=True, dtype="bfloat16").to_json()
    doc = ckpttool.merge(MEGATRON / "torch_dist", config=config, dry_run=True, quantize="mxfp4").to_json()
    names = {t["name"]: t for t in doc["targets"]}
    blocks = names["model.layers.0.mlp.experts.gate_up_proj_blocks"]
    assert blocks["dtype"] == "U8" and blocks["shape"] == [4, 64, 2, 16] and "interleave" in blocks["transform"]
    assert "model.layers.0.mlp.experts.gate_up_proj" not in names
    assert doc["predicted_peak_bytes"] > plain["predicted_peak_bytes"]  # the encoder's float32 work buffers


@pytest.mark.parametrize("options, code, message", [
    (["--quantize", "mxfp4", "--block", "128"], 2, "MXFP4 scales groups of 32 values"),
    (["--quantize", "fp8", "--dtype", "bfloat16"], 2, "--quantize and --dtype are exclusive"),
], ids=["block", "fp8-dtype"])
def test_usage_errors(cli, tmp_path, options, code, message):
    result = cli("merge", DCP / "checkpoint", tmp_path / "out", *options)
    assert result.exit_code == code and message in result.output
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("source, message", [
    (FIXTURES / "llama_fsdp2_dcp" / "checkpoint", "quantize='mxfp4' writes gpt-oss's MXFP4 release layout (its "
     "experts' _blocks and _scales); '{src}' is a 'llama' model, whose MXFP4 layout transformers does not load. "
     "Use --quantize fp8"),
    (RELEASE, "quantize='mxfp4': '{src}' is quantized already (mxfp4 (groups of 32 values, E8M0 scales)); "
     "quantizing quantized values again would compound their rounding"),
], ids=["not-gpt-oss", "quantized-already"])
def test_what_cannot_be_quantized_to_mxfp4_is_refused_and_nothing_written(cli, tmp_path, source, message):
    from conftest import tree_digest

    before = tree_digest(source)
    result = cli("merge", source, tmp_path / "out", "--quantize", "mxfp4")
    assert result.exit_code == 1 and "Traceback" not in result.output
    assert message.format(src=source) in " ".join(result.output.split())
    assert not (tmp_path / "out").exists() and tree_digest(source) == before


# ------------------------------------------------------------------------------------------------
# split --to dcp --ep: gpt-oss's experts, stacked on disk, sharded on dim 0 as transformers' EP plan does
# ------------------------------------------------------------------------------------------------
EP_FIXTURE = FIXTURES / "gpt_oss_hf_ep2" / "checkpoint"
STACKED = [f"model.layers.{i}.mlp.experts.{p}" for i in range(2)
           for p in ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")]


def transformers_ep_boxes() -> dict[str, list[tuple[int, list[int], list[int]]]]:
    """Per expert tensor, each rank's (rank, offsets, sizes) as transformers' distributed save recorded them."""
    import struct

    found: dict[str, list[tuple[int, list[int], list[int]]]] = {}
    for rank, path in enumerate(sorted(EP_FIXTURE.glob("shard-*.safetensors"))):
        with open(path, "rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        info = json.loads(header["__metadata__"]["DCP_SHARDING_INFO"])
        for name in STACKED:
            found.setdefault(name, []).append((rank, info[name]["saved_offsets"], header[name]["shape"]))
    return found


def dcp_boxes(directory: Path) -> dict[str, list[tuple[int, list[int], list[int]]]]:
    """Per expert tensor, each chunk's (rank of its file, offsets, sizes) in a DCP checkpoint."""
    from torch.distributed.checkpoint import FileSystemReader

    metadata = FileSystemReader(str(directory)).read_metadata()
    found: dict[str, list[tuple[int, list[int], list[int]]]] = {}
    for index, storage in metadata.storage_data.items():
        if index.fqn in STACKED:
            rank = int(storage.relative_path.removeprefix("__").split("_")[0])
            found.setdefault(index.fqn, []).append((rank, list(index.offset), list(metadata.state_dict_metadata[
                index.fqn].chunks[index.index].sizes)))
    return {name: sorted(boxes) for name, boxes in found.items()}


@pytest.mark.parametrize("mesh", [dict(fsdp=2, ep=2), dict(tp=2, ep=2)], ids=["fsdp2-ep2", "tp2-ep2"])
def test_split_ep_places_the_experts_as_transformers_ep_plan_and_merges_back_bit_for_bit(mesh, tmp_path):
    import ckpttool

    source = DCP / "reference"
    ckpttool.split(source, tmp_path / "dcp", **mesh)
    assert dcp_boxes(tmp_path / "dcp") == transformers_ep_boxes()  # experts 0-1 on rank 0, 2-3 on rank 1
    ckpttool.merge(tmp_path / "dcp", tmp_path / "hf")
    back, reference = load_output(tmp_path / "hf"), load_output(source)
    assert sorted(back) == sorted(reference)
    for name, tensor in reference.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), name


def test_split_ep_that_does_not_divide_the_experts_is_refused(cli, tmp_path):
    source = DCP / "reference"
    result = cli("split", source, tmp_path / "dcp", "--to", "dcp", "--fsdp", "3", "--ep", "3")
    assert result.exit_code == 1 and "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert ("'model.layers.0.mlp.experts.gate_up_proj': its 4 experts (dim 0) cannot be split evenly over ep=3 "
            "ranks; choose an ep that divides 4") in text
    assert "no stacked expert tensors" not in text
    assert not (tmp_path / "dcp").exists()


def test_fp8_after_a_row_permutation_equals_fp8_of_the_merged_output(tmp_path):
    """An encoder after a transform is not gpt-oss's alone: torchtitan's q/k rows (Meta's RoPE order, a dim-0
    permutation per head) quantized to FP8 in 8-row blocks give the bytes of the plain merge quantized, chunks
    aligned to whole blocks of both."""
    import ckpttool

    fixture = FIXTURES / "torchtitan_llama3_fsdp2"
    config = fixture / "reference" / "config.json"
    ckpttool.merge(fixture / "checkpoint", tmp_path / "plain", config=config)
    ckpttool.merge(tmp_path / "plain", tmp_path / "then-fp8", quantize="fp8", block=8)
    result = ckpttool.merge(fixture / "checkpoint", tmp_path / "fp8", config=config, quantize="fp8", block=8)
    assert any(t.transform is not None and t.dequant is not None for t in result.plan.targets)
    direct, after = load_output(tmp_path / "fp8"), load_output(tmp_path / "then-fp8")
    assert sorted(direct) == sorted(after)
    for name, tensor in after.items():
        assert torch.equal(direct[name].view(torch.uint8), tensor.view(torch.uint8)), name
