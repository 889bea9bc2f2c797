"""NVFP4 packing reads the whole weight (its global scale is the whole tensor's) but scales and codes it a block of
rows at a time, so its temporaries are one block's, not the weight's (a 1.15 GiB BF16 Llama packed with 2 workers
peaked at 3.6 GiB before). The bytes are compressed-tensors' own whatever the block: every group lies in one row."""

from __future__ import annotations

import pytest
import torch
from conftest import FIXTURES
from safetensors.torch import load_file

import ckpttool.quant.pack_encode as pack_encode
from ckpttool.io.dtypes import torch_dtype
from ckpttool.quant.codecs import codec
from ckpttool.quant.pack_encode import NVFP4_PART

ORACLE = FIXTURES / "int4_encode_oracle" / "tensors.safetensors"


def _scratch(name, shape, dtype):
    return torch.empty(shape, dtype=torch_dtype(dtype))


@pytest.mark.parametrize("block", [1, 160, 1 << 20])  # one row, five rows of 32 (the last block short), one block
def test_nvfp4_in_blocks_of_rows_is_bit_exact_with_compressed_tensors(monkeypatch, block):
    monkeypatch.setattr(pack_encode, "NVFP4_BLOCK", block)
    oracle = load_file(ORACLE)
    names = [k for k in oracle if "." not in k.removeprefix("random.")]
    assert names
    for name in names:
        w, rows = oracle[name], oracle[name].shape[0]
        for part, suffix, dtype in (("packed", "weight_packed", torch.uint8),
                                    ("scales", "weight_scale", torch.float8_e4m3fn),
                                    ("global", "weight_global_scale", torch.float32)):
            want = oracle[f"{name}.nvfp4.{suffix}"]
            out = torch.empty(want.shape, dtype=dtype)
            codec(NVFP4_PART, (("part", part), ("rows", rows))).decode(w, None, 0, out, _scratch)
            assert torch.equal(out.view(torch.uint8), want.view(torch.uint8)), (name, part, block)


def test_the_prediction_counts_one_block_of_temporaries_not_the_weight():
    encoder = codec(NVFP4_PART, (("part", "packed"), ("rows", 28672)))
    sizes = encoder.scratch_bytes((28672, 8192), None, "U8")
    block = pack_encode.NVFP4_BLOCK // 8192 * 8192
    assert sizes["nvfp4-temporaries"] == block * 40
    assert sizes["bf16"] == 28672 * 8192 * 2  # the weight itself, rounded to bfloat16 when it is not already
