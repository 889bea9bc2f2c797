"""Quantized releases that would lose weights silently: NaN or infinite scales a dequantizing merge would spread
over whole blocks (stopped as the scale rows stream by, naming the tensor and the block, before anything is
published), scale dtypes that contradict ``quantization_config``, and config sizes that would size allocations
(bounded before any)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import assert_failed_cleanly, load_output
from test_quantized import DEEPSEEK, GPT_OSS, QWEN3, checkpoint, rewrite

import ckpttool
from ckpttool.errors import ArgumentError, ConfigError, SourceError
from ckpttool.execute.reads import Reader
from ckpttool.execute.buffers import buffer_sizes, chunks, piece_uses
from ckpttool.execute.assembly import build
from ckpttool.quant.decode import Fp8Blocks
from ckpttool.quant.formats import MAX_FP8_BLOCK, read_quantization

Q = "model.layers.0.self_attn.q_proj.weight"  # Qwen3: [48, 40] in 8x8 blocks -> scales [6, 5]
GATE = "model.layers.0.mlp.gate_proj.weight"  # DeepSeek: [72, 40] in 16x16 blocks, edge blocks cropped -> [5, 3]
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"  # gpt-oss: blocks [3, 192, 2, 16], scales [3, 192, 2]


def _scale(name, change, dtype=None):
    """An edit of ``rewrite``: the tensor ``name`` changed in place (after a cast to ``dtype``)."""
    def edit(tensors, config):
        scale = tensors[name].clone() if dtype is None else tensors[name].to(dtype)
        change(scale)
        tensors[name] = scale

    return edit


def _merge(cli, src, out):
    return cli("merge", src, out, "--dtype", "bfloat16")


# ------------------------------------------------------------------------------------ non-finite scales


@pytest.mark.parametrize(("dtype", "value", "shown"), [
    (None, float("nan"), "NaN"),
    (None, float("inf"), "inf"),
    (torch.bfloat16, float("-inf"), "-inf"),
    (torch.float16, float("nan"), "NaN"),
])
def test_a_dequantizing_merge_stops_at_a_non_finite_fp8_scale_naming_tensor_and_block(tmp_path, cli, dtype, value,
                                                                                        shown):
    def bad(scale):
        scale[1, 2] = value  # rows 8..16, columns 16..24 of [48, 40]

    src = rewrite(checkpoint(QWEN3), tmp_path / "hf", _scale(Q + "_scale_inv", bad, dtype))
    result = _merge(cli, src, tmp_path / "out")
    assert_failed_cleanly(
        result, tmp_path / "out",
        f"Error: '{Q}': cannot dequantize row block 1, column block 2 (rows 8..16, columns 16..24): its scale "
        f"'{Q}_scale_inv'[1, 2] in 'model.safetensors' is {shown}, which would make every value of that block NaN or "
        "infinite. Quantize those blocks again from the original weights, or merge without a dtype to keep the "
        "checkpoint quantized; `ckpttool audit` lists every invalid scale",
    )


def test_a_cropped_edge_block_is_named_with_its_cropped_rows_and_the_count_of_bad_scales(tmp_path, cli):
    def bad(scale):
        scale[4, 2] = float("nan")  # rows 64..72, columns 32..40 of [72, 40]: the cropped corner
        scale[4, 0] = float("inf")

    src = rewrite(checkpoint(DEEPSEEK), tmp_path / "hf", _scale(GATE + "_scale_inv", bad))
    result = _merge(cli, src, tmp_path / "out")
    assert_failed_cleanly(
        result, tmp_path / "out",
        f"'{GATE}': cannot dequantize row block 4, column block 0 (rows 64..72, columns 0..16): its scale "
        f"'{GATE}_scale_inv'[4, 0] in 'model.safetensors' is inf (2 such scales in its rows 0..5)",
    )


def test_the_file_named_is_the_shard_that_holds_the_bad_scale(tmp_path, cli):
    from safetensors.torch import load_file, save_file

    ckpttool.merge(checkpoint(QWEN3), tmp_path / "sharded", max_shard_size="20KB")  # kept quantized, several files
    index = json.loads((tmp_path / "sharded" / "model.safetensors.index.json").read_text())["weight_map"]
    shard = index[Q + "_scale_inv"]
    assert len(set(index.values())) > 1
    tensors = load_file(tmp_path / "sharded" / shard)
    tensors[Q + "_scale_inv"][2, 3] = float("nan")
    save_file(tensors, tmp_path / "sharded" / shard, metadata={"format": "pt"})
    result = _merge(cli, tmp_path / "sharded", tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"'{Q}': cannot dequantize row block 2, column block 3 (rows "
                          f"16..24, columns 24..32): its scale '{Q}_scale_inv'[2, 3] in '{shard}' is NaN")


def test_an_e8m0_nan_byte_among_fp8_ue8m0_scales_stops_the_merge(tmp_path, cli):
    """FP8 with ``scale_fmt: ue8m0`` may store its scales as bytes (``U8``, value ``2 ** (byte - 127)``): 0xFF is
    E8M0's NaN."""
    def as_bytes(tensors, config):
        config["quantization_config"]["scale_fmt"] = "ue8m0"
        for name in [n for n in tensors if n.endswith("_scale_inv")]:
            tensors[name] = torch.full(tensors[name].shape, 127, dtype=torch.uint8)
        tensors[Q + "_scale_inv"][5, 4] = 0xFF

    src = rewrite(checkpoint(QWEN3), tmp_path / "hf", as_bytes)
    result = _merge(cli, src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out",
                          f"'{Q}': cannot dequantize row block 5, column block 4 (rows 40..48, columns 32..40): its "
                          f"scale '{Q}_scale_inv'[5, 4] in 'model.safetensors' is 0xFF (E8M0's NaN), which would")
    kept = cli("merge", src, tmp_path / "kept")  # kept quantized: the bytes travel as they are (the audit names them)
    assert kept.exit_code == 0, kept.output


