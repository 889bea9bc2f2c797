"""``split --to megatron --dtype bfloat16`` of an FP8 DeepSeek-V3 release at a TP whose shards start inside the
128x128 (here 16x16) scale blocks (issue 31: ``kv_a_proj_with_mqa``'s 576 rows at TP2 are rows 288..576, at TP8 72
rows each). Each chunk reads only its own FP8 elements and the scales of the blocks it meets; the decoder is told
where in its first block the chunk starts (``Fp8Blocks.origin``).

The judges: the decoder against the whole weight's decode (a box of it, bit for bit); the split against the
dequantize-then-split of the same release (its BF16 merge split at the same layout: the same tensors bit for bit,
the same chunks); megatron-core itself, which loads the TP2 split strictly and gives transformers' logits on the
dequantized model (slow; skipped without ``/work/venv-megatron``).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import FIXTURES, assert_failed_cleanly
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint import FileSystemReader

import ckpttool
from ckpttool.quant.decode import Fp8Blocks, decoder

FP8 = FIXTURES / "quantized_deepseek_v3_fp8" / "checkpoint"
HERE = Path(__file__).parent
MEGATRON_VENV = Path(os.environ.get("CKPTTOOL_MEGATRON_VENV", "/work/venv-megatron"))

#: transformers is imported here anyway (the consumer's judge): configs are described in this process
pytestmark = pytest.mark.usefixtures("describe_inline")


def scratch(name, shape, dtype):
    return torch.empty(shape, dtype={"F32": torch.float32, "I32": torch.int32}[dtype])


def fp8_weight(shape, block, seed=0):
    """Random FP8 values (no NaN code) and positive float32 scales, one per block (edge blocks cropped)."""
    gen = torch.Generator().manual_seed(seed)
    values = (torch.randn(shape, generator=gen) * 8).to(torch.float8_e4m3fn)
    grid = (*shape[:-2], math.ceil(shape[-2] / block[0]), math.ceil(shape[-1] / block[1]))
    return values, torch.rand(grid, generator=gen).add_(0.5)


def decoded(values, scales, block, out_dtype=torch.bfloat16, **kw):
    out = torch.empty(values.shape, dtype=out_dtype)
    Fp8Blocks(block, ndim=values.dim(), **kw).decode(values, scales, 0, out, scratch)
    return out


@pytest.mark.parametrize("rows, cols", [((12, 24), (0, 40)), ((5, 37), (3, 29)), ((16, 32), (7, 40)),
                                        ((0, 7), (15, 16))])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_a_box_that_starts_inside_a_block_decodes_as_that_box_of_the_whole_weight(rows, cols, out_dtype):
    """Rows and columns that start inside a 16x16 block, end inside another or at the cropped edge (40 columns),
    and a box narrower than one block."""
    block, (r0, r1), (c0, c1) = (16, 16), rows, cols
    values, scales = fp8_weight((40, 40), block)
    want = decoded(values, scales, block, out_dtype)[r0:r1, c0:c1]
    box_scales = scales[r0 // 16: -(-r1 // 16), c0 // 16: -(-c1 // 16)]
    got = decoded(values[r0:r1, c0:c1].contiguous(), box_scales, block, out_dtype, origin=(r0 % 16, c0 % 16))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_chunks_of_a_box_read_the_scale_rows_of_the_blocks_they_meet():
    """The executor's row chunks of such a box: each reads the scale rows :meth:`scale_rows` names and decodes as
    the whole box does, whatever row it starts at."""
    block = (16, 16)
    values, scales = fp8_weight((72, 40), block, seed=1)
    box, box_scales = values[9:70, 5:40].contiguous(), scales[0:5, 0:3]
    codec = decoder("fp8-blocks", (("block", block), ("origin", (9, 5))))
    want = decoded(values, scales, block)[9:70, 5:40]
    for a, b in [(0, 7), (7, 23), (23, 61), (0, 61)]:
        lo, hi = codec.scale_rows(a, b)
        out = torch.empty((b - a, 35), dtype=torch.bfloat16)
        codec.decode(box[a:b], box_scales[lo:hi], a, out, scratch)
        assert torch.equal(out.view(torch.int16), want[a:b].view(torch.int16)), (a, b)


def test_a_stacked_experts_box_decodes_each_expert_from_its_blocks():
    """An expert's chunk of a stacked Megatron tensor (``ndim`` 3): one leading unit dim, the same origin."""
    block = (16, 16)
    values, scales = fp8_weight((24, 40), block, seed=2)
    want = decoded(values, scales, block)[12:24, 20:40]
    got = decoded(values[None, 12:24, 20:40].contiguous(), scales[None, 0:2, 1:3], block, origin=(12, 4))
    assert torch.equal(got[0].view(torch.int16), want.view(torch.int16))


# ------------------------------------------------------------------------------------------------
# the split against the dequantize-then-split of the same release
# ------------------------------------------------------------------------------------------------


