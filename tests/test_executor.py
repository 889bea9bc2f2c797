"""The streaming executor writes exactly what the reference executor assembles, tensor for tensor, on every
fixture, with chunks small enough to cut every tensor into many row runs, on one thread and on several."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpttool
from ckpttool.errors import SourceError
from ckpttool.execute.reference import PieceLoader, assemble
from ckpttool.layout.layout import RAW, TORCH_SAVE, Box, Piece
from ckpttool.plan.plan import Plan
from ckpttool.io.safetensors_format import encode_header
from ckpttool.execute.reads import Reader
from ckpttool.execute.buffers import chunks, piece_uses
from ckpttool.execute.executor import file_digest, write_file
from conftest import FIXTURE_NAMES, fixture_dir


def stream(plan: Plan, path: Path, chunk_bytes: int, workers: int) -> str:
    prefix, offsets = encode_header({t.name: (t.dtype, t.shape) for t in plan.targets}, {"format": "pt"})
    chunk_list = [c for t in plan.targets for c in chunks(t, offsets[t.name][0], chunk_bytes)]
    reader = Reader(plan.root, piece_uses(chunk_list))
    try:
        digest = write_file(path, prefix, chunk_list, reader, workers)
    finally:
        reader.close()
    assert file_digest(path, len(prefix), [c.nbytes for c in chunk_list]) == digest
    return digest


def assert_same_as_reference_executor(plan: Plan, path: Path) -> None:
    written = load_file(path)
    loader = PieceLoader(plan.root)
    for target in plan.targets:
        assert torch.equal(written[target.name], assemble(target, loader)), target.name


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize(("chunk_bytes", "workers"), [(200, 1), (1000, 3), (2**25, 2)])
def test_every_fixture_streams_to_what_the_reference_executor_assembles(name, chunk_bytes, workers, tmp_path):
    plan = ckpttool.prepare(fixture_dir(name) / "checkpoint").plan
    stream(plan, tmp_path / "out.safetensors", chunk_bytes, workers)
    assert_same_as_reference_executor(plan, tmp_path / "out.safetensors")


def test_cast_while_streaming(tmp_path):
    plan = ckpttool.prepare(fixture_dir("llama_tp2_fsdp2_dcp") / "checkpoint", dtype="bfloat16").plan
    stream(plan, tmp_path / "out.safetensors", 500, 2)
    written = load_file(tmp_path / "out.safetensors")
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    assert_same_as_reference_executor(plan, tmp_path / "out.safetensors")


def test_a_piece_that_stays_a_torch_save_archive(tmp_path):
    """A DCP item the locator cannot place (here: a transposed view) is loaded whole and streamed all the same."""
    import warnings

    import torch.distributed.checkpoint as dcp

    weight = torch.arange(48.0).reshape(6, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"w": weight.t().contiguous().t(), "v": torch.arange(6.0)}, checkpoint_id=str(tmp_path / "ckpt"))
    layout = ckpttool.read_layout(tmp_path / "ckpt")
    assert {p.encoding for t in layout.tensors.values() for p in t.pieces} == {TORCH_SAVE, RAW}
    plan = ckpttool.plan_merge(layout)
    stream(plan, tmp_path / "out.safetensors", 40, 2)
    assert torch.equal(load_file(tmp_path / "out.safetensors")["w"], weight)


def test_reading_a_missing_file_names_it(tmp_path):
    reader = Reader(tmp_path, Counter())
    piece = Piece("gone.safetensors", "w", Box((0,), (4,)), "F32", RAW, 0, 16)
    with pytest.raises(SourceError, match=r"^'gone.safetensors': cannot read: No such file or directory$"):
        reader.region(piece, piece.box, (4,), (0,))


def test_reading_past_the_end_names_the_truncation(tmp_path):
    (tmp_path / "short.bin").write_bytes(bytes(10))
    reader = Reader(tmp_path, Counter())
    piece = Piece("short.bin", "w", Box((0,), (4,)), "F32", RAW, 0, 16)
    with pytest.raises(SourceError, match=r"^'short.bin': 'w' needs 16 bytes at offset 0 but only 10 are there; the file is truncated$"):
        reader.region(piece, piece.box, (4,), (0,))
    reader.close()


def test_fused_parts_split_along_columns(tmp_path):
    """Each part of a tensor fused along dim 1 is a column slice of one piece: a strided region."""
    from ckpttool.layout.layout import Fusion
    from ckpttool.io.sidecar import PieceSpec, save_shard

    full = torch.arange(6 * 7, dtype=torch.float32).reshape(6, 7)
    fusion = Fusion(1, (("gate", 2), ("up", 5)))
    for rank in range(2):
        spec = PieceSpec.split((6, 7), dim=0, index=rank, count=2, fusion=fusion)
        save_shard({"gate_up": full[3 * rank:3 * rank + 3]}, {"gate_up": spec}, tmp_path / "ckpt", rank=rank, world_size=2)
    plan = ckpttool.prepare(tmp_path / "ckpt").plan
    stream(plan, tmp_path / "out.safetensors", 16, 2)  # 2 rows of gate per chunk: a (2, 2) view of (3, 7) rows
    written = load_file(tmp_path / "out.safetensors")
    assert torch.equal(written["gate"], full[:, :2]) and torch.equal(written["up"], full[:, 2:])


def test_a_file_system_without_preallocation(tmp_path, monkeypatch):
    import errno
    import os

    def unsupported(fd, offset, length):
        raise OSError(errno.EOPNOTSUPP, os.strerror(errno.EOPNOTSUPP))

    monkeypatch.setattr(os, "posix_fallocate", unsupported)
    result = ckpttool.merge(fixture_dir("llama_tp2_dcp") / "checkpoint", tmp_path / "hf")
    assert result.files and (tmp_path / "hf" / "model.safetensors").is_file()
