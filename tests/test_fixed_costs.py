"""The per-tensor shortcuts of a merge keep its bytes and its checks: tensors copied whole go straight from their
file into place in runs written at once, threads take chunks in batches, and the header written is compared
with the file byte for byte instead of being parsed again, yet a damaged or short output still fails."""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpttool
import ckpttool.execute.assembly as assembly
import ckpttool.execute.executor as executor
from ckpttool.execute.reads import Reader
from ckpttool.execute.buffers import CHUNK_BYTES, Chunk, buffer_sizes, chunks, piece_uses
from ckpttool.execute.executor import file_digest, write_file
from ckpttool.plan.plan import Plan
from ckpttool.errors import OutputError, SourceError
from ckpttool.io.safetensors_format import encode_header
from conftest import fixture_dir, load_output


def many_small_tensors(root: Path) -> dict[str, torch.Tensor]:
    """An HF checkpoint of 60 small tensors of several dtypes (a scalar among them) and one of 16 KiB (the read
    buffer's size, so a run holds many small ones), over 3 files."""
    g = torch.Generator().manual_seed(7)
    tensors: dict[str, torch.Tensor] = {}
    for i in range(20):
        tensors[f"layers.{i}.w"] = torch.randn(3 + i % 4, 5, generator=g)
        tensors[f"layers.{i}.b"] = torch.randn(7, generator=g)
        tensors[f"layers.{i}.n"] = torch.arange(i, i + 3 + i % 2, dtype=torch.int64 if i % 3 else torch.int32)
    tensors["scale"] = torch.tensor(2.5)
    tensors["embed.weight"] = torch.randn(64, 64, generator=g)
    root.mkdir()
    names = sorted(tensors)
    weight_map = {}
    for k in range(3):
        part = {n: tensors[n] for n in names[k::3]}
        save_file(part, str(root / f"model-0000{k + 1}-of-00003.safetensors"), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, f"model-0000{k + 1}-of-00003.safetensors"))
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return tensors


def stream(plan: Plan, path: Path, workers: int, chunk_bytes: int = CHUNK_BYTES) -> str:
    prefix, offsets = encode_header({t.name: (t.dtype, t.shape) for t in plan.targets}, {"format": "pt"})
    chunk_list = [c for t in plan.targets for c in chunks(t, offsets[t.name][0], chunk_bytes)]
    reader = Reader(plan.root, piece_uses(chunk_list), buffer_sizes(chunk_list))
    try:
        digest = write_file(path, prefix, chunk_list, reader, workers)
    finally:
        reader.close()
    assert file_digest(path, len(prefix), [c.nbytes for c in chunk_list]) == digest
    return digest


@pytest.mark.parametrize("workers", [1, 3])
def test_tensors_copied_whole_are_written_in_runs_with_their_exact_bytes(tmp_path, monkeypatch, workers):
    tensors = many_small_tensors(tmp_path / "src")
    plan = ckpttool.prepare(tmp_path / "src").plan
    writes = []
    real = os.pwrite
    monkeypatch.setattr(os, "pwrite", lambda fd, data, offset: writes.append(len(data)) or real(fd, data, offset))
    stream(plan, tmp_path / "out.safetensors", workers)
    written = load_file(tmp_path / "out.safetensors")
    assert set(written) == set(tensors)
    for name, tensor in tensors.items():
        assert written[name].dtype == tensor.dtype and torch.equal(written[name], tensor), name
    # the header, then runs of many tensors each (at most the read buffer, 16 KiB): far fewer writes than tensors
    assert 1 < len(writes) <= 6 and max(writes) <= 64 * 64 * 4, writes


def test_direct_runs_and_built_chunks_mix_in_small_batches(tmp_path, monkeypatch):
    """Batches of 3 chunks on 3 threads, chunks of 40 bytes: split tensors (built) and whole ones (direct)."""
    monkeypatch.setattr(executor, "BATCH_CHUNKS", 3)
    src = fixture_dir("llama_tp2_dcp") / "checkpoint"
    plan = ckpttool.prepare(src).plan
    stream(plan, tmp_path / "a.safetensors", 3, chunk_bytes=40)
    stream(plan, tmp_path / "b.safetensors", 1)
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()
    reference = load_output(fixture_dir("llama_tp2_dcp") / "reference")
    written = load_file(tmp_path / "a.safetensors")
    assert all(torch.equal(written[k], reference[k]) for k in reference)


