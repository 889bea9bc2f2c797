"""``split --to dcp`` starts without torch (issue 31): the pickles it writes are written by hand, the same bytes.

- :func:`ckpttool.writers.torch_archive.tensor_pickle` (every item's ``archive/data.pkl``) equals what
  ``torch.save`` writes, for every dtype;
- :func:`ckpttool.writers.dcp.metadata_pickle` (``.metadata``) equals the pickle of torch's own ``Metadata``
  classes built from the same files, and torch's ``FileSystemReader`` reads it back as those objects;
- a row shard of a tensor is read straight from the source file (the executor's direct path), so a split whose
  chunks are all row shards (``--fsdp N``) with a warm description cache imports neither torch nor transformers,
  and writes what torch saved for that mesh.
"""

from __future__ import annotations

import io
import os
import pickle
import shutil
import subprocess
import sys
import zipfile
from collections import Counter
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader

import ckpttool
from ckpttool.errors import SourceError
from ckpttool.execute.assembly import direct_offset, direct_rows
from ckpttool.execute.buffers import chunks
from ckpttool.execute.reads import Reader
from ckpttool.io.dtypes import SAFETENSORS_DTYPES, torch_dtype
from ckpttool.layout.layout import Box, Piece
from ckpttool.plan.plan import Copy, Target
from ckpttool.writers import dcp
from ckpttool.writers.torch_archive import tensor_pickle
from ckpttool.writers.torch_globals import Call, Global, New, dumps
from conftest import assert_failed_cleanly, fixture_dir

LLAMA = fixture_dir("llama_fsdp2_dcp")


@pytest.mark.parametrize("dtype", sorted(SAFETENSORS_DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (3, 4), (2, 3, 5)], ids=str)
def test_a_tensor_pickle_is_the_one_torch_save_writes(dtype, shape):
    buffer = io.BytesIO()
    torch.save(torch.zeros(shape, dtype=torch_dtype(dtype)), buffer)
    assert tensor_pickle(dtype, shape) == zipfile.ZipFile(buffer).read("archive/data.pkl")


def test_the_stand_ins_pickle_as_what_they_name():
    point = New(Global("collections", "OrderedDict"), None)
    assert pickle.loads(dumps(Call(Global("builtins", "tuple"), ([2, 3],)))) == (2, 3)
    assert type(pickle.loads(dumps(point))).__name__ == "OrderedDict"
    assert b"cbuiltins\ntuple\n" in dumps(Call(Global("builtins", "tuple"), ((),)), protocol=2)


