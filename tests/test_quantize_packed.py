"""``merge --quantize int4`` / ``int4-asym``: BF16 weights packed as compressed-tensors ``pack-quantized`` INT4,
bit for bit what compressed-tensors' own observer and compressor write (the oracle: fixtures/int4_encode_oracle,
made by fixtures/make_int4_oracle.py in compressed-tensors 0.20), streamed in row chunks within the predicted
buffers, with the release's layout and config; refusals with their message, exit code and nothing written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers  # imported first, as in the whole suite: each architecture is described in this process
from conftest import build_in_row_chunks, FIXTURES, assert_failed_cleanly, load_output
from safetensors.torch import load_file

import ckpttool
from ckpttool.errors import ArgumentError
from ckpttool.io.dtypes import torch_dtype
from ckpttool.families.quantize_packed import PackScheme
from ckpttool.quant.codecs import codec
from ckpttool.quant.pack_encode import INT_PACKED, INT_SCALES, INT_ZERO_POINTS, NVFP4_PART, WEIGHT_SHAPE

ORACLE = FIXTURES / "int4_encode_oracle" / "tensors.safetensors"
RELEASE = FIXTURES / "quantized_qwen3_int4" / "checkpoint"
NVFP4_RELEASE = FIXTURES / "quantized_qwen3_nvfp4" / "checkpoint"
#: the oracle's schemes: (group, symmetric)
SCHEMES = {"g32": (32, True), "g128": (128, True), "asym_g32": (32, False), "channel": (0, True)}


@pytest.fixture(scope="module")
def oracle() -> dict[str, torch.Tensor]:
    return load_file(ORACLE)


def _scratch(name, shape, dtype):
    return torch.empty(shape, dtype=torch_dtype(dtype))


def _encode(method: str, params: tuple, w: torch.Tensor, shape: tuple[int, ...], dtype: torch.dtype, step: int):
    """The target ``method`` computes from ``w``, in chunks of ``step`` target rows, as the executor calls it."""
    compute = codec(method, params)
    out = torch.empty(shape, dtype=dtype)
    for start in range(0, shape[0], step):
        stop = min(start + step, shape[0])
        a, b = compute.stored_rows(start, stop)
        compute.decode(w[a:b], None, start, out[start:stop], _scratch)
    return out


@pytest.mark.parametrize("scheme", sorted(SCHEMES))
def test_int4_encoders_are_bit_exact_with_compressed_tensors_in_row_chunks(oracle, scheme):
    """Every input (random at four scales, all-positive rows, rounding ties, clamps, signed zeros, a zero row):
    packed values, scales, zero points and weight_shape equal compressed-tensors' own, chunk by chunk (5 rows;
    zero points one packed row, 8 source rows, at a time)."""
    group, symmetric = SCHEMES[scheme]
    names = [k for k in oracle if "." not in k.removeprefix("random.")]
    assert len(names) == 6
    for name in names:
        w, want = oracle[name], {k.rsplit(".", 1)[-1]: v for k, v in oracle.items() if k.startswith(f"{name}.{scheme}.")}
        common = (("bits", 4), ("group", group))
        values = (*common, ("symmetric", symmetric))
        got = {"weight_packed": _encode(INT_PACKED, values, w, want["weight_packed"].shape, torch.int32, 5),
               "weight_scale": _encode(INT_SCALES, values, w, want["weight_scale"].shape, torch.bfloat16, 5),
               "weight_shape": _encode(WEIGHT_SHAPE, (("shape", tuple(w.shape)),), w, (2,), torch.int64, 2)}
        if not symmetric:
            got["weight_zero_point"] = _encode(INT_ZERO_POINTS, (*common, ("rows", w.shape[0])), w,
                                               want["weight_zero_point"].shape, torch.int32, 1)
        assert sorted(got) == sorted(want), name
        for key, tensor in want.items():
            assert torch.equal(got[key], tensor), (name, scheme, key)


def test_nvfp4_encoder_is_bit_exact_with_compressed_tensors(oracle):
    """Global scale, E4M3 scales and packed E2M1 codes equal compressed-tensors' own for every input (a ``-0``
    written as code 0, a negative value rounded to zero as code 8, as its compressor does)."""
    names = [k for k in oracle if "." not in k.removeprefix("random.")]
    for name in names:
        w, rows = oracle[name], oracle[name].shape[0]
        for part, suffix, dtype in (("packed", "weight_packed", torch.uint8),
                                    ("scales", "weight_scale", torch.float8_e4m3fn),
                                    ("global", "weight_global_scale", torch.float32)):
            want = oracle[f"{name}.nvfp4.{suffix}"]
            got = _encode(NVFP4_PART, (("part", part), ("rows", rows)), w, want.shape, dtype, want.shape[0])
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (name, part)


def test_a_float32_source_is_rounded_to_bfloat16_first(oracle):
    """The encoder rounds a float32 source to bfloat16 (the release's dtype) before it observes and packs."""
    w = oracle["random.1"]
    params = (("bits", 4), ("group", 32), ("symmetric", True))
    wide = w.float() + torch.finfo(torch.bfloat16).eps * w.float() / 8  # rounds back to w
    assert torch.equal(_encode(INT_PACKED, params, wide, (24, 32), torch.int32, 24),
                       oracle["random.1.g32.weight_packed"])


# ---------------------------------------------------------------------------------------------- merge


@pytest.fixture(scope="module")
def packed(tmp_path_factory) -> dict[str, Path]:
    """The INT4 release dequantized to BF16 by ckpttool, then packed again symmetric (g32) and asymmetric (g16)."""
    root = tmp_path_factory.mktemp("packed")
    ckpttool.merge(RELEASE, root / "bf16", dtype="bfloat16", audit=False)
    out = {"bf16": root / "bf16"}
    out["int4"] = root / "int4"
    out["result"] = ckpttool.merge(root / "bf16", out["int4"], quantize="int4", group=32)  # type: ignore[assignment]
    out["asym"] = root / "asym"
    ckpttool.merge(root / "bf16", out["asym"], quantize="int4-asym", group=16, audit=False)
    ckpttool.merge(NVFP4_RELEASE, root / "nv-bf16", dtype="bfloat16", audit=False)
    out["nv-bf16"], out["nvfp4"] = root / "nv-bf16", root / "nvfp4"
    out["nv-result"] = ckpttool.merge(root / "nv-bf16", out["nvfp4"], quantize="nvfp4")  # type: ignore[assignment]
    return out


def test_merge_int4_writes_the_release_layout_and_config(packed):
    """The same tensors (names, shapes, dtypes) and the same quantization_config as compressed-tensors' release,
    the kept tensors byte for byte; a round trip reported per packed weight; its own audit clean."""
    release, ours = load_file(RELEASE / "model.safetensors"), load_output(packed["int4"])
    assert {k: (tuple(v.shape), v.dtype) for k, v in ours.items()} == {k: (tuple(v.shape), v.dtype)
                                                                       for k, v in release.items()}
    for name, tensor in release.items():
        if not name.rsplit(".", 1)[-1].startswith("weight_"):
            assert torch.equal(ours[name], tensor), name
    config = json.loads((packed["int4"] / "config.json").read_text())
    assert transformers.AutoConfig.from_pretrained(packed["int4"]).quantization_config == config["quantization_config"]
    assert config["quantization_config"] == json.loads((RELEASE / "config.json").read_text())["quantization_config"]
    result = packed["result"]
    assert len(result.round_trips) == 14 and result.audit is not None and not result.audit.errors
    worst = result.to_json()["quantization"]["worst"]
    assert worst["name"].endswith(".weight_packed") and 0 < worst["relative_error"] < 0.1
    assert any("pack-quantized INT4 symmetric in groups of 32" in n for n in result.plan.notes)


def test_packed_output_reads_back_as_the_encoders_round_trip(packed):
    """ckpttool reads its own output as a pack-quantized release: its dequantized weights are what the encoder
    measured its round trip against (bfloat16 codes times scales), within the reported error."""
    back = packed["int4"].parent / "back"
    ckpttool.merge(packed["int4"], back, dtype="bfloat16", audit=False)
    source, decoded = load_output(packed["bf16"]), load_output(back)
    errors = packed["result"].round_trips
    for name, measured in errors.items():
        weight = name.removesuffix("_packed")
        gap = (decoded[weight].float() - source[weight].float()).abs().max()
        assert float(gap) == measured.max_abs_error, weight


def test_asymmetric_packing_writes_zero_points_and_reads_back(packed):
    ours = load_output(packed["asym"])
    q = "model.layers.0.self_attn.q_proj"
    assert ours[q + ".weight_zero_point"].shape == (8, 4) and ours[q + ".weight_scale"].shape == (64, 4)
    weights = json.loads((packed["asym"] / "config.json").read_text())["quantization_config"]["config_groups"]
    assert weights["group_0"]["weights"] == {"dynamic": False, "group_size": 16, "num_bits": 4, "strategy": "group",
                                             "symmetric": False, "type": "int"}
    back = packed["asym"].parent / "asym-back"
    ckpttool.merge(packed["asym"], back, dtype="bfloat16", audit=False)
    source, decoded = load_output(packed["bf16"]), load_output(back)
    w = source[q + ".weight"].float()
    assert float((decoded[q + ".weight"].float() - w).abs().max()) <= float(w.abs().max()) / 15


@pytest.mark.parametrize("scheme, source, output, per", [
    (PackScheme(4, 16, symmetric=False), "bf16", "asym", 4), (PackScheme(4, 16, nvfp4=True), "nv-bf16", "nvfp4", 3)])
def test_packing_streams_in_row_chunks_within_the_predicted_buffers(packed, scheme, source, output, per):
    """Chunks of 3 rows (3 zero-point rows: 24 source rows; NVFP4: whole tensors, its global scale is the tensor's):
    the bytes of the whole merge; each buffer allocated at the size buffer_sizes predicts; a dry run's predicted
    peak counts the encoders' buffers."""
    plan = ckpttool.prepare(packed[source], quantize=scheme).plan
    targets = [t for t in plan.targets if t.dequant is not None]
    assert len(targets) == 14 * per
    parts, sizes, allocated = build_in_row_chunks(plan, targets, 3)
    assert allocated == {n: max(sizes[n], 1) for n in allocated}
    whole = load_output(packed[output])
    for name, pieces in parts.items():
        assert torch.equal(torch.cat(pieces).view(torch.uint8), whole[name].view(torch.uint8)), name
    assert max(len(p) for p in parts.values()) == (43 if not scheme.nvfp4 else 1)  # gate_proj's 128 rows, 3 at a time
    method = "nvfp4" if scheme.nvfp4 else "int4-asym"
    dry = ckpttool.merge(packed[source], None, dry_run=True, quantize=method, group=None if scheme.nvfp4 else 16)
    plain = ckpttool.merge(packed[source], None, dry_run=True)
    assert dry.to_json()["predicted_peak_bytes"] > plain.to_json()["predicted_peak_bytes"]


def test_nvfp4_repack_of_the_dequantized_release_gives_its_bytes_but_signed_zeros(packed):
    """Values on the release's grid (the NVFP4 release dequantized by ckpttool) pack again to the release: its
    config, global scales and scales byte for byte, every value code too, but for the codes of negative values the
    producer rounded to zero (code 8, dequantized to -0.0), which its own compressor writes as code 0 when given
    -0.0 again; the round trip is exact."""
    result = packed["nv-result"]
    assert result.audit is not None and not result.audit.errors
    assert {r.max_abs_error for r in result.round_trips.values()} == {0.0} and len(result.round_trips) == 14
    config = json.loads((packed["nvfp4"] / "config.json").read_text())["quantization_config"]
    assert config == json.loads((NVFP4_RELEASE / "config.json").read_text())["quantization_config"]
    release, ours = load_file(NVFP4_RELEASE / "model.safetensors"), load_output(packed["nvfp4"])
    assert sorted(ours) == sorted(release)
    signed_zeros = 0
    for name, tensor in release.items():
        if not name.endswith("weight_packed"):
            assert torch.equal(ours[name].view(torch.uint8), tensor.view(torch.uint8)), name
            continue
        for shift in (0, 4):
            mine, theirs = (ours[name].int() >> shift) & 15, (tensor.int() >> shift) & 15
            differ = mine != theirs
            assert bool(((mine == 0) & (theirs == 8))[differ].all()), name
            signed_zeros += int(differ.sum())
    assert signed_zeros > 0


def test_int4_repack_of_the_dequantized_release_observes_new_scales(packed):
    """INT4's min-max scale is max|w| / 7.5: a group of the release, whose largest code is 7 or -8, dequantized
    and packed again gets 7/7.5 or 8/7.5 of its scale (rounded to bfloat16), so the bytes differ from the release's
    (compressed-tensors' own compressor does the same); the values decode within half a new step."""
    release, ours = load_file(RELEASE / "model.safetensors"), load_output(packed["int4"])
    q = "model.layers.0.self_attn.q_proj.weight_scale"
    ratio = ours[q].float() / release[q].float()
    assert bool(((ratio - 8 / 7.5).abs() < 0.01).logical_or_((ratio - 7 / 7.5).abs() < 0.01).all())


# ---------------------------------------------------------------------------------------------- refusals


def test_a_group_that_does_not_divide_the_columns_is_refused(packed, cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", packed["bf16"], out, "--quantize", "int4", "--group", "48")
    assert_failed_cleanly(result, out, "--quantize int4: 'model.layers.0.mlp.down_proj.weight' [64, 128] has 128 "
                          "columns, not a whole number of groups of 48", "Give a group that divides 128 (--group)")


def test_packing_a_quantized_source_is_refused(cli, tmp_path):
    out = tmp_path / "out"
    result = cli("merge", RELEASE, out, "--quantize", "int4")
    assert_failed_cleanly(result, out, "--quantize int4:", "is quantized already", "Dequantize it first")


@pytest.mark.parametrize("args, message", [
    (["--group", "32"], "--group is the INT4 group size of --quantize int4"),
    (["--quantize", "fp8", "--group", "32"], "--group is the INT4 group size of --quantize int4"),
    (["--quantize", "int4", "--block", "128"], "--block is the FP8 block size of --quantize fp8; INT4 scales"),
    (["--quantize", "int4", "--dtype", "bfloat16"], "--quantize and --dtype are exclusive"),
    (["--quantize", "int4", "--group", "-1"], "--group"),
    (["--quantize", "nvfp4", "--group", "16"], "--group is the INT4 group size of --quantize int4"),
    (["--quantize", "nvfp4", "--dtype", "bfloat16"], "--quantize and --dtype are exclusive"),
])
def test_option_misuse_is_a_usage_error(cli, tmp_path, args, message):
    out = tmp_path / "out"
    result = cli("merge", RELEASE, out, *args)
    assert result.exit_code == 2 and message in result.output and not out.exists()


def test_api_misuse_raises_argument_errors(tmp_path):
    with pytest.raises(ArgumentError, match=r"group=32 is the INT4 group size of quantize='int4'"):
        ckpttool.merge(RELEASE, tmp_path / "a", quantize="fp8", group=32)
    with pytest.raises(ArgumentError, match=r"group=-8: the INT4 group size is 1 to 65536 values"):
        ckpttool.merge(RELEASE, tmp_path / "b", quantize="int4", group=-8)
    with pytest.raises(ArgumentError, match=r"quantize='int4' and dtype='bf16' together: quantize writes packed INT4"):
        ckpttool.merge(RELEASE, tmp_path / "c", quantize="int4", dtype="bf16")
    with pytest.raises(ArgumentError, match=r"group=16: quantize='nvfp4' scales groups of 16 values and takes no group"):
        ckpttool.merge(RELEASE, tmp_path / "d", quantize="nvfp4", group=16)
    assert not list(tmp_path.iterdir())


# ---------------------------------------------------------------------------------------------- TP-split sources


ASYM_RELEASE = FIXTURES / "quantized_llama_int4_asym" / "checkpoint"


def write_tp2_packed(release: Path, directory: Path, row_cut: int, column_cut: int | None) -> Path:
    """A packed release split in 2 as a TP training loop saves it (ckpttool's sidecar API): column-parallel
    weights at ``row_cut`` rows, row-parallel ones (o_proj, down_proj) at ``column_cut`` values (None: at
    ``row_cut`` rows too), each weight's scales and zero points cut with it; the rest replicated."""
    from ckpttool.io.sidecar import PieceSpec, save_shard

    tensors = load_file(release / "model.safetensors")
    config = json.loads((release / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]["weights"]["group_size"]
    ranks: list[tuple[dict, dict]] = [({}, {}), ({}, {})]
    for name, tensor in tensors.items():
        module, _, leaf = name.rpartition(".")
        if tensor.ndim < 2 or module + ".weight_packed" not in tensors:
            for local, specs in ranks:
                local[name], specs[name] = tensor, PieceSpec.replicated(tuple(tensor.shape))
            continue
        dim = 1 if column_cut is not None and module.endswith(("o_proj", "down_proj")) else 0
        cut = {("weight_packed", 1): (column_cut or 0) // 8, ("weight_scale", 1): (column_cut or 0) // group,
               ("weight_zero_point", 1): (column_cut or 0) // group, ("weight_packed", 0): row_cut,
               ("weight_scale", 0): row_cut, ("weight_zero_point", 0): row_cut // 8}[(leaf, dim)]
        for rank, (local, specs) in enumerate(ranks):
            lo, hi = (0, cut) if rank == 0 else (cut, tensor.shape[dim])
            local[name] = tensor.narrow(dim, lo, hi - lo).contiguous()
            specs[name] = PieceSpec(tuple(tensor.shape), tuple(lo if d == dim else 0 for d in range(2)),
                                    coordinates=(("tp_rank", rank),))
    for rank, (local, specs) in enumerate(ranks):
        save_shard(local, specs, directory, rank=rank, world_size=2)
    (directory / "config.json").write_text(json.dumps(config))
    return directory


@pytest.mark.parametrize("release, column_cut", [(RELEASE, 32), (ASYM_RELEASE, None)])
def test_a_tp_split_int4_release_merges_and_dequantizes_as_the_whole_one(tmp_path, release, column_cut):
    """Symmetric g32 split at row 32 and value column 32 (packed column 4, scale column 1), asymmetric g128 at row
    32 (zero-point row 4): kept byte for byte, and dequantized as the whole release is (its reference)."""
    source = write_tp2_packed(release, tmp_path / "tp2", row_cut=32, column_cut=column_cut)
    layout = ckpttool.read_layout(source)
    assert len(layout.tensors["model.layers.0.mlp.down_proj.weight_packed"].pieces) == 2
    ckpttool.merge(source, tmp_path / "kept", audit=False)
    whole, kept = load_file(release / "model.safetensors"), load_output(tmp_path / "kept")
    assert sorted(kept) == sorted(whole) and all(torch.equal(kept[k], v) for k, v in whole.items())
    ckpttool.merge(source, tmp_path / "bf16", dtype="bfloat16", audit=False)
    ours, reference = load_output(tmp_path / "bf16"), load_file(release.parent / "reference" / "model.safetensors")
    assert sorted(ours) == sorted(reference) and all(torch.equal(ours[k], v) for k, v in reference.items())


@pytest.mark.parametrize("release, row_cut, column_cut, message", [
    (RELEASE, 32, 48, "'model.layers.0.self_attn.o_proj.weight_packed' [64, 8] is split at packed column 6 (value "
                      "column 48) (pieces in 'rank-00000-of-00002.safetensors', 'rank-00001-of-00002.safetensors'), not "
                      "on a boundary of its 32-value groups (group_size 32 in '"),
    (ASYM_RELEASE, 12, None, "'model.layers.0.self_attn.q_proj.weight_packed' [128, 16] is split at row 12 (pieces "
                             "in 'rank-00000-of-00002.safetensors', 'rank-00001-of-00002.safetensors'), not on a "
                             "multiple of 8 rows, the rows one int32 of its zero points packs (4-bit, asymmetric, in '"),
])
def test_a_split_off_the_group_boundaries_is_refused_naming_tensor_split_and_group(tmp_path, cli, release, row_cut,
                                                                                  column_cut, message):
    source = write_tp2_packed(release, tmp_path / "tp2", row_cut=row_cut, column_cut=column_cut)
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", source, out, "--dtype", "bfloat16"), out, message)
    assert_failed_cleanly(cli("merge", source, out), out, message)
    findings = [f for f in ckpttool.audit(source, data=False).findings if f.code == "quant-split"]
    assert any(f.message.startswith(message) for f in findings)


def test_the_cli_packs_and_reports_each_round_trip_as_json(packed, cli, tmp_path):
    result = cli("merge", packed["bf16"], tmp_path / "out", "--quantize", "int4-asym", "--group", "0", "--no-audit",
                 "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["quantization"]
    assert report["tensors"] == 14 and report["worst"]["name"].endswith(".weight_packed")
    config = json.loads((tmp_path / "out" / "config.json").read_text())["quantization_config"]
    assert config["config_groups"]["group_0"]["weights"]["strategy"] == "channel"
    assert load_output(tmp_path / "out")["model.layers.0.self_attn.q_proj.weight_scale"].shape == (64, 1)