def test_batches_cut_by_bytes_and_by_count(monkeypatch):
    plan = ckpttool.prepare(fixture_dir("llama_tp2_dcp") / "checkpoint").plan
    chunk_list = [c for t in plan.targets for c in chunks(t, 0, 64)]
    monkeypatch.setattr(executor, "BATCH_CHUNKS", 5)
    monkeypatch.setattr(executor, "BATCH_BYTES", 200)
    batches = executor._batches(chunk_list)
    assert [c for b in batches for c in b] == chunk_list
    assert all(len(b) == 1 or (len(b) <= 5 and sum(c.nbytes for c in b) <= 200) for b in batches)
    assert max(len(b) for b in batches) > 1


def test_a_truncated_source_is_named_on_the_direct_path(tmp_path):
    many_small_tensors(tmp_path / "src")
    plan = ckpttool.prepare(tmp_path / "src").plan
    target = next(t for t in plan.targets if t.name == "layers.9.w")
    piece = target.copies[0].piece
    assert assembly.direct_offset(chunks(target, 0)[0]) == piece.byte_offset
    os.truncate(tmp_path / "src" / piece.file, piece.byte_offset + 4)
    with pytest.raises(SourceError) as excinfo:
        stream(plan, tmp_path / "out.safetensors", 1)
    assert str(excinfo.value) == (
        f"'{piece.file}': 'layers.9.w' needs {target.nbytes} bytes at offset {piece.byte_offset} but only 4 are "
        "there; the file is truncated"
    )


def test_only_a_target_copied_whole_in_its_own_dtype_is_direct():
    src = fixture_dir("llama_tp2_dcp") / "checkpoint"
    same = {t.name: t for t in ckpttool.prepare(src).plan.targets}
    cast = {t.name: t for t in ckpttool.prepare(src, dtype="bfloat16").plan.targets}
    split = [n for n, t in same.items() if len(t.copies) > 1]
    whole = [n for n, t in same.items() if len(t.copies) == 1 and t.copies[0].dst.sizes == t.shape]
    assert split and whole
    assert all(assembly.direct_offset(chunks(same[n], 0)[0]) is None for n in split)
    assert all(assembly.direct_offset(chunks(same[n], 0)[0]) is not None for n in whole)
    assert all(assembly.direct_offset(chunks(cast[n], 0)[0]) is None for n in whole)


def test_a_small_tensor_is_one_chunk_and_a_larger_one_is_cut_as_before():
    target = ckpttool.prepare(fixture_dir("llama_tp2_dcp") / "checkpoint").plan.targets[0]
    row = target.nbytes // target.shape[0]
    assert chunks(target, 100, target.nbytes) == [Chunk(target, 0, target.shape[0], 100, target.nbytes)]
    cut = chunks(target, 100, target.nbytes - 1)
    per = (target.nbytes - 1) // row
    assert [(c.start, c.stop, c.offset) for c in cut] == [
        (a, min(a + per, target.shape[0]), 100 + a * row) for a in range(0, target.shape[0], per)]


def test_pieces_of_raw_bytes_are_not_counted_as_archives():
    plan = ckpttool.prepare(fixture_dir("llama_tp2_dcp") / "checkpoint").plan
    chunk_list = [c for t in plan.targets for c in chunks(t, 0, 64)]
    assert all(c.piece.encoding == "raw" for t in plan.targets for c in t.copies)
    assert piece_uses(chunk_list) == Counter()


# ------------------------------------------------------------------------------- the written file is checked


def _after_write(monkeypatch, damage) -> None:
    """Run ``damage(path)`` on each output file once the executor has written it."""
    import ckpttool.writers.hf

    real = ckpttool.writers.hf.stream_file

    def write_file(path, *args, **kwargs):
        digest = real(path, *args, **kwargs)
        damage(path)
        return digest

    monkeypatch.setattr(ckpttool.writers.hf, "stream_file", write_file)


def test_a_header_changed_on_disk_where_no_parse_would_see_it_fails(tmp_path, monkeypatch):
    """The same names, dtypes and shapes, but the metadata differs: only the byte comparison catches it."""

    def change_metadata(path):
        raw = path.read_bytes()
        assert raw.count(b'"format":"pt"') == 1
        path.write_bytes(raw.replace(b'"format":"pt"', b'"format":"px"'))

    _after_write(monkeypatch, change_metadata)
    many_small_tensors(tmp_path / "src")
    out = tmp_path / "hf"
    with pytest.raises(OutputError) as excinfo:
        ckpttool.merge(tmp_path / "src", out, workers=2)
    assert str(excinfo.value) == (
        "'model.safetensors': its header on disk differs from the header written (offsets or metadata); the disk or "
        "file system corrupted it. Nothing was published"
    )
    assert not out.exists() and not list(tmp_path.glob(".hf.ckpttool-partial-*"))