def _files() -> tuple[dcp.DcpFile, ...]:
    """Two ranks' files: three dtypes, row and column shards, a chunk one rank holds, enough chunks for the pickle
    to span several 64 KiB frames, and a bytes item."""
    per_rank: list[list] = [[], []]
    tensors = [(f"layers.{i}.{kind}", shape, dtype) for i in range(150)
               for kind, shape, dtype in (("w", (8, 6), "BF16"), ("b", (6,), "F32"), ("q", (4, 4), "F8_E4M3"))]
    for name, shape, dtype in tensors:
        for rank in range(2):
            if len(shape) == 1 and rank == 1:
                continue
            half = shape[0] // 2 if len(shape) == 1 else shape[1] // 2
            box = (Box((0,), shape) if len(shape) == 1 else
                   Box((rank * shape[0] // 2, 0), (shape[0] // 2, shape[1])) if name.endswith("w") else
                   Box((0, rank * half), (shape[0], half)))
            per_rank[rank].append((name, shape, box, Target(name, box.sizes, dtype, dtype, (), ())))
    extra = pickle.dumps([None], protocol=2)
    return dcp.lay_out(per_rank, [[("layers.0._extra_state", extra)], []])


def test_the_metadata_is_the_pickle_of_torchs_classes_and_torch_reads_it(tmp_path, monkeypatch):
    files = _files()
    want = dcp.torch_metadata(files)
    data = dcp.metadata_pickle(files)
    assert len(data) > 64 * 1024  # two frames at least
    assert data == pickle.dumps(want)
    monkeypatch.setattr(dcp, "HAND_PICKLED_CHUNKS", 10)  # a large checkpoint's: torch's classes, the same bytes
    assert dcp.metadata_pickle(files) == data
    dcp.write_metadata(files, tmp_path)
    got = FileSystemReader(str(tmp_path)).read_metadata()
    got.storage_meta.load_id = None  # the reader's own, drawn as it reads
    assert got == want


def test_a_row_shard_is_read_straight_from_its_file():
    piece = Piece("model.safetensors", "w", Box.whole((6, 4)), "BF16", byte_offset=1000)
    rows, columns = Box((2, 0), (3, 4)), Box((0, 1), (6, 3))
    shard, column_shard = (Target("w", box.sizes, "BF16", "BF16", (Copy(piece, box, Box.whole(box.sizes)),),
                                  ("model.safetensors",)) for box in (rows, columns))
    assert direct_offset(chunks(shard, 0)[0]) == 1000 + 2 * 4 * 2
    assert direct_offset(chunks(column_shard, 0)[0]) is None
    cast = Target("w", rows.sizes, "F32", "BF16", shard.copies, ("model.safetensors",))
    assert direct_offset(chunks(cast, 0)[0]) is None


@pytest.mark.usefixtures("describe_inline")
def test_split_to_dcp_with_a_warm_cache_imports_neither_torch_nor_transformers(tmp_path):
    ckpttool.split(LLAMA / "reference", dry_run=True, fsdp=4)  # warms this session's description cache
    out = tmp_path / "dcp"
    probe = ("import sys\nfrom ckpttool.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n"
             "    code = e.code\nprint('imported:', code, *(m for m in ('torch', 'transformers') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", probe, "split", str(LLAMA / "reference"), str(out), "--to", "dcp",
                           "--fsdp", "4", "-q"], capture_output=True, text=True, env=dict(os.environ), check=True)
    assert done.stdout.splitlines()[-1] == "imported: 0", done.stdout + done.stderr
    ckpttool.split(LLAMA / "reference", tmp_path / "in-process", fsdp=4)  # test_split: what torch saves for the mesh
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {
        p.name: p.read_bytes() for p in (tmp_path / "in-process").iterdir()}
    assert sorted(p.name for p in out.iterdir() if p.suffix in (".distcp", ".metadata") or p.name == ".metadata") == [
        ".metadata", "__0_0.distcp", "__1_0.distcp", "__2_0.distcp", "__3_0.distcp"]


def test_a_column_shard_is_read_row_by_row_into_place(tmp_path):
    data = bytes(range(6 * 4 * 2))
    (tmp_path / "model.safetensors").write_bytes(b"x" * 1000 + data)
    piece = Piece("model.safetensors", "w", Box.whole((6, 4)), "BF16", byte_offset=1000)
    box = Box((1, 1), (4, 2))
    target = Target("w", box.sizes, "BF16", "BF16", (Copy(piece, box, Box.whole(box.sizes)),), ("model.safetensors",))
    chunk = chunks(target, 0)[0]
    assert direct_rows(chunk) == (piece, 1000 + 1 * 8 + 1 * 2, 4, 8)
    reader = Reader(tmp_path, Counter(), {"read": 64})
    view = reader.run_buffer(chunk.nbytes)
    reader.read_rows(view, *direct_rows(chunk))
    assert bytes(view) == b"".join(data[r * 8 + 2:r * 8 + 6] for r in range(1, 5))
    os.truncate(tmp_path / "model.safetensors", 1000 + 30)
    with pytest.raises(SourceError) as excinfo:
        reader.read_rows(view, *direct_rows(chunk))
    assert str(excinfo.value) == ("'model.safetensors': 'w' needs 28 bytes at offset 1010 but only 20 are there; "
                                  "the file is truncated")
    reader.close()


def test_a_truncated_source_stops_the_split_and_leaves_nothing(cli, tmp_path):
    src = Path(shutil.copytree(LLAMA / "reference", tmp_path / "src"))
    before = {p.name: p.stat().st_size for p in src.iterdir()}
    weights = src / "model.safetensors"
    os.truncate(weights, weights.stat().st_size - 64)
    out = tmp_path / "out"
    result = cli("split", src, out, "--to", "dcp", "--tp", "2")
    assert_failed_cleanly(result, out, "'model.safetensors'", "the file is truncated")
    assert {p.name: p.stat().st_size for p in src.iterdir()} == {**before, "model.safetensors": before["model.safetensors"] - 64}
