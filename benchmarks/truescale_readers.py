#!/usr/bin/env python
"""True-scale dry runs of the readers other than HF safetensors at ~90k pieces: ckpttool's sidecar format and
PyTorch Distributed Checkpoint.

DeepSeek-V3-671B's BF16 model (``truescale.config(bf16=True)``: its real names and shapes, 46k tensors) cut for 8
ranks: every 2-D tensor in two along dim 0 (a TP pair: ranks ``2g`` and ``2g + 1``, the pair ``g`` chosen
round-robin by tensor), every 1-D tensor held whole by one rank: ~90k pieces, written two ways:

- ``sidecar``: each rank file a real safetensors header followed by a hole (``os.truncate``) for its data, with
  its real ``*.ckpttool.json`` sidecar (38 MB on disk);
- ``torch_dist``: Megatron-Core's, at ``--mesh`` (TP 2, PP 1, EP 8 by default: ~90k items), made from the
  sparse BF16 HF release by ``split --to megatron --dry-run``'s plan, its items as below;
- ``dcp``: ``.metadata`` pickled from torch's own DCP classes, and 8 ``__R_0.distcp`` files, each item the
  ``torch.save`` archive torch writes (``ckpttool.writers.torch_archive``: zip records, pickle, alignment, CRCs)
  with its data record a hole (~540 MB on disk: each item's records take a file-system block or two).

Nothing reads the data: ``merge --dry-run`` and ``audit --no-data`` read headers, metadata and sidecars only.

Each command runs in a fresh process twice (``many_tensors_bench.timed``: wall, CPU, peak RSS): first with an
empty description cache (``CKPTTOOL_CACHE``), then with the cache it left.

    python benchmarks/truescale_readers.py [--workdir /tmp/ckpttool-truescale-readers] [--keep] [--layers 61] [--mesh 2 1 8]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import shutil
import struct
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from many_tensors_bench import release  # noqa: E402  (this folder is no package)
from truescale import ITEMSIZE, claim_workdir, inside_workdir, config, generate, measure  # noqa: E402

from ckpttool.writers.torch_archive import TensorArchive, crc32_combine  # noqa: E402

RANKS = 8


def _write_rank(path: Path, pieces: list[tuple[str, str, tuple[int, ...]]]) -> None:
    """A safetensors file of ``pieces`` (key, dtype, shape): a real header, the data a hole."""
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for key, dtype, shape in pieces:
        n = ITEMSIZE[dtype]
        for d in shape:
            n *= d
        header[key] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
    os.truncate(path, 8 + len(raw) + offset)


def generate_sidecar(root: Path, cfg: dict, ranks: int = RANKS) -> dict:
    """Write ``cfg``'s model as ``ranks`` sparse rank files with their sidecars into ``root`` (a new directory).
    Returns ``{"tensors", "pieces", "files", "apparent_bytes", "disk_bytes"}``."""
    tensors = release(cfg)
    per_rank: list[list[dict]] = [[] for _ in range(ranks)]
    for i, name in enumerate(sorted(tensors)):
        dtype, shape = tensors[name]
        pair = i % (ranks // 2)
        if len(shape) == 2 and shape[0] % 2 == 0:
            half = shape[0] // 2
            for tp in range(2):
                per_rank[2 * pair + tp].append({
                    "fqn": name, "key": name, "global_shape": list(shape), "offsets": [tp * half, 0],
                    "sizes": [half, shape[1]], "dtype": dtype, "tp_rank": tp})
        else:
            per_rank[2 * pair].append({"fqn": name, "key": name, "global_shape": list(shape),
                                       "offsets": [0] * len(shape), "sizes": list(shape), "dtype": dtype})
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    for rank, pieces in enumerate(per_rank):
        base = f"rank-{rank:05d}-of-{ranks:05d}"
        _write_rank(root / f"{base}.safetensors", [(p["key"], p["dtype"], tuple(p["sizes"])) for p in pieces])
        doc = {"format": "ckpttool-sidecar", "version": 1, "rank": rank, "world_size": ranks,
               "file": f"{base}.safetensors", "pieces": pieces}
        (root / f"{base}.ckpttool.json").write_text(json.dumps(doc, indent=1))
    paths = list(root.iterdir())
    return {"tensors": len(tensors), "pieces": sum(map(len, per_rank)), "files": ranks,
            "apparent_bytes": sum(p.stat().st_size for p in paths),
            "disk_bytes": sum(p.stat().st_blocks * 512 for p in paths)}


# ---- PyTorch Distributed Checkpoint: ``.metadata`` (torch's own classes, pickled as DCP pickles them) and
# ``__R_0.distcp`` files, each item the torch.save archive torch writes (ckpttool's split writes the same bytes:
# ckpttool.writers.torch_archive), its data record a hole


@functools.lru_cache(maxsize=None)
def _zeros_crc(n: int) -> int:
    """zlib.crc32 of ``n`` zero bytes (what a hole reads as) without reading them: by halves, with crc32_combine."""
    if n <= 1 << 16:
        return zlib.crc32(bytes(n))
    half = _zeros_crc(n // 2)
    whole = crc32_combine(half, half, n // 2)
    return crc32_combine(whole, zlib.crc32(b"\0"), 1) if n % 2 else whole


def generate_dcp(root: Path, cfg: dict, ranks: int = RANKS) -> dict:
    """Write ``cfg``'s model as a DCP checkpoint of ``ranks`` sparse ``__R_0.distcp`` files into ``root`` (a new
    directory), cut as :func:`generate_sidecar` cuts it, with its ``.metadata`` and ``config.json``.
    Returns ``{"tensors", "pieces", "files", "apparent_bytes", "disk_bytes"}``."""
    import pickle

    import torch
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex,
                                                       TensorProperties, TensorStorageMetadata)

    dtypes = {"BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
    tensors = release(cfg)
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    state, storage, pieces = {}, {}, 0
    files = [open(root / f"__{rank}_0.distcp", "wb") for rank in range(ranks)]
    try:
        for i, name in enumerate(sorted(tensors)):
            dtype, shape = tensors[name]
            pair = i % (ranks // 2)
            cut = len(shape) == 2 and shape[0] % 2 == 0
            boxes = ([(2 * pair + tp, (tp * shape[0] // 2, 0), (shape[0] // 2, shape[1])) for tp in range(2)] if cut
                     else [(2 * pair, (0,) * len(shape), shape)])
            chunks = []
            for rank, offsets, sizes in boxes:
                f = files[rank]
                start = f.tell()
                archive = TensorArchive(dtype, tuple(sizes), f"{name}@{offsets}")
                f.write(archive.head())
                f.seek(archive.nbytes, os.SEEK_CUR)  # the hole
                f.write(archive.tail(_zeros_crc(archive.nbytes)))
                length = f.tell() - start
                chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
                storage[MetadataIndex(name, torch.Size(offsets), len(chunks) - 1)] = _StorageInfo(
                    f"__{rank}_0.distcp", start, length)
                pieces += 1
            state[name] = TensorStorageMetadata(TensorProperties(dtype=dtypes[dtype]), torch.Size(shape), chunks)
    finally:
        for f in files:
            f.truncate()  # a hole at the end stays a hole: the file ends where its last archive does
            f.close()
    (root / ".metadata").write_bytes(pickle.dumps(Metadata(state, storage_data=storage, version="1.0.0")))
    paths = list(root.iterdir())
    return {"tensors": len(tensors), "pieces": pieces, "files": ranks,
            "apparent_bytes": sum(p.stat().st_size for p in paths),
            "disk_bytes": sum(p.stat().st_blocks * 512 for p in paths)}


def generate_torch_dist(root: Path, hf: Path, tp: int = 2, pp: int = 1, ep: int = 8) -> dict:
    """Write the sparse HF release in ``hf`` (``truescale.generate``, BF16) as Megatron-Core ``torch_dist`` at
    ``tp`` x ``pp`` x ``ep`` into ``root`` (a new directory): the plan of ``split --to megatron --dry-run`` (its
    megatron-core names and chunks, which the megatron-core consumer tests hold to megatron-core), each item's
    torch.save archive with its data record a hole, then the files the split writes around them (``.metadata``,
    ``common.pt``, ``metadata.json``, the tracker) and ``config.json``.
    Returns ``{"tensors", "pieces", "files", "apparent_bytes", "disk_bytes"}``."""
    import ckpttool
    from ckpttool.commands.merge import prepare
    from ckpttool.commands.split_dcp import model_of
    from ckpttool.commands.split_megatron import training_args
    from ckpttool.writers import dcp, megatron_dist

    result = ckpttool.split(hf, None, to="megatron", tp=tp, pp=pp, ep=ep, dry_run=True)
    iteration = root / megatron_dist.iteration_name(0)
    iteration.mkdir(parents=True)
    for file in result.files:
        with open(iteration / file.name, "wb") as f:
            for item in file.items:
                f.seek(item.offset)
                f.write(item.archive.head())
                f.seek(item.data_offset + item.archive.nbytes)  # the hole
                f.write(item.archive.tail(_zeros_crc(item.archive.nbytes)))
            for obj in file.objects:
                f.seek(obj.offset)
                f.write(obj.data)
            f.truncate(file.nbytes)
    dcp.write_metadata(result.files, iteration)
    shapes = {s.name: s.shape for s in result.tensors}
    megatron_dist.write_common(iteration, training_args(model_of(prepare(hf)), result.mesh, shapes), 0)
    megatron_dist.write_tracker(root, 0)
    shutil.copy(hf / "config.json", root / "config.json")
    paths = [p for p in root.rglob("*") if p.is_file()]
    return {"tensors": len(result.tensors), "pieces": sum(len(f.items) for f in result.files),
            "files": len(result.files), "apparent_bytes": sum(p.stat().st_size for p in paths),
            "disk_bytes": sum(p.stat().st_blocks * 512 for p in paths)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-truescale-readers"))
    parser.add_argument("--layers", type=int, default=61)
    parser.add_argument("--keep", action="store_true", help="reuse the checkpoints in --workdir if there")
    parser.add_argument("--mesh", type=int, nargs=3, default=(2, 1, 8), metavar=("TP", "PP", "EP"),
                        help="the torch_dist checkpoint's mesh (default 2 1 8: ~90k items at 61 layers)")
    parser.add_argument("--only-second", action="store_true", help="skip the first (empty cache) runs")
    args = parser.parse_args()
    workdir = claim_workdir(args.workdir)
    cache = inside_workdir(workdir / "cache", workdir)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    os.environ["CKPTTOOL_CACHE"] = str(inside_workdir(workdir / "generator-cache", workdir))
    sources = {"sidecar": (inside_workdir(workdir / "sidecar", workdir), generate_sidecar),
               "dcp": (inside_workdir(workdir / "dcp", workdir), generate_dcp)}
    hf = inside_workdir(workdir / "hf-bf16", workdir)  # torch_dist is made from the sparse BF16 release
    sources["torch_dist"] = (inside_workdir(workdir / "torch_dist", workdir),
                             lambda root, cfg: generate_torch_dist(root, hf, *args.mesh))
    for name, (src, make) in sources.items():
        if not (args.keep and src.exists()):
            shutil.rmtree(src, ignore_errors=True)
            if name == "torch_dist" and not (args.keep and hf.exists()):
                shutil.rmtree(hf, ignore_errors=True)
                generate(hf, config(args.layers, bf16=True))
            start = time.perf_counter()
            made = make(src, config(args.layers, bf16=True))
            print(f"{name}: built in {time.perf_counter() - start:.1f} s: {made}")
    tool = [sys.executable, "-m", "ckpttool"]
    print(f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f}")
    os.environ["CKPTTOOL_CACHE"] = str(cache)
    for name, (src, _) in sources.items():
        cmds = {"merge --dry-run": [*tool, "merge", str(src), "--dry-run", "--json"],
                "audit --no-data": [*tool, "audit", str(src), "--no-data", "--json"]}
        for cmd, argv in cmds.items():
            if not args.only_second:
                shutil.rmtree(cache, ignore_errors=True)
            for run in ("second",) if args.only_second else ("first", "second"):
                r = measure(f"{name}-{'-'.join(cmd.split()[::2])}-{run}", argv, workdir)
                peak = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in r["peaks"].items()) or "no predicted peak"
                print(f"{name:8} {cmd:16} {run:6} {r['wall']:6.2f} s  cpu {r['cpu']:6.2f} s  "
                      f"peak RSS {r['rss'] / 2**20:7.1f} MiB  exit {r['rc']}  {peak}  load {os.getloadavg()[0]:.1f}")
                if r["message"]:
                    print(f"{'':36}{r['message']}")


if __name__ == "__main__":
    main()