def test_an_mxfp4_nan_byte_stops_the_merge_naming_expert_row_and_group(tmp_path, cli):
    src = rewrite(checkpoint(GPT_OSS), tmp_path / "hf", _scale(EXPERTS + "_scales", lambda s: s[2, 7, 1].fill_(0xFF)))
    result = _merge(cli, src, tmp_path / "out")
    assert_failed_cleanly(
        result, tmp_path / "out",
        f"Error: '{EXPERTS}': cannot dequantize expert 2, row 7, group 1 (the 32 values [2, 32:64, 7] of the "
        f"dequantized tensor): its scale '{EXPERTS}_scales'[2, 7, 1] in 'model.safetensors' is 0xFF (E8M0's NaN), "
        "which would make every value of that block NaN or infinite",
    )
    with pytest.raises(SourceError, match=r"cannot dequantize expert 2, row 7, group 1"):
        ckpttool.merge(src, tmp_path / "api", dtype="float32")
    assert not (tmp_path / "api").exists()


def test_the_scale_rows_are_checked_chunk_by_chunk_with_the_blocks_global_index(tmp_path):
    """Chunks of 3 rows of the [72, 40] weight read scale rows k // 16: the chunks before the NaN's block row are
    built, the first one reading it stops, naming block row 3 (not the chunk's first scale row); the audit's reads
    (``check_scales=False``) count the NaN values instead."""
    src = rewrite(checkpoint(DEEPSEEK), tmp_path / "hf", _scale(GATE + "_scale_inv", lambda s: s[3, 1].fill_(float("nan"))))
    plan = ckpttool.prepare(src, dtype="bfloat16").plan
    target = next(t for t in plan.targets if t.name == GATE)
    small = chunks(target, 0, rows=3)
    reader = Reader(plan.root, piece_uses(small), buffer_sizes(small))
    built = 0
    try:
        with pytest.raises(SourceError) as e:
            for chunk in small:
                build(chunk, reader)
                built += 1
        assert built == 16  # rows 0..48: block rows 0..2
        assert str(e.value).startswith(f"'{GATE}': cannot dequantize row block 3, column block 1 (rows 48..64, columns "
                                       f"16..32): its scale '{GATE}_scale_inv'[3, 1] in 'model.safetensors' is NaN")
        values = torch.cat([build(chunk, reader, check_scales=False).float() for chunk in small])
    finally:
        reader.close()
    assert int(values.isnan().sum()) == 16 * 16 and values[48:64, 16:32].isnan().all()


