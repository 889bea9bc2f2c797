"""Packed 4-bit releases (compressed-tensors ``pack-quantized`` INT4 and ``nvfp4-pack-quantized``, ModelOpt NVFP4),
made by the producers' own code (fixtures/make_int4.py): merged as they are byte for byte, dequantized bit for bit
as each producer's own decompressor gives them (the fixtures' ``reference/``), loadable by transformers; header
faults and seeded scale faults named by the audit and refused by a merge, with nothing written."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pytest
import torch
import transformers  # imported first, as in the whole suite: each architecture is described in this process
from conftest import build_in_row_chunks, FIXTURES, assert_failed_cleanly, load_output
from test_quantized import rewrite

import ckpttool
from ckpttool.errors import ConfigError
from ckpttool.quant.formats import read_quantization

INT4 = "quantized_qwen3_int4"
ASYM = "quantized_llama_int4_asym"
CHANNEL = "quantized_llama_int4_channel"
NVFP4 = "quantized_qwen3_nvfp4"
MODELOPT = "quantized_llama_nvfp4_modelopt"
ALL = (INT4, ASYM, CHANNEL, NVFP4, MODELOPT)
Q = "model.layers.0.self_attn.q_proj"


def checkpoint(name: str) -> Path:
    return FIXTURES / name / "checkpoint"


def reference(name: str) -> Path:
    return FIXTURES / name / "reference"


@pytest.fixture(scope="module")
def dequantized(tmp_path_factory) -> dict[str, Path]:
    """Each fixture merged once with ``dtype="bfloat16"``."""
    root = tmp_path_factory.mktemp("int4")
    out = {}
    for name in ALL:
        ckpttool.merge(checkpoint(name), root / name, dtype="bfloat16")
        out[name] = root / name
    return out


# ---------------------------------------------------------------------------------------------- the config


def test_each_config_is_read_as_its_producer_wrote_it():
    quant = {name: read_quantization(json.loads((checkpoint(name) / "config.json").read_text())) for name in ALL}
    assert [(q.method, q.bits, q.block, q.symmetric, q.weight_dtype) for q in quant.values()] == [
        ("pack-quantized", 4, (1, 32), True, "I32"), ("pack-quantized", 4, (1, 128), False, "I32"),
        ("pack-quantized", 4, (1, 0), True, "I32"), ("nvfp4-pack-quantized", 4, (1, 16), True, "U8"),
        ("modelopt-nvfp4", 4, (1, 16), True, "U8")]
    # compressed-tensors saves its re: patterns as the module names they matched
    assert quant[CHANNEL].not_converted == ("model.layers.0.self_attn.o_proj", "model.layers.1.self_attn.o_proj", "lm_head")
    assert not quant[CHANNEL].converts("model.layers.1.self_attn.o_proj")
    assert quant[CHANNEL].converts("model.layers.1.self_attn.q_proj")
    written = read_quantization(_ct(GROUP32, ignore=["lm_head", "re:.*mlp.gate$"]))
    assert not written.converts("model.layers.3.mlp.gate") and written.converts("model.layers.3.mlp.gate_proj")
    assert quant[MODELOPT].not_converted == ("lm_head", "model.embed_tokens")
    assert quant[INT4].describe() == "compressed-tensors pack-quantized int4 (groups of 32, symmetric)"


def _ct(weights: dict, fmt: str = "pack-quantized", **extra) -> dict:
    return {"quantization_config": {"quant_method": "compressed-tensors", "format": fmt, **extra,
                                    "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}}}}


GROUP32 = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}


@pytest.mark.parametrize(("config", "message"), [
    (_ct(GROUP32, fmt="float-quantized"), "quantization_config.format is 'float-quantized'; ckpttool reads "
     "compressed-tensors 'pack-quantized' and 'nvfp4-pack-quantized' checkpoints only"),
    (_ct({**GROUP32, "actorder": "group"}), "config_groups.group_0.weights.actorder is 'group'; ckpttool reads no "
     "activation-ordered groups (weight_g_idx)"),
    (_ct({**GROUP32, "group_size": None}), "config_groups.group_0.weights has strategy 'group' and group_size None"),
    (_ct({**GROUP32, "type": "float"}), "pack-quantized weights are 4- or 8-bit int"),
    (_ct(GROUP32, ignore="lm_head"), "quantization_config.ignore must be a list of module names, not 'lm_head'"),
    ({"quantization_config": {"quant_method": "modelopt", "quant_algo": "W4A8_AWQ"}},  # FP8 is read since issue 28
     "quantization_config.quant_algo is 'W4A8_AWQ'; ckpttool reads ModelOpt 'NVFP4' and 'FP8' (per tensor) "
     "checkpoints only"),
])
def test_a_packed_config_ckpttool_cannot_honour_is_an_error_naming_its_key(config, message):
    with pytest.raises(ConfigError) as e:
        read_quantization(config, "ckpt/config.json")
    assert str(e.value).startswith("'ckpt/config.json': quantization_config")
    assert message in str(e.value)


def test_two_different_schemes_are_refused():
    config = _ct(GROUP32)
    config["quantization_config"]["config_groups"]["group_1"] = {"targets": ["Linear"],
                                                                 "weights": {**GROUP32, "group_size": 128}}
    with pytest.raises(ConfigError, match=r"config_groups declare 2 different weight schemes \[\(4, 32, True\), "
                       r"\(4, 128, True\)\]; ckpttool reads one scheme per checkpoint"):
        read_quantization(config)


# ---------------------------------------------------------------------------------------------- merge and audit


@pytest.mark.parametrize("name", ALL)
def test_merged_as_is_byte_for_byte_and_audited_clean(name, tmp_path):
    ckpttool.merge(checkpoint(name), tmp_path / "out")
    source, written = load_output(checkpoint(name)), load_output(tmp_path / "out")
    assert sorted(written) == sorted(source)
    for key, tensor in source.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key].view(-1).view(torch.uint8),
                                                                  tensor.view(-1).view(torch.uint8)), key
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization_config"] == json.loads((checkpoint(name) / "config.json").read_text())["quantization_config"]
    report = ckpttool.audit(checkpoint(name))
    assert not [f for f in report.findings if f.severity == "error"], report.findings


@pytest.mark.parametrize("name", ALL)
def test_dequantized_bit_for_bit_as_the_producers_own_decompressor(name, dequantized):
    """The reference is compressed-tensors' compressor ``decompress`` or ModelOpt's ``NVFP4QTensor.dequantize`` on
    the same bytes; the scales, zero points, shapes and activation scales are not written."""
    written, expected = load_output(dequantized[name]), load_output(reference(name))
    assert sorted(written) == sorted(expected)
    for key, tensor in expected.items():
        assert written[key].dtype == tensor.dtype and torch.equal(written[key], tensor), key
    assert "quantization_config" not in json.loads((dequantized[name] / "config.json").read_text())


def test_the_two_nvfp4_formulas_are_each_producers_own():
    """ModelOpt multiplies by weight_scale_2, compressed-tensors divides by its global scale (1 / weight_scale_2)
    and rounds through bfloat16: on ModelOpt's own bytes the two differ by one float32 ulp in many values (what a
    float32 merge writes), and ckpttool's ModelOpt decoder gives ModelOpt's reference."""
    from ckpttool.quant.packed_decode import Nvfp4

    stored = load_output(checkpoint(MODELOPT))
    scratch = lambda name, shape, dtype: torch.empty(shape, dtype={"F32": torch.float32, "I32": torch.int32,  # noqa: E731
                                                                   "BF16": torch.bfloat16}[dtype])
    differ = 0
    for key in [k for k in stored if k.endswith(".weight_scale_2")]:
        w = key.removesuffix("_scale_2")
        rows, half = stored[w].shape
        own, other = torch.empty(rows, 2 * half, dtype=torch.float32), torch.empty(rows, 2 * half, dtype=torch.float32)
        Nvfp4(False).decode(stored[w], stored[w + "_scale"], 0, own, scratch, aux=(stored[key],))
        Nvfp4(True).decode(stored[w], stored[w + "_scale"], 0, other, scratch, aux=((1 / stored[key]).reshape(1),))
        assert torch.equal(own.bfloat16(), load_output(reference(MODELOPT))[w])
        differ += int((own != other).sum())
    assert differ > 0


@pytest.mark.parametrize("name", [INT4, MODELOPT])
def test_the_dequantized_model_loads_in_transformers_with_the_references_logits(name, dequantized):
    def logits(path: Path) -> torch.Tensor:
        model, info = transformers.AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
        assert not any(info.values()), info  # strict: nothing missing, unexpected or mismatched
        with torch.no_grad():
            return model(torch.arange(8).unsqueeze(0)).logits

    assert torch.equal(logits(dequantized[name]), logits(reference(name)))


@pytest.mark.parametrize("name", [ASYM, NVFP4])
def test_dequantizing_streams_in_row_chunks_within_the_predicted_buffers(name):
    """Chunks of 3 rows (zero points packed 8 rows to a word are cut inside a word): the same bytes as the
    reference; each buffer allocated at the size buffer_sizes predicts."""
    plan = ckpttool.prepare(checkpoint(name), dtype="bfloat16").plan
    targets = [t for t in plan.targets if t.dequant is not None]
    parts, sizes, allocated = build_in_row_chunks(plan, targets, 3)
    assert allocated == {n: max(sizes[n], 1) for n in allocated}
    expected = load_output(reference(name))
    assert Counter(len(p) >= 3 for p in parts.values()) == Counter({True: len(targets)})
    for target, pieces in parts.items():
        assert torch.equal(torch.cat(pieces), expected[target]), target


# ---------------------------------------------------------------------------------------------- faults


def _seed(name: str, tmp_path: Path, change) -> Path:
    return rewrite(checkpoint(name), tmp_path / "src", change)


def _set(tensor: str, value: float, index=(1, 0)):
    def change(tensors, config):
        del config
        tensors[tensor] = tensors[tensor].clone()
        tensors[tensor][index] = value
    return change


@pytest.mark.parametrize(("name", "scale", "index", "words"), [
    (INT4, Q + ".weight_scale", (1, 0), "row 1, group 0 (columns 0..32)"),
    (ASYM, Q + ".weight_scale", (5, 0), "row 5, group 0 (columns 0..128)"),
    (NVFP4, Q + ".weight_scale", (1, 2), "row 1, group 2 (columns 32..48)"),
    (MODELOPT, Q + ".weight_scale", (1, 2), "row 1, group 2 (columns 32..48)"),
])
def test_a_nan_scale_is_named_by_the_audit_and_refused_by_a_dequantizing_merge(name, scale, index, words, tmp_path, cli):
    src = _seed(name, tmp_path, _set(scale, float("nan"), index))
    report = ckpttool.audit(src, data=False)
    assert [(f.code, f.tensor) for f in report.findings if f.severity == "error"] == [("quant-scale-invalid", scale)]
    assert f"(the first is {list(index)}: row {index[0]}, group {index[1]})" in report.findings[0].message or \
        f"(the first is {list(index)}: row block {index[0]}, column block {index[1]})" in report.findings[0].message
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out, "--dtype", "bfloat16"), out,
                          f"Error: '{Q}.weight': cannot dequantize {words}: its scale '{scale}'{list(index)} in "
                          "'model.safetensors' is NaN")
    before = sorted(p.name for p in src.iterdir())
    assert cli("merge", src, out).exit_code == 0  # kept quantized: the scales copied as they are
    assert sorted(p.name for p in src.iterdir()) == before


@pytest.mark.parametrize(("name", "tensor", "value", "kind"), [
    (INT4, Q + ".weight_scale", 0.0, "1 zero"), (INT4, Q + ".weight_scale", -0.5, "1 negative"),
    (NVFP4, Q + ".weight_global_scale", 0.0, "1 zero"), (MODELOPT, Q + ".weight_scale_2", float("inf"), "1 infinite"),
])
def test_zero_negative_and_global_scales_are_named_by_the_audit(name, tensor, value, kind, tmp_path):
    index = () if tensor.endswith("_2") else (0,) if tensor.endswith("global_scale") else (1, 0)
    src = _seed(name, tmp_path, _set(tensor, value, index))
    found = [f for f in ckpttool.audit(src, data=False).findings if f.severity == "error"]
    assert [(f.code, f.tensor) for f in found] == [("quant-scale-invalid", tensor)]
    assert found[0].message.startswith(f"'{tensor}': {kind} of its ")


@pytest.mark.parametrize(("name", "tensor", "what"), [
    (NVFP4, Q + ".weight_global_scale", "weight_global_scale is 0.0"),
    (MODELOPT, Q + ".weight_scale_2", "weight_scale_2 is 0.0"),
])
def test_a_zero_global_scale_is_refused_by_a_dequantizing_merge(name, tensor, what, tmp_path, cli):
    src = _seed(name, tmp_path, _set(tensor, 0.0, () if tensor.endswith("_2") else (0,)))
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out, "--dtype", "bfloat16"), out,
                          f"Error: '{Q}.weight': its {what}, which would make every value of the tensor NaN, "
                          "infinite or zero")


def _drop_scale_column(tensors, config):
    del config
    tensors[Q + ".weight_scale"] = tensors[Q + ".weight_scale"][:, :-1].clone()


def _wrong_weight_shape(tensors, config):
    del config
    tensors[Q + ".weight_shape"] = torch.tensor([64, 56])


def _without(*names):
    def change(tensors, config):
        del config
        for name in names:
            del tensors[name]
    return change


def _symmetric(tensors, config):
    del tensors
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["symmetric"] = True


def _ignore_q(tensors, config):
    del tensors
    config["quantization_config"]["ignore"].append(Q)


def _zero_point_rows(tensors, config):
    del config
    name = "model.layers.0.mlp.down_proj.weight_zero_point"
    tensors[name] = tensors[name][:-1].clone()


def _packed_dtype(tensors, config):
    del config
    tensors[Q + ".weight_packed"] = tensors[Q + ".weight_packed"].view(torch.float32).clone()


@pytest.mark.parametrize(("name", "change", "code", "tensor", "message"), [
    (INT4, _drop_scale_column, "quant-scale-shape", Q + ".weight_scale",
     f"'{Q}.weight_scale' has shape [64, 1], but '{Q}.weight_packed' [64, 8] holds 64 rows of 57..64 values, which "
     "in groups of 32 ('{label}') need [64, 2]. Was it quantized with another group size, or cut by a split?"),
    (INT4, _without(Q + ".weight_shape"), "quant-scale-missing", Q + ".weight_packed",
     f"'{Q}.weight_packed' is packed but '{Q}.weight_shape' is not in the checkpoint"),
    (ASYM, _without(Q + ".weight_zero_point"), "quant-scale-missing", Q + ".weight_packed",
     f"'{Q}.weight_packed' is asymmetric ('{{label}}': symmetric false) but '{Q}.weight_zero_point' is not in the "
     "checkpoint: its values cannot be dequantized. Restore it"),
    (ASYM, _zero_point_rows, "quant-scale-shape", "model.layers.0.mlp.down_proj.weight_zero_point",
     "'model.layers.0.mlp.down_proj.weight_zero_point' is I32 [15, 1], but the zero points of "
     "'model.layers.0.mlp.down_proj.weight_packed' (128 rows, 1 groups) are I32 [16, 1]: 8 per int32 along the rows"),
    (INT4, _packed_dtype, "quant-config-mismatch", Q + ".weight_packed",
     f"'{Q}.weight_packed' is F32, but '{{label}}' declares compressed-tensors pack-quantized int4 (groups of 32, "
     "symmetric), whose packed values are I32"),
    (NVFP4, _without(Q + ".weight_global_scale"), "quant-scale-missing", Q + ".weight_packed",
     f"'{Q}.weight_packed' is NVFP4 ('{{label}}') but '{Q}.weight_global_scale', its global scale, is not in the "
     "checkpoint"),
])
def test_a_header_fault_is_named_by_the_audit_and_refused_by_every_merge(name, change, code, tensor, message, tmp_path, cli):
    src = _seed(name, tmp_path, change)
    message = message.replace("{label}", str(src / "config.json"))
    found = [f for f in ckpttool.audit(src, data=False).findings if f.severity == "error"]
    assert (code, tensor) in [(f.code, f.tensor) for f in found]
    assert any(message in f.message for f in found), [f.message for f in found]
    out = tmp_path / "out"
    for args in ((), ("--dtype", "bfloat16")):
        assert_failed_cleanly(cli("merge", src, out, *args), out, "is inconsistent", message)


def test_a_weight_shape_the_packing_does_not_hold_is_refused_by_a_dequantizing_merge(tmp_path, cli):
    src = _seed(INT4, tmp_path, _wrong_weight_shape)
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out, "--dtype", "bfloat16"), out,
                          f"Error: '{Q}.weight': its weight_shape is [64, 56], but the packed values and scales hold "
                          "[64, 64]: the packing does not match the weight it names")
    assert cli("merge", src, out).exit_code == 0  # kept as it is: the bytes say nothing wrong until dequantized


def test_the_channel_fixture_keeps_its_ignored_modules_in_bf16(dequantized):
    stored = load_output(checkpoint(CHANNEL))
    assert stored["model.layers.0.self_attn.o_proj.weight"].dtype == torch.bfloat16
    assert stored[Q + ".weight_scale"].shape == (64, 1)
    assert "model.layers.0.self_attn.o_proj.weight_packed" not in stored


def _headers(name: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    from safetensors import safe_open

    with safe_open(checkpoint(name) / "model.safetensors", "pt") as f:
        return {k: (f.get_slice(k).get_dtype(), tuple(f.get_slice(k).get_shape())) for k in f.keys()}


@pytest.mark.parametrize(("name", "change", "code", "tensor", "message"), [
    (ASYM, _symmetric, "quant-config-mismatch", Q + ".weight_zero_point",
     f"'{Q}.weight_zero_point' is in the checkpoint, but 'ckpt/config.json' declares a symmetric scheme (no zero "
     "point): its values would be ignored. Set symmetric: false"),
    (INT4, _ignore_q, "quant-not-converted", Q + ".weight_packed",
     f"'{Q}.weight_packed' is quantized, but modules_to_not_convert in 'ckpt/config.json' names '{Q}': transformers "
     "would load its stored values as a plain weight, without the scales. Remove it from the list"),
    (INT4, lambda t, c: c["quantization_config"]["config_groups"]["group_0"]["weights"].update(group_size=16),
     "quant-scale-shape", Q + ".weight_scale",
     f"'{Q}.weight_scale' has shape [64, 2], but '{Q}.weight_packed' [64, 8] holds 64 rows of 57..64 values, which in "
     "groups of 16 ('ckpt/config.json') need [64, 4]"),
])
def test_a_config_that_contradicts_the_tensors_is_a_problem_naming_both(name, change, code, tensor, message):
    """From the headers alone, as merge and audit check them (a changed config is a new architecture to describe:
    checked here without one)."""
    from ckpttool.quant.checks import check_tensors

    config = json.loads((checkpoint(name) / "config.json").read_text())
    change(None, config)
    found = check_tensors(_headers(name), read_quantization(config, "ckpt/config.json"), has_config=True)
    assert (code, tensor) in [(p.code, p.tensor) for p in found]
    assert any(message in p.message for p in found), [p.message for p in found]
