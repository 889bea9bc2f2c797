"""The peak-memory prediction's buffer sizes: computed once per distinct chunk signature, the same as per chunk."""

from __future__ import annotations

import pytest
from conftest import FIXTURE_NAMES, fixture_dir
from test_quantized import DEEPSEEK, GPT_OSS, checkpoint

import ckpttool
from ckpttool.execute.buffers import _signature, buffer_sizes, chunks


def _varied_chunks() -> list:
    """Chunks of every fixture's targets (TP, FSDP, DCP, torch.save pieces, casts, padding) and of dequantized FP8
    and MXFP4 targets (scales, decoder scratch), at several chunk sizes: targets alike and unlike."""
    plans = [ckpttool.prepare(fixture_dir(name) / "checkpoint").plan for name in FIXTURE_NAMES]
    plans += [ckpttool.prepare(fixture_dir(name) / "checkpoint", dtype="float16").plan for name in FIXTURE_NAMES[:3]]
    plans += [ckpttool.prepare(checkpoint(name), dtype="bfloat16").plan for name in (DEEPSEEK, GPT_OSS)]
    every = []
    for plan in plans:
        for rows in (1, 3, None):
            every += [c for t in plan.targets for c in chunks(t, 0, chunk_bytes=200, rows=rows)]
    return every


def test_cached_buffer_sizes_equal_the_uncached_ones():
    every = _varied_chunks()
    assert len({_signature(c.target) for c in every}) < len({id(c.target) for c in every})  # some alike
    cached, uncached = buffer_sizes(every), buffer_sizes(every, cache=False)
    assert list(cached.items()) == list(uncached.items())
    assert {"read", "chunk", "cast", "scale"} <= set(cached)
    for start in range(0, len(every), 97):  # and on parts of it, where other targets give the largest
        part = every[start:start + 97]
        assert list(buffer_sizes(part).items()) == list(buffer_sizes(part, cache=False).items())


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_each_fixture_sized_alike_either_way(name):
    plan = ckpttool.prepare(fixture_dir(name) / "checkpoint").plan
    for rows in (1, None):
        every = [c for t in plan.targets for c in chunks(t, 0, chunk_bytes=100, rows=rows)]
        assert buffer_sizes(every) == buffer_sizes(every, cache=False)


def test_targets_alike_but_for_their_pieces_are_sized_apart():
    """Two targets with the same boxes, one read from a wider piece (a longer strided read) and one from a piece in
    another dtype: the signature tells them apart, so the cache gives what each chunk needs."""
    from ckpttool.layout.layout import Box, Piece
    from ckpttool.plan.tiling import Copy
    from ckpttool.plan.plan import Target

    box = Box((0, 0), (4, 8))

    def target(name: str, piece_sizes: tuple[int, int], dtype: str = "F32") -> Target:
        piece = Piece(f"{name}.safetensors", name, Box((0, 0), piece_sizes), dtype)
        return Target(name, (4, 8), "F32", dtype, (Copy(piece, box, box),), (piece.file,))

    for alike in ([target("a", (4, 8)), target("b", (4, 64))], [target("a", (4, 8)), target("b", (4, 8), "F64")]):
        every = [c for t in alike for c in chunks(t, 0, rows=2)]
        assert buffer_sizes(every) == buffer_sizes(every, cache=False) != buffer_sizes(every[:2], cache=False)
