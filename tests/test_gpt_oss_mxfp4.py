"""gpt-oss to the MXFP4 release layout (issue 29): the encoder against its reference, ``merge --quantize mxfp4``
(the experts' ``_blocks``/``_scales``, the release's ``quantization_config``), and ``split --to dcp --ep``.

Oracle of the encoder: triton_kernels' ``downcast_to_mxfp_torch`` (what transformers' ``quantize_to_mxfp4``
calls), whose bytes ``fixtures/make_mxfp4_oracle.py`` recorded in ``fixtures/mxfp4_encode_oracle``; the release
layout's decoder is transformers' ``convert_moe_packed_tensors``.
"""

from __future__ import annotations

import math

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