def read_all(directory: Path):
    """Every tensor of a DCP directory, whole, and each tensor's chunks (torch's own reader, no process group)."""
    metadata = FileSystemReader(directory).read_metadata()
    state = {k: torch.empty(tuple(m.size), dtype=m.properties.dtype)
             for k, m in metadata.state_dict_metadata.items() if hasattr(m, "size")}
    dcp.load(state, storage_reader=FileSystemReader(directory), no_dist=True)
    chunks = {k: sorted((tuple(c.offsets), tuple(c.sizes)) for c in m.chunks)
              for k, m in metadata.state_dict_metadata.items() if hasattr(m, "chunks")}
    return state, chunks


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """The release dequantized to BF16 (``merge --dtype bfloat16``): what the split is the split of."""
    out = tmp_path_factory.mktemp("bf16") / "out"
    ckpttool.merge(FP8, out, dtype="bfloat16", audit=False)  # the audit is not what is tested here
    return out


@pytest.mark.parametrize("layout", [dict(tp=2), dict(tp=4), dict(tp=2, pp=2, ep=3)], ids=["tp2", "tp4", "tp2-pp2-ep3"])
def test_an_fp8_release_split_at_a_tp_that_cuts_its_blocks_is_its_bf16_merge_split(layout, bf16, tmp_path):
    """TP2: q_a_proj's 24 rows are 12 a rank (rank 1 starts inside block 0), o_proj's 48 columns 24 a rank, the
    dense MLP's 72 rows 36; TP4 cuts more; experts split by expert TP 2 over EP3 and two stages. The same global
    tensors bit for bit and the same chunks as the BF16 merge split at the same layout."""
    ckpttool.split(FP8, tmp_path / "direct", to="megatron", dtype="bfloat16", **layout)
    ckpttool.split(bf16, tmp_path / "via", to="megatron", **layout)
    got, got_chunks = read_all(tmp_path / "direct" / "iter_0000000")
    want, want_chunks = read_all(tmp_path / "via" / "iter_0000000")
    assert sorted(got) == sorted(want) and got_chunks == want_chunks
    assert got["decoder.layers.0.self_attention.linear_q_down_proj.weight"].dtype == torch.bfloat16
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name


def test_a_nan_scale_of_a_block_a_shard_starts_inside_is_refused_naming_it(cli, tmp_path):
    """q_a_proj's scale of block row 1 made NaN: TP rank 1's shard (rows 12..24, from inside block 0) meets it;
    the split stops, naming the block in the shard's rows, the scale and its file; nothing is written."""
    src = tmp_path / "src"
    shutil.copytree(FP8, src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    scale = "model.layers.0.self_attn.q_a_proj.weight_scale_inv"
    tensors = load_file(src / index[scale])
    tensors[scale][1, 0] = float("nan")
    save_file(tensors, src / index[scale], metadata={"format": "pt"})
    out = tmp_path / "out"
    result = cli("split", src, out, "--to", "megatron", "--tp", "2", "--dtype", "bfloat16")
    assert_failed_cleanly(result, out, "'decoder.layers.0.self_attention.linear_q_down_proj.weight': cannot dequantize "
                          f"row block 1, column block 0 (rows 4..12, columns 0..16): its scale '{scale}'[1, 0] in "
                          f"'{index[scale]}' is NaN")


# ------------------------------------------------------------------------------------------------
# the real consumer: megatron-core loads the TP2 split strictly; its logits are transformers' on the dequantized model
# ------------------------------------------------------------------------------------------------


@pytest.mark.skipif(not (MEGATRON_VENV / "bin" / "python").is_file(),
                    reason=f"megatron-core venv not at {MEGATRON_VENV} (set CKPTTOOL_MEGATRON_VENV)")
@pytest.mark.slow
def test_megatron_core_loads_the_fp8_split_at_tp2_strictly_and_gives_transformers_logits(bf16, megatron_torchrun,
                                                                                          tmp_path):
    """One torchrun job (2 gloo ranks, fp32 on CPU): every weight loaded from the split (NaN-poisoned before), the
    logits those of transformers' DeepseekV3ForCausalLM on the BF16 merge (3.0e-7 observed)."""
    from transformers import AutoModelForCausalLM

    ckpttool.split(FP8, tmp_path / "split", to="megatron", tp=2, dtype="bfloat16", make_vocab_size_divisible_by=64)
    done = megatron_torchrun(HERE / "megatron_fp8_split_consumer.py", tmp_path / "split" / "config.json",
                             tmp_path / "split" / "iter_0000000", tmp_path / "l.safetensors", 64, nproc=2)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    got = load_file(tmp_path / "l.safetensors")
    model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        want = model(got["tokens"]).logits
    vocab = want.shape[-1]
    assert got["logits"].shape[-1] == 256 and not got["logits"][..., vocab:].any()  # 211 padded to 2 x 64 x 2
    torch.testing.assert_close(got["logits"][..., :vocab], want, rtol=0, atol=1e-5)