@pytest.mark.parametrize(("fixture", "name", "change", "message", "first"), [
    (QWEN3, Q + "_scale_inv", lambda s: s[1, 2].fill_(float("nan")),
     f"'{Q}_scale_inv': 1 NaN of its 30 scales: every value of those blocks dequantizes to NaN",
     "(the first is [1, 2]: row block 1, column block 2)"),
    (QWEN3, Q + "_scale_inv", lambda s: s.zero_(), f"'{Q}_scale_inv': 30 zero of its 30 scales",
     "(the first is [0, 0]: row block 0, column block 0)"),
    (GPT_OSS, EXPERTS + "_scales", lambda s: s[2, 7, 1].fill_(0xFF), f"'{EXPERTS}_scales': 1 NaN of its 1152 scales",
     "(the first is [2, 7, 1]: expert 2, row 7, group 1)"),
])
def test_an_audit_without_data_reads_the_scales_and_reports_invalid_ones(tmp_path, cli, fixture, name, change, message,
                                                                          first):
    src = rewrite(checkpoint(fixture), tmp_path / "hf", _scale(name, change))
    report = ckpttool.audit(src, data=False)
    found = [f for f in report.findings if f.code == "quant-scale-invalid"]
    assert [f.tensor for f in found] == [name] and found[0].severity == "error"
    assert found[0].message.startswith(message) and found[0].message.endswith(f"original weights {first}")
    assert [f.message for f in ckpttool.audit(src).findings if f.code == "quant-scale-invalid"] == [found[0].message]
    result = cli("audit", src, "--no-data", "--json")
    assert result.exit_code == 3, result.output
    assert "quant-scale-invalid" in {f["code"] for f in json.loads(result.stdout)["findings"]}
    assert cli("audit", checkpoint(fixture), "--no-data").exit_code == 0  # sound scales: nothing to report


def test_half_precision_scales_are_judged_by_their_bits_without_data(tmp_path):
    def halves(tensors, config):
        for name in [n for n in tensors if n.endswith("_scale_inv")]:
            tensors[name] = tensors[name].to(torch.bfloat16 if "q_proj" in name else torch.float16)
        tensors[Q + "_scale_inv"][0, 0] = -1.0
        tensors["model.layers.1.self_attn.k_proj.weight_scale_inv"][0, 0] = float("inf")

    report = ckpttool.audit(rewrite(checkpoint(QWEN3), tmp_path / "hf", halves), data=False)
    found = {f.tensor: f.message for f in report.findings if f.code == "quant-scale-invalid"}
    assert found[Q + "_scale_inv"].startswith(f"'{Q}_scale_inv': 1 negative of its 30 scales")
    assert found["model.layers.1.self_attn.k_proj.weight_scale_inv"].startswith(
        "'model.layers.1.self_attn.k_proj.weight_scale_inv': 1 infinite of its 15 scales")
    assert len(found) == 2


# ------------------------------------------------------------------------- scale dtypes against the config


def test_an_fp8_scale_of_an_integer_dtype_is_refused_naming_tensor_and_config_keys(tmp_path, cli):
    src = rewrite(checkpoint(QWEN3), tmp_path / "hf", _scale(Q + "_scale_inv", lambda s: None, torch.int8))
    result = _merge(cli, src, tmp_path / "out")
    assert_failed_cleanly(
        result, tmp_path / "out",
        f"'{Q}_scale_inv' is I8; FP8 scales are F32, BF16, F16 or F8_E8M0 (U8 only as E8M0 bytes, with scale_fmt "
        f"\"ue8m0\"; '{src / 'config.json'}' says 'float'): a scale of dtype I8 contradicts quantization_config.quant_method "
        f"'fp8' with quantization_config.scale_fmt 'float' in '{src / 'config.json'}'",
    )
    codes = {f.code: f.tensor for f in ckpttool.audit(src, data=False).findings}
    assert codes["quant-scale-dtype"] == Q + "_scale_inv"


@pytest.mark.parametrize("dtype", [torch.int8, torch.float32, torch.float8_e8m0fnu])
def test_mxfp4_scales_that_are_not_bytes_are_refused_naming_tensor_and_config_key(tmp_path, cli, dtype):
    """transformers' gpt-oss loader reads the scales as exponent bytes: any other dtype would be read as values."""
    def cast(tensors, config):
        scales = tensors[EXPERTS + "_scales"]
        tensors[EXPERTS + "_scales"] = (scales.view(dtype) if dtype.itemsize == 1 else scales.to(dtype))

    src = rewrite(checkpoint(GPT_OSS), tmp_path / "hf", cast)
    for args in (("--dtype", "bfloat16"), ()):  # dequantized or kept: refused either way
        result = cli("merge", src, tmp_path / "out", *args)
        assert_failed_cleanly(
            result, tmp_path / "out",
            f"'{EXPERTS}_blocks' is U8 and '{EXPERTS}_scales' is ",
            "MXFP4 blocks and scales are both U8 (scales: E8M0 exponent bytes): it contradicts "
            f"quantization_config.quant_method 'mxfp4' in '{src / 'config.json'}'",
        )
    found = [f for f in ckpttool.audit(src, data=False).findings if f.code == "quant-scale-dtype"]
    assert [f.tensor for f in found] == [EXPERTS + "_scales"]


# --------------------------------------------------------------------------------- sizes from the config


