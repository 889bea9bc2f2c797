#!/usr/bin/env python
"""Time and peak memory of ``ckpttool merge`` against ``cp -r`` of the same bytes (the physical limit).

Builds a synthetic sharded checkpoint with ckpttool's sidecar writer (4 TP ranks, bf16, tensors of a few
hundred MiB split on dim 0 and on dim 1, a padded vocab), then runs each command several times, interleaved,
with the page cache of the benchmark's own files dropped before each run (posix_fadvise DONTNEED), and
reports medians. Peak RSS is the child's ru_maxrss; the baseline is the same merge with ``--dry-run``
(every import and the whole plan, but no tensor data).

    python benchmarks/merge_bench.py --size-gib 1 --runs 3 [--workdir /tmp/ckpttool-bench]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ckpttool.writer import predict_peak_bytes
from ckpttool.merge import prepare
from ckpttool.sidecar import PieceSpec, save_shard

TP = 4
HIDDEN = 4096


def build(src: Path, size_gib: float) -> int:
    """A 4-rank sidecar checkpoint of about ``size_gib``: returns its byte count."""
    target = int(size_gib * 2**30)
    vocab = 32003  # padded to 32004 for TP=4
    per_layer = 2 * (3 * HIDDEN * HIDDEN) * 2  # bytes: column (3H x H) + row (H x 3H), bf16
    budget = target - (vocab + 1) * HIDDEN * 2
    n_layers = max(1, budget // per_layer)
    g = torch.Generator().manual_seed(0)
    for rank in range(TP):
        tensors, specs = {}, {}
        embed = (32004, HIDDEN)
        tensors["embed.weight"] = torch.randn((embed[0] // TP, HIDDEN), generator=g).to(torch.bfloat16)
        specs["embed.weight"] = PieceSpec.split(embed, dim=0, index=rank, count=TP, true_size=vocab)
        for i in range(n_layers):
            col, row = (3 * HIDDEN, HIDDEN), (HIDDEN, 3 * HIDDEN)
            tensors[f"layers.{i}.col.weight"] = torch.randn((col[0] // TP, col[1]), generator=g).to(torch.bfloat16)
            specs[f"layers.{i}.col.weight"] = PieceSpec.split(col, dim=0, index=rank, count=TP)
            tensors[f"layers.{i}.row.weight"] = torch.randn((row[0], row[1] // TP), generator=g).to(torch.bfloat16)
            specs[f"layers.{i}.row.weight"] = PieceSpec.split(row, dim=1, index=rank, count=TP)
        save_shard(tensors, specs, src, rank=rank, world_size=TP)
        del tensors
    return sum(f.stat().st_size for f in src.iterdir())


def drop_cache(*roots: Path) -> None:
    for root in roots:
        if not root.exists():
            continue
        for f in root.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd) if os.access(f, os.W_OK) else None
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def rss_of(cmd: list[str]) -> int:
    """Peak RSS of a command in a fresh interpreter (ru_maxrss of RUSAGE_CHILDREN is a running max)."""
    probe = (
        "import resource,subprocess,sys;subprocess.run(sys.argv[1:],check=True,stdout=subprocess.DEVNULL,"
        "stderr=subprocess.DEVNULL);print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss*1024)"
    )
    return int(subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True).stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    args = parser.parse_args()
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    src, out, copy = work / "src", work / "out", work / "copy"
    nbytes = build(src, args.size_gib)
    ckpttool = [sys.executable, "-m", "ckpttool"]
    merge_cmd = [*ckpttool, "merge", str(src), str(out), "--force", "-q"]
    # merge fsyncs what it writes; so does the reference: cp, then sync
    cp_cmd = ["sh", "-c", f"cp -r '{src}' '{copy}' && sync"]
    times: dict[str, list[float]] = {"merge": [], "cp": []}
    peaks: list[int] = []
    for _ in range(args.runs):
        for name, cmd in (("merge", merge_cmd), ("cp", cp_cmd)):
            shutil.rmtree(copy, ignore_errors=True)
            drop_cache(src, out)
            wall = time.perf_counter()
            if name == "merge":
                peaks.append(rss_of(cmd))
            else:
                subprocess.run(cmd, check=True)
            times[name].append(time.perf_counter() - wall)
    baseline = rss_of([*ckpttool, "merge", str(src), str(out), "--force", "--dry-run", "-q"])
    plan = prepare(src).plan
    largest, predicted = plan.largest_target_bytes(), predict_peak_bytes(plan)
    merge_t, cp_t = statistics.median(times["merge"]), statistics.median(times["cp"])
    peak = statistics.median(peaks)
    print(f"input: {nbytes / 2**30:.2f} GiB in {TP} rank files (bf16, dim-0 and dim-1 splits, padded vocab)")
    print(f"cp+sync:{cp_t:6.2f} s   {nbytes / cp_t / 2**20:7.1f} MiB/s")
    print(f"merge:  {merge_t:6.2f} s   {nbytes / merge_t / 2**20:7.1f} MiB/s   merge/cp = {merge_t / cp_t:.2f}")
    print(f"peak RSS: {peak / 2**20:.0f} MiB; dry-run baseline {baseline / 2**20:.0f} MiB; "
          f"above baseline {(peak - baseline) / 2**20:.0f} MiB")
    print(f"largest tensor {largest / 2**20:.0f} MiB; the plan predicts at most {predicted / 2**20:.0f} MiB")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
