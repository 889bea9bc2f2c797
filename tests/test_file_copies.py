"""Chunks copied file to file (``copy_file_range``) keep the merge's bytes and its checks: the output is what the
reference executor assembles, file systems that cannot copy so get the same bytes through buffers, a truncated
source is named, and the digest of a copied chunk, computed again on ``--resume`` and ``--verify``, compares it
with its source, so a damaged copy is caught. A journal whose digests were made another way is never trusted."""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpttool
import ckpttool.execute.copies as copies
from ckpttool.execute.digest import FromSource, checks
from ckpttool.execute.reads import Reader
from ckpttool.execute.buffers import buffer_sizes, chunks, piece_uses
from ckpttool.execute.executor import file_digest, write_file
from ckpttool.plan.plan import Plan
from ckpttool.execute.reference import PieceLoader, assemble
from ckpttool.errors import OutputError, SourceError
from ckpttool.io.safetensors_format import encode_header
from ckpttool.writers.journal import JOURNAL_VERSION
from ckpttool.writers.destination import journal_name
from conftest import FIXTURE_NAMES, fixture_dir, load_output

FIXTURE = "llama_tp2_dcp"  # tensors split on dim 0 (copied file to file) and on dim 1 (built)
SHARD = "60KB"


@pytest.fixture
def copy_small(monkeypatch):
    """Every chunk that can be copied file to file is, however small (the fixtures' tensors are a few KiB)."""
    monkeypatch.setattr(copies, "COPY_BYTES", 1)


