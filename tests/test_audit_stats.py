"""The data checks' streaming (``ckpttool.audit.stats``): a chunk read straight from its file is the chunk the
executor builds, statistics and fingerprints match values computed whole, and the scale check's shortcut for
valid blocks counts what the full count finds."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ckpttool.audit.quantized import ScaleCheck
from ckpttool.audit.stats import BLOCK_ELEMENTS, Fingerprint, Statistics, _as_tensor, _read_direct, blocks, fold
from ckpttool.execute.reads import Reader
from ckpttool.execute.buffers import buffer_sizes, chunks, piece_uses
from ckpttool.execute.assembly import build
from ckpttool.plan.plan import Target
from ckpttool.commands.merge import prepare

TENSORS = {
    "a.bf16": (torch.arange(6 * 5, dtype=torch.float32).reshape(6, 5) / 7).to(torch.bfloat16),
    "b.odd_f16": torch.tensor([1.5, -2.0, 3.25], dtype=torch.float16),  # 6 bytes: the next tensor starts unaligned
    "c.f32": torch.tensor([[0.5, float("nan")], [float("inf"), -3.0]]),
    "d.int": torch.arange(7, dtype=torch.int64),
    "e.scalar": torch.tensor(2.5),
    "f.empty": torch.zeros(0, 4),
    "g.bool": torch.tensor([True, False, True]),
    "h.f64": torch.tensor([1e-3, 2.0, -7.5], dtype=torch.float64),
}


def _source(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    save_file(TENSORS, src / "model.safetensors", metadata={"format": "pt"})
    return src


def test_direct_chunks_are_what_the_executor_builds(tmp_path: Path) -> None:
    plan = prepare(_source(tmp_path)).plan
    every = [c for t in plan.targets for c in chunks(t, 0)]
    reader = Reader(plan.root, piece_uses(every), buffer_sizes(every))
    direct = 0
    try:
        for chunk in every:
            view = _read_direct(chunk, reader)
            direct += view is not None
            got = build(chunk, reader) if view is None else _as_tensor(view, chunk)
            got_bytes = got.reshape(-1).view(torch.uint8).clone()
            got_shape, got_dtype = got.shape, got.dtype
            built = build(chunk, reader)
            assert (got_shape, got_dtype) == (built.shape, built.dtype), chunk.target.name
            assert torch.equal(got_bytes, built.reshape(-1).view(torch.uint8)), chunk.target.name
    finally:
        reader.close()
    assert direct == len(TENSORS) - 1  # every non-empty tensor took the direct read


def test_fold_matches_values_computed_whole(tmp_path: Path) -> None:
    plan = prepare(_source(tmp_path)).plan
    stats = {s.name: s for s in fold(plan, Statistics)}
    prints = dict(zip((t.name for t in plan.targets), fold(plan, Fingerprint)))
    for name, tensor in TENSORS.items():
        t = next(t for t in plan.targets if t.name == name)
        digest = hashlib.sha256(f"{t.dtype}{list(t.shape)}\n".encode())
        digest.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
        assert prints[name] == stats[name].fingerprint == digest.hexdigest()
        s = stats[name]
        if not tensor.is_floating_point() or not tensor.numel():
            assert (s.rms, s.mean, s.min, s.max, s.nan, s.inf) == (None, None, None, None, 0, 0)
            continue
        x = tensor.double().reshape(-1)
        finite = x[torch.isfinite(x)]
        assert (s.nan, s.inf) == (int(torch.isnan(x).sum()), int(torch.isinf(x).sum()))
        assert s.min == float(finite.min()) and s.max == float(finite.max())
        assert s.mean == pytest.approx(float(finite.mean()), rel=1e-6)
        assert s.rms == pytest.approx(math.sqrt(float((finite * finite).mean())), rel=1e-6)


def test_blocks_cut_large_tensors_and_keep_small_ones_whole() -> None:
    small = torch.arange(12.0).reshape(3, 4)
    assert [b.tolist() for b in blocks(small)] == [list(range(12))]
    assert list(blocks(torch.zeros(0))) == []
    column = torch.arange(12.0).reshape(4, 3)[:, 1]  # not contiguous: a contiguous copy
    (only,) = blocks(column)
    assert only.is_contiguous() and only.tolist() == [1.0, 4.0, 7.0, 10.0]
    large = torch.arange(BLOCK_ELEMENTS + 5, dtype=torch.int32)
    assert [b.numel() for b in blocks(large)] == [BLOCK_ELEMENTS, 5]


NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float64: "F64", torch.uint8: "U8"}


def _scale_check(values: torch.Tensor, as_bytes: bool) -> dict[str, int]:
    """The counts of a scale check given ``values`` as a tensor, or as the bytes a direct read gives."""
    dtype = NAMES[values.dtype]
    check = ScaleCheck(Target("w_scale", tuple(values.shape), dtype, dtype, (), ()))
    if as_bytes:
        check.add_bytes(memoryview(bytearray(values.reshape(-1).view(torch.uint8).numpy().tobytes())))
    else:
        check.add(values)
    assert check.total == values.numel()
    return check.counts


@pytest.mark.parametrize("values", [
    [0.5, 2.0, 3.0], [0.5, float("nan")], [float("inf"), 1.0], [float("-inf"), 1.0], [0.0, 1.0], [-0.0, 1.0],
    [-1e-30, 1.0], [float("nan"), float("inf"), 0.0, -2.0, 1.0], [3.4e38, 1e-45],
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_scale_check_counts_as_the_full_count(values: list[float], dtype: torch.dtype, as_bytes: bool) -> None:
    x = torch.tensor(values, dtype=dtype)
    y = x.float()
    expected = {"NaN": int(torch.isnan(y).sum()), "infinite": int(torch.isinf(y).sum()),
                "zero": int((y == 0).sum()), "negative": int((y < 0).sum())}
    assert _scale_check(x, as_bytes) == expected


@pytest.mark.parametrize("values", [[0, 127, 254], [255, 3, 255], [255]])
@pytest.mark.parametrize("as_bytes", [False, True])
def test_scale_check_counts_e8m0_nan_bytes(values: list[int], as_bytes: bool) -> None:
    counts = _scale_check(torch.tensor(values, dtype=torch.uint8), as_bytes)
    assert counts == {"NaN": values.count(255), "infinite": 0, "zero": 0, "negative": 0}