def _huge_blocks(tensors, config):
    """A block of 2**40 rows and columns: every scale [1, 1] then has the shape the block size gives it."""
    config["quantization_config"]["weight_block_size"] = [2**40, 2**40]
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        tensors[name] = tensors[name][:1, :1].clone()


def test_a_block_size_past_the_bound_is_refused_before_any_allocation(tmp_path, cli):
    """It once asked for 4 TiB (one scale row spread over 2**40 columns)."""
    src = rewrite(checkpoint(QWEN3), tmp_path / "hf", _huge_blocks)
    expected = (f"Error: '{src / 'config.json'}': quantization_config.weight_block_size is [1099511627776, "
                f"1099511627776]; each block size must be at most {MAX_FP8_BLOCK} rows or columns (ckpttool's bound; "
                "FP8 releases use [128, 128]). Is the config damaged?")
    for args in (("--dtype", "bfloat16"), (), ("--dry-run",)):
        assert_failed_cleanly(cli("merge", src, tmp_path / "out", *args), tmp_path / "out", expected)
    for args in ((), ("--no-data",)):
        result = cli("audit", src, *args)
        assert result.exit_code == 1 and "Traceback" not in result.output and expected in result.stderr


@pytest.mark.parametrize(("block", "ok"), [([MAX_FP8_BLOCK, 1], True), ([128, MAX_FP8_BLOCK + 1], False),
                                           ([2**62, 128], False)])
def test_the_bound_of_a_block_size(block, ok):
    config = {"quantization_config": {"quant_method": "fp8", "weight_block_size": block}}
    if ok:
        assert read_quantization(config).block == tuple(block)
    else:
        with pytest.raises(ConfigError, match=rf"weight_block_size is \[{block[0]}, {block[1]}\]; each block size "
                                              rf"must be at most {MAX_FP8_BLOCK}"):
            read_quantization(config)


def test_a_decoder_spreads_a_wide_block_over_the_weights_columns_only():
    """However wide its block, a decoder's temporaries are sized by the weight (a plan made elsewhere, a block
    within the bound but wider than the weight): the values of one scale per block, as with the weight's width."""
    stored = torch.randn(48, 40).to(torch.float8_e4m3fn)
    scales = torch.tensor([[0.5]])

    def scratch(name, shape, dtype):
        from ckpttool.io.dtypes import torch_dtype

        assert 0 < len(shape) and max(shape) <= 48 * 40, (name, shape)
        return torch.empty(shape, dtype=torch_dtype(dtype))

    out = torch.empty(48, 40)
    Fp8Blocks((2**40, 2**40)).decode(stored, scales, 0, out, scratch)
    assert torch.equal(out, stored.float() * 0.5)


def test_a_quantizing_merge_refuses_a_block_its_own_output_could_not_be_read_with(tmp_path):
    with pytest.raises(ArgumentError, match=rf"block=1048576: the FP8 block size is at most {MAX_FP8_BLOCK}"):
        ckpttool.merge(checkpoint(QWEN3), tmp_path / "out", quantize="fp8", block=2**20)
    assert not (tmp_path / "out").exists()


def test_sound_releases_still_dequantize(tmp_path):
    for fixture in (QWEN3, DEEPSEEK, GPT_OSS):
        result = ckpttool.merge(checkpoint(fixture), tmp_path / fixture, dtype="bfloat16")
        assert result.audit.ok
        assert all(torch.isfinite(t.float()).all() for t in load_output(tmp_path / fixture).values())


def test_a_stacked_fp8_weights_bad_scale_is_named_by_expert_and_block():
    """A stacked [E, O, I] weight's chunks are experts: the index is the expert's, the block within its matrix."""
    scales = torch.ones(2, 3, 5)
    scales[1, 2, 4] = float("inf")
    decoder = Fp8Blocks((8, 8), ndim=3)
    assert decoder.bad_scale(scales[:1], 0, (2, 20, 40)) is None
    bad = decoder.bad_scale(scales[1:], 1, (2, 20, 40))
    assert (bad.index, bad.value, bad.count) == ((1, 2, 4), "inf", 1)
    assert bad.block == "expert 1, row block 2, column block 4 (rows 16..20, columns 32..40)"


def test_scales_of_an_integer_dtype_never_reach_the_arithmetic():
    """The plan refuses them (quant-scale-dtype); a decoder given them anyway says so rather than use them."""
    with pytest.raises(ValueError, match="scales of dtype torch.int8 are not a scale format a decoder reads"):
        Fp8Blocks((8, 8)).bad_scale(torch.ones(2, 2, dtype=torch.int8), 0, (16, 16))