@pytest.fixture
def copy_calls(monkeypatch):
    calls: list[int] = []
    real = os.copy_file_range

    def counted(src, dst, count, offset_src=None, offset_dst=None):
        calls.append(count)
        return real(src, dst, count, offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", counted)
    return calls


def stream(plan: Plan, path: Path, workers: int = 2, chunk_bytes: int = 2**25) -> tuple[str, list]:
    """Write the plan's targets to ``path``; the digest, checked against the one computed again from the file."""
    prefix, offsets = encode_header({t.name: (t.dtype, t.shape) for t in plan.targets}, {"format": "pt"})
    chunk_list = [c for t in plan.targets for c in chunks(t, offsets[t.name][0], chunk_bytes)]
    reader = Reader(plan.root, piece_uses(chunk_list), buffer_sizes(chunk_list))
    try:
        digest = write_file(path, prefix, chunk_list, reader, workers)
        found = checks(chunk_list, reader)
        assert file_digest(path, len(prefix), found) == digest
    finally:
        reader.close()
    return digest, found


def assert_is_what_the_reference_assembles(plan: Plan, path: Path) -> None:
    written, loader = load_file(path), PieceLoader(plan.root)
    for target in plan.targets:
        assert torch.equal(written[target.name], assemble(target, loader)), target.name


@pytest.mark.parametrize("name", FIXTURE_NAMES)
@pytest.mark.parametrize("chunk_bytes", [200, 2**25])
def test_every_fixture_copied_file_to_file_is_what_the_reference_assembles(name, chunk_bytes, tmp_path, copy_small, copy_calls):
    plan = ckpttool.prepare(fixture_dir(name) / "checkpoint").plan
    _, found = stream(plan, tmp_path / "out.safetensors", chunk_bytes=chunk_bytes)
    copied = [c for c in found if isinstance(c, FromSource)]
    assert copied and copy_calls, "no chunk was copied file to file"
    assert len(copy_calls) >= sum(len(c.spans) for c in copied)
    assert_is_what_the_reference_assembles(plan, tmp_path / "out.safetensors")


def test_small_chunks_and_conversions_are_not_copied(tmp_path, monkeypatch, copy_calls):
    plan = ckpttool.prepare(fixture_dir(FIXTURE) / "checkpoint").plan
    _, found = stream(plan, tmp_path / "a.safetensors")  # the fixture's chunks are under COPY_BYTES
    assert copy_calls == [] and all(isinstance(c, int) for c in found)
    monkeypatch.setattr(copies, "COPY_BYTES", 1)
    cast = ckpttool.prepare(fixture_dir(FIXTURE) / "checkpoint", dtype="bfloat16").plan
    _, found = stream(cast, tmp_path / "b.safetensors")
    assert copy_calls == [] and all(isinstance(c, int) for c in found)


@pytest.mark.parametrize("refusal", [errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL])
def test_a_file_system_that_cannot_copy_gets_the_same_bytes_through_buffers(tmp_path, monkeypatch, copy_small, refusal):
    plan = ckpttool.prepare(fixture_dir(FIXTURE) / "checkpoint").plan
    digest, _ = stream(plan, tmp_path / "copied.safetensors")
    calls = []

    def refuse(*args):
        calls.append(args)
        raise OSError(refusal, os.strerror(refusal))

    monkeypatch.setattr(os, "copy_file_range", refuse)
    assert stream(plan, tmp_path / "buffered.safetensors", workers=1)[0] == digest
    assert len(calls) == 1, "copy_file_range was tried again after a refusal"
    assert (tmp_path / "copied.safetensors").read_bytes() == (tmp_path / "buffered.safetensors").read_bytes()


def test_a_copy_that_stops_short_is_finished_through_buffers(tmp_path, monkeypatch, copy_small):
    plan = ckpttool.prepare(fixture_dir(FIXTURE) / "checkpoint").plan
    real = os.copy_file_range

    def one_byte_then_failing(src, dst, count, offset_src, offset_dst):
        if count > 1:  # the rest of this span fails, as an I/O error would
            real(src, dst, 1, offset_src, offset_dst)
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return real(src, dst, count, offset_src, offset_dst)

    monkeypatch.setattr(os, "copy_file_range", one_byte_then_failing)
    stream(plan, tmp_path / "out.safetensors")
    assert_is_what_the_reference_assembles(plan, tmp_path / "out.safetensors")


def test_a_truncated_source_is_named_on_the_copy_path(tmp_path, copy_small):
    src = tmp_path / "src"
    shutil.copytree(fixture_dir(FIXTURE) / "checkpoint", src)
    plan = ckpttool.prepare(src).plan
    chunk = next(c for t in plan.targets for c in chunks(t, 0) if copies.copied(c) and len(t.copies) == 2)
    piece, start, _, nbytes = max(copies.copied(chunk), key=lambda span: span[1])  # the later one in its file
    os.truncate(src / piece.file, start + 4)
    reader = Reader(src, piece_uses([chunk]), buffer_sizes([chunk]))
    with pytest.raises(SourceError) as excinfo:
        write_file(tmp_path / "out.safetensors", b"", [chunk], reader)
    reader.close()
    assert str(excinfo.value) == (f"'{piece.file}': '{piece.key}' needs {nbytes - 4} bytes at offset {start + 4} but "
                                  "only 0 are there; the file is truncated")


def test_a_copied_chunk_is_checked_against_its_source(tmp_path, copy_small):
    plan = ckpttool.prepare(fixture_dir(FIXTURE) / "checkpoint").plan
    path = tmp_path / "out.safetensors"
    digest, found = stream(plan, path)
    prefix_len = path.stat().st_size - plan.nbytes
    at, first = prefix_len, None
    for check in found:
        if isinstance(check, FromSource):
            first = at
            break
        at += check
    assert first is not None
    data = bytearray(path.read_bytes())
    data[first + 3] ^= 0x10
    path.write_bytes(bytes(data))
    assert file_digest(path, prefix_len, found) != digest
    data[first + 3] ^= 0x10
    path.write_bytes(bytes(data))
    assert file_digest(path, prefix_len, found) == digest


def test_the_token_of_a_copied_chunk_is_the_same_when_it_was_built(tmp_path, copy_small):
    """A writer that sees every chunk's bytes (DCP's CRC-32) builds the chunks it could copy: same digest."""
    plan = ckpttool.prepare(fixture_dir(FIXTURE) / "checkpoint").plan
    prefix, offsets = encode_header({t.name: (t.dtype, t.shape) for t in plan.targets}, {"format": "pt"})
    chunk_list = [c for t in plan.targets for c in chunks(t, offsets[t.name][0])]
    digests, seen = [], []
    for on_chunk in (None, lambda chunk, view: seen.append(chunk)):
        reader = Reader(plan.root, piece_uses(chunk_list), buffer_sizes(chunk_list))
        digests.append(write_file(tmp_path / f"{len(digests)}.safetensors", prefix, chunk_list, reader, 2, on_chunk=on_chunk))
        reader.close()
    assert digests[0] == digests[1] and len(seen) == len(chunk_list)
    assert (tmp_path / "0.safetensors").read_bytes() == (tmp_path / "1.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------- resume, verify


def _interrupted(tmp_path: Path) -> tuple[Path, Path, Path, list[str]]:
    src, out = fixture_dir(FIXTURE) / "checkpoint", tmp_path / "hf"
    done = 0

    def progress(written: int, total: int) -> None:
        nonlocal done
        done += written
        if done >= 260_000:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ckpttool.merge(src, out, max_shard_size=SHARD, progress=progress)
    [staging] = out.parent.glob(f".{out.name}.ckpttool-partial-*")
    finished = sorted(json.loads((staging / journal_name(0)).read_text())["files"])
    assert len(finished) >= 2
    return src, out, staging, finished


def assert_is_the_reference(out: Path) -> None:
    got, want = load_output(out), load_output(fixture_dir(FIXTURE) / "reference")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


def test_resume_keeps_copied_files_that_equal_their_source(tmp_path, copy_small, copy_calls):
    src, out, _, finished = _interrupted(tmp_path)
    assert copy_calls
    assert ckpttool.merge(src, out, max_shard_size=SHARD, resume=True).kept_files == len(finished)
    assert_is_the_reference(out)


def test_resume_rewrites_a_file_whose_copied_chunk_was_damaged(tmp_path, copy_small):
    src, out, staging, finished = _interrupted(tmp_path)
    plan = ckpttool.prepare(src).plan
    files = {f.name: f for f in ckpttool.writers.hf.assign_files(plan, SHARD)}
    from ckpttool.writers.hf import file_layout

    damaged = None
    for name in finished:
        prefix, chunk_list = file_layout(files[name])
        copied = [c for c in chunk_list if copies.copied(c)]
        if copied:
            damaged, at = staging / name, len(prefix) + copied[0].offset + 1
            break
    assert damaged is not None, "no finished file holds a copied chunk"
    data = bytearray(damaged.read_bytes())
    data[at] ^= 0x01  # one bit, in the middle of the file: no size or header check sees it
    damaged.write_bytes(bytes(data))
    result = ckpttool.merge(src, out, max_shard_size=SHARD, resume=True)
    assert result.kept_files == len(finished) - 1
    assert_is_the_reference(out)


@pytest.mark.parametrize("version", [1, JOURNAL_VERSION + 1, None])
def test_a_journal_of_another_digest_scheme_is_not_trusted(tmp_path, version):
    src, out, staging, finished = _interrupted(tmp_path)
    journal = staging / journal_name(0)
    doc = json.loads(journal.read_text())
    assert doc["version"] == JOURNAL_VERSION
    if version is None:
        del doc["version"]
    else:
        doc["version"] = version
    journal.write_text(json.dumps(doc))
    result = ckpttool.merge(src, out, max_shard_size=SHARD, resume=True)
    assert result.kept_files == 0
    assert_is_the_reference(out)


def test_verify_catches_a_copied_chunk_damaged_on_disk(tmp_path, monkeypatch, copy_small):
    real = ckpttool.execute.executor.write_file

    def write_then_damage(path, prefix, chunk_list, *args, **kwargs):
        digest = real(path, prefix, chunk_list, *args, **kwargs)
        chunk = next(c for c in chunk_list if copies.copied(c))
        with open(path, "r+b") as f:
            f.seek(len(prefix) + chunk.offset)
            first = f.read(1)
            f.seek(len(prefix) + chunk.offset)
            f.write(bytes([first[0] ^ 1]))
        return digest

    monkeypatch.setattr("ckpttool.writers.hf.stream_file", write_then_damage)
    with pytest.raises(OutputError, match=r"^'model.safetensors': read back from disk, its digest is "):
        ckpttool.merge(fixture_dir(FIXTURE) / "checkpoint", tmp_path / "hf", verify=True)
    assert not (tmp_path / "hf").exists()


def test_verify_passes_when_copied_chunks_are_sound(tmp_path, copy_small, copy_calls):
    ckpttool.merge(fixture_dir(FIXTURE) / "checkpoint", tmp_path / "hf", max_shard_size=SHARD, verify=True)
    assert copy_calls
    assert_is_the_reference(tmp_path / "hf")



def test_threads_copy_into_a_file_one_at_a_time_with_their_sources_read_ahead(tmp_path, monkeypatch, copy_small):
    """A thread waiting for the file's lock in the kernel spins: the copies into one file take turns, and each
    thread has its sources read ahead before its turn."""
    import threading
    import time

    plan = ckpttool.prepare(fixture_dir("mixtral_fsdp2_dcp") / "checkpoint").plan
    real, active, most, events = os.copy_file_range, [0], [0], []
    guard = threading.Lock()

    def slow(src, dst, count, offset_src, offset_dst):
        with guard:
            active[0] += 1
            most[0] = max(most[0], active[0])
            events.append(("copy", src, offset_src))
        time.sleep(0.002)  # long enough for another thread to come in, were it let in
        try:
            return real(src, dst, count, offset_src, offset_dst)
        finally:
            with guard:
                active[0] -= 1

    real_fadvise = os.posix_fadvise

    def fadvise(fd, offset, length, advice):
        if advice == os.POSIX_FADV_WILLNEED:
            with guard:
                events.append(("ahead", fd, offset))
        return real_fadvise(fd, offset, length, advice)

    monkeypatch.setattr(os, "copy_file_range", slow)
    monkeypatch.setattr(os, "posix_fadvise", fadvise)
    stream(plan, tmp_path / "out.safetensors", workers=3, chunk_bytes=300)
    copied = [e for e in events if e[0] == "copy"]
    assert len(copied) > 10 and most[0] == 1
    for _, fd, offset in copied:
        assert ("ahead", fd, offset) in events[:events.index(("copy", fd, offset))]
    assert_is_what_the_reference_assembles(plan, tmp_path / "out.safetensors")


def test_thread_buffers_are_maps_made_once_at_their_predicted_size(tmp_path):
    """An anonymous map is zero pages until written: a thread that copies file to file, or reads a few small
    tensors, touches only what it uses of its buffers (a bytearray writes all of them)."""
    import mmap

    plan = ckpttool.prepare(fixture_dir(FIXTURE) / "checkpoint").plan
    chunk_list = [c for t in plan.targets for c in chunks(t, 0, 200)]
    sizes = buffer_sizes(chunk_list)
    reader = Reader(plan.root, piece_uses(chunk_list), sizes)
    try:
        write_file(tmp_path / "out.safetensors", b"", chunk_list, reader)
        buffers = reader._local.buffers
        assert set(buffers) <= set(sizes) and "read" in buffers
        for name, buffer in buffers.items():
            assert isinstance(buffer, mmap.mmap) and len(buffer) == sizes[name], name
        first = buffers["read"]
        reader.run_buffer(10)
        assert reader._local.buffers["read"] is first  # not made again for a smaller use
        reader.run_buffer(len(first) + 1)
        assert len(reader._local.buffers["read"]) == len(first) + 1
    finally:
        reader.close()