def test_a_renamed_tensor_in_the_header_is_still_named(tmp_path, monkeypatch):
    def rename(path):
        raw = path.read_bytes()
        path.write_bytes(raw.replace(b'"layers.3.w"', b'"layers.3.x"'))

    _after_write(monkeypatch, rename)
    many_small_tensors(tmp_path / "src")
    with pytest.raises(OutputError, match=r"^'model.safetensors': 'layers.3.w' was not written as planned$"):
        ckpttool.merge(tmp_path / "src", tmp_path / "hf")


def test_a_short_output_of_many_small_tensors_still_fails(tmp_path, monkeypatch):
    sizes = {}

    def lose_the_tail(path):
        sizes[path.name] = path.stat().st_size
        os.truncate(path, sizes[path.name] - 3)

    _after_write(monkeypatch, lose_the_tail)
    many_small_tensors(tmp_path / "src")
    with pytest.raises(OutputError) as excinfo:
        ckpttool.merge(tmp_path / "src", tmp_path / "hf", workers=2)
    size = sizes["model.safetensors"]
    assert str(excinfo.value) == f"'model.safetensors': wrote {size - 3} bytes, expected {size}; is the disk full?"


def test_a_merge_of_many_small_tensors_equals_its_source_and_passes_its_audit(tmp_path):
    tensors = many_small_tensors(tmp_path / "src")
    result = ckpttool.merge(tmp_path / "src", tmp_path / "hf", workers=2, max_shard_size="1KB")
    assert len(result.files) > 3 and result.audit is not None and result.audit.ok
    written = load_output(tmp_path / "hf")
    assert all(written[n].dtype == t.dtype and torch.equal(written[n], t) for n, t in tensors.items())


def test_an_output_that_cannot_be_read_back_for_its_header_check_fails(tmp_path, monkeypatch):
    import ckpttool.writers.hf

    def unreadable(path, *args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(ckpttool.writers.hf, "open", unreadable, raising=False)
    many_small_tensors(tmp_path / "src")
    with pytest.raises(OutputError) as excinfo:
        ckpttool.merge(tmp_path / "src", tmp_path / "hf")
    assert str(excinfo.value) == "'model.safetensors': cannot read it back: Permission denied; nothing was published"
    assert not (tmp_path / "hf").exists()


# ------------------------------------------------------------------------------- write-back started early


def test_large_writes_have_their_write_back_started_as_they_are_written(tmp_path, monkeypatch):
    monkeypatch.setattr(executor, "WRITEBACK_BYTES", 1000)
    calls = []
    real = os.posix_fadvise
    monkeypatch.setattr(os, "posix_fadvise", lambda fd, offset, n, advice: calls.append((offset, n, advice)) or real(fd, offset, n, advice))
    plan = ckpttool.prepare(fixture_dir("llama_tp2_dcp") / "checkpoint").plan
    prefix, offsets = encode_header({t.name: (t.dtype, t.shape) for t in plan.targets}, {"format": "pt"})
    stream(plan, tmp_path / "out.safetensors", 1, chunk_bytes=4000)
    assert calls and all(n >= 1000 and advice == os.POSIX_FADV_DONTNEED for _, n, advice in calls)
    large = [c for t in plan.targets for c in chunks(t, offsets[t.name][0], 4000) if c.nbytes >= 1000]
    assert large
    for c in large:  # each large chunk lies in a range whose write-back was started
        start = len(prefix) + c.offset
        assert any(o <= start and start + c.nbytes <= o + n for o, n, _ in calls), c.target.name


def test_a_refused_write_back_hint_changes_nothing(tmp_path, monkeypatch):
    monkeypatch.setattr(executor, "WRITEBACK_BYTES", 1000)
    plan = ckpttool.prepare(fixture_dir("llama_tp2_dcp") / "checkpoint").plan
    expected = stream(plan, tmp_path / "a.safetensors", 2, chunk_bytes=4000)

    def refuse(fd, offset, n, advice):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(os, "posix_fadvise", refuse)
    assert stream(plan, tmp_path / "b.safetensors", 2, chunk_bytes=4000) == expected
    assert (tmp_path / "a.safetensors").read_bytes() == (tmp_path / "b.safetensors").read_bytes()


def test_a_row_run_copy_keeps_values_and_converts_between_dtypes():
    out = torch.zeros(3, 4, dtype=torch.bfloat16)
    assembly._place(out[:, 1:3], torch.arange(6, dtype=torch.bfloat16).reshape(3, 2))
    assert out.tolist() == [[0, 0, 1, 0], [0, 2, 3, 0], [0, 4, 5, 0]]
    half = torch.zeros(2, dtype=torch.float16)  # same size as bfloat16: a byte copy would be wrong
    assembly._place(half, torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    assert half.tolist() == [1.5, -2.0]
    scalar = torch.zeros((), dtype=torch.float32)  # no byte view of a zero-dim tensor: torch copies it
    assembly._place(scalar, torch.tensor(3.25))
    assert scalar.item() == 3.25
