#!/usr/bin/env python
"""The GPU path of ``ckpttool.live.save_hf``: NCCL gather, pinned host arena, copies overlapped with disk writes.

A synthetic bf16 model (tensors of 8192 x 4096, split by rows over the ranks as DTensors on a CUDA mesh) is
saved by ``torchrun --nproc_per_node N`` ranks, one per GPU, on NCCL. Each rank measures, medians of
``--repeat`` runs:

- ``pinned copy``: one ``copy_`` of as many bytes as this rank gathers, from a GPU buffer into pinned host
  memory (the device-to-host bandwidth the gather is compared with);
- ``gather``: every round of the live gather (NCCL point-to-point sends, the bucket in the GPU arena, its copy to
  the pinned host arena on the side stream), nothing written; ``gather / copy`` is the bandwidth ratio
  (goal >= 0.80);
- ``disk``: the rank's files written from pinned host memory (fallocate, write, fsync), no GPU work;
- ``gather + write``: the gather with its writer thread writing the files, as ``save_hf`` runs it. ``overlap``
  is (gather + disk - gather+write) / min(gather, disk): 1 when the shorter is hidden completely, 0 when the two
  run one after the other;
- ``save_hf``: the whole call (plan, gather, write, audit on, publish) and its peak GPU memory above what the
  model holds (``torch.cuda.max_memory_allocated``); the gather's own bound is two half-buckets of arena plus
  the send buffers of one round.

    python benchmarks/live_gpu_bench.py --size-gib 1 4            # every visible GPU
    python benchmarks/live_gpu_bench.py --size-gib 2 --nproc 1    # one GPU: no NCCL traffic, copies only

Needs a CUDA GPU; without one it exits 1 saying so.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROWS, COLS = 8192, 4096  # one bf16 tensor: 64 MiB
MiB, GiB = 2**20, 2**30


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, nargs="+", default=[1.0, 4.0], help="model sizes (default: 1 4)")
    parser.add_argument("--nproc", type=int, default=None, help="ranks, one per GPU (default: every visible GPU)")
    parser.add_argument("--bucket-mib", type=int, default=512, help="save_hf's bucket_bytes in MiB (default: 512)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output file (default: 5GB)")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each measurement, median (default: 3)")
    parser.add_argument("--work", type=Path, default=None, help="scratch directory on the disk to measure "
                        "(default: a temporary one)")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.repeat < 1 or args.bucket_mib < 1 or any(s <= 0 for s in args.size_gib):
        parser.error("--repeat, --bucket-mib and --size-gib must be positive")
    if args.nproc is not None and args.nproc < 1:
        parser.error("--nproc must be at least 1")
    return args


def no_cuda_message(torch) -> str | None:
    """Why this machine cannot run the benchmark, or None when it can."""
    if torch.cuda.is_available():
        return None
    built = torch.version.cuda or "none (a CPU-only build)"
    return (f"live_gpu_bench: needs a CUDA GPU, and torch {torch.__version__} sees none "
            f"(torch.cuda.is_available() is False; CUDA in this build: {built}). Run it on a GPU machine; "
            "see 'GPU path' in BENCHMARKS.md.")


# ---- one rank ------------------------------------------------------------------------------------------


def synthetic_state(size_gib: float, world: int, mesh) -> dict:
    """bf16 DTensors of ROWS x COLS, split by rows over the ranks, about ``size_gib`` in all."""
    import torch
    from torch.distributed.tensor import DTensor, Shard

    rows = max(world, ROWS // world * world)
    count = max(1, round(size_gib * GiB / (rows * COLS * 2)))
    torch.manual_seed(0)
    return {f"model.layers.{i}.weight": DTensor.from_local(
        torch.randn(rows // world, COLS, dtype=torch.bfloat16, device="cuda"), mesh, [Shard(0)], run_check=False)
        for i in range(count)}


def gather_only(gather) -> tuple[float, int]:
    """Every round of ``gather`` with nothing written: the seconds, and the bytes of this rank's buckets (what
    lands in its GPU arena, received or copied from its own shards, then goes to pinned host memory)."""
    import torch
    import torch.distributed as dist

    from ckpttool.live.gather import Arena, bucket_nbytes

    moved = sum(bucket_nbytes(buckets[gather.rank]) for buckets in gather.rounds if gather.rank in buckets)
    arenas = [Arena(gather.arena_bytes, gather.device) for _ in range(2)]
    torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    taken = 0
    for number, buckets in enumerate(gather.rounds):
        if gather.rank not in buckets:
            gather.exchange(number, buckets, None)
            continue
        arena = arenas[taken % 2]
        if arena.event is not None:
            arena.event.synchronize()  # the bucket before last is on the host: its arena is free
        arena.reset()
        taken += 1
        gather.exchange(number, buckets, arena)
    for arena in arenas:
        if arena.event is not None:
            arena.event.synchronize()
    torch.cuda.synchronize()
    return time.perf_counter() - start, moved


def pinned_copy(nbytes: int) -> float:
    """Seconds of one device-to-host ``copy_`` of ``nbytes`` into pinned memory."""
    import torch

    src = torch.empty(max(1, nbytes), dtype=torch.uint8, device="cuda")
    dst = torch.empty(max(1, nbytes), dtype=torch.uint8, pin_memory=True)
    dst.copy_(src, non_blocking=True)  # first touch of both buffers, untimed
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    del src, dst
    return seconds


def disk_only(files, directory: Path, chunk: int) -> float:
    """Seconds to write ``files``' bytes from pinned host memory as the writer does: fallocate, write, fsync."""
    import torch

    host = torch.zeros(chunk, dtype=torch.uint8, pin_memory=True)
    view = memoryview(host.numpy())
    directory.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    for out in files:
        fd = os.open(directory / out.name, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            if out.nbytes:
                os.posix_fallocate(fd, 0, out.nbytes)
            left = out.nbytes
            while left:
                left -= os.write(fd, view[: min(left, chunk)])
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.perf_counter() - start


def fsync_files(files, directory: Path) -> None:
    """``fsync`` the rank's written files: ``disk_only`` fsyncs each, and ``save_hf`` does before it publishes, so
    the gather + write timing counts the same durable bytes (without it, the page cache hides the disk)."""
    for out in files:
        fd = os.open(directory / out.name, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from ckpttool.execute.distributed import Group, share_out
    from ckpttool.live import save_hf
    from ckpttool.live.gather import Gather
    from ckpttool.live.pieces import describe_held, plan_gather
    from ckpttool.writers.hf import assign_files

    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    bucket = args.bucket_mib * MiB
    state = synthetic_state(args.size_gib[0], world, init_device_mesh("cuda", (world,)))
    model_bytes = sum(t.numel() * t.element_size() for t in state.values())
    group = Group()
    held, views, notes = describe_held(state, {})
    plan = plan_gather(group.on_all(lambda: held), None, None, notes)
    files = assign_files(plan, args.max_shard_size)
    owner = share_out([f.nbytes for f in files], world)
    mine = [f for f, r in zip(files, owner) if r == rank]
    gather = Gather(plan, files, owner, group, views, bucket)
    here = args.work / f"rank{rank}"
    found: dict[str, list[float]] = {k: [] for k in ("copy", "gather", "disk", "run", "save_hf")}
    peaks: dict[str, int] = {"run": 0, "save_hf": 0}
    moved = 0

    def peak_of(key: str, work) -> float:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        start = time.perf_counter()
        work()
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        peaks[key] = max(peaks[key], torch.cuda.max_memory_allocated() - base)
        return seconds

    for _ in range(args.repeat):
        seconds, moved = gather_only(gather)
        found["gather"].append(seconds)
        found["copy"].append(pinned_copy(moved))
        shutil.rmtree(here, ignore_errors=True)
        found["disk"].append(disk_only(mine, here / "disk", min(bucket // 2, 64 * MiB)))
        shutil.rmtree(here, ignore_errors=True)
        here.mkdir(parents=True)
        found["run"].append(peak_of("run", lambda: (gather.run(mine, here), fsync_files(mine, here))))
        shutil.rmtree(here, ignore_errors=True)
        found["save_hf"].append(peak_of("save_hf", lambda: save_hf(
            state, args.work / "save_hf", max_shard_size=args.max_shard_size, bucket_bytes=bucket, force=True)))
    mine_bytes = sum(f.nbytes for f in mine)
    result = {"rank": rank, "world": world, "model_bytes": model_bytes, "gathered": moved, "file_bytes": mine_bytes,
              "arena_bytes": gather.arena_bytes, "bucket_bytes": bucket, "rounds": len(gather.rounds),
              "peaks": peaks, **{k: statistics.median(v) for k, v in found.items()}}
    everyone = [None] * world
    dist.all_gather_object(everyone, result)
    if rank == 0:
        args.result.write_text(json.dumps(everyone))
    dist.destroy_process_group()


# ---- the launcher --------------------------------------------------------------------------------------


def launch(args: argparse.Namespace, nproc: int, size: float, work: Path) -> list[dict]:
    result = work / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", __file__,
           "--worker", "--size-gib", str(size), "--bucket-mib", str(args.bucket_mib), "--max-shard-size",
           args.max_shard_size, "--repeat", str(args.repeat), "--work", str(work), "--result", str(result)]
    done = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode != 0:
        sys.exit(f"live_gpu_bench: the torchrun job failed (exit {done.returncode}):\n{done.stdout[-6000:]}")
    return json.loads(result.read_text())


def row(ranks: list[dict]) -> str:
    r0 = ranks[0]
    copy_bw = r0["gathered"] / r0["copy"] / 1e9
    gather_bw = r0["gathered"] / r0["gather"] / 1e9
    worst_ratio = min((r["gathered"] / r["gather"]) / (r["gathered"] / r["copy"]) for r in ranks)
    overlap = (r0["gather"] + r0["disk"] - r0["run"]) / min(r0["gather"], r0["disk"])
    peak_run = max(r["peaks"]["run"] for r in ranks) / MiB
    peak_save = max(r["peaks"]["save_hf"] for r in ranks) / MiB
    return (f"| {r0['model_bytes'] / GiB:.2f} GiB | {r0['world']} | {r0['gathered'] / GiB:.2f} GiB | "
            f"{copy_bw:.1f} GB/s | {gather_bw:.1f} GB/s | {gather_bw / copy_bw:.2f} (worst rank {worst_ratio:.2f}) | "
            f"{r0['gather']:.2f} s | {r0['disk']:.2f} s | {r0['run']:.2f} s | {overlap:.2f} | {r0['save_hf']:.2f} s | "
            f"{peak_run:.0f} MiB | {peak_save:.0f} MiB | {r0['bucket_bytes'] / MiB:.0f} MiB |")


HEADER = ("| model | ranks | rank-0 bytes gathered | pinned copy_ | gather | gather / copy (goal >= 0.80) | "
          "gather only | disk only | gather + write | overlap | save_hf (audit on) | peak GPU, gather + write | "
          "peak GPU, save_hf | bucket_bytes |\n" + "|---" * 14 + "|")


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    import torch

    why = no_cuda_message(torch)
    if why is not None:
        print(why, file=sys.stderr)
        sys.exit(1)
    if args.worker:
        worker(args)
        return
    gpus = torch.cuda.device_count()
    nproc = args.nproc or gpus
    if nproc > gpus:
        sys.exit(f"live_gpu_bench: --nproc {nproc} needs {nproc} GPUs, {gpus} visible (NCCL runs one rank per GPU)")
    work = args.work or Path(tempfile.mkdtemp(prefix="live-gpu-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"{torch.cuda.get_device_name(0)} x{nproc}, torch {torch.__version__}, CUDA {torch.version.cuda}, "
          f"scratch {work}; medians of {args.repeat}", flush=True)
    rows = []
    try:
        for size in args.size_gib:
            rows.append(row(launch(args, nproc, size, work)))
            print(rows[-1], flush=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    print(HEADER)
    print("\n".join(rows))


if __name__ == "__main__":
    main()
