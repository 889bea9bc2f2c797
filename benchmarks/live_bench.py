#!/usr/bin/env python
"""``ckpttool.live.save_hf`` against torch's full-state-dict gather + ``huggingface_hub.save_torch_state_dict``.

The synthetic Llama-shaped bf16 model of ``merge_bench.py`` (DTensors on 4 gloo ranks, vocab 32003 split
unevenly) is saved three ways, each in a fresh ``torchrun`` job:

- ``live``: ``save_hf(state, out, config=...)`` on every rank (default bucket, files shared out);
- ``peer``: ``get_model_state_dict(full_state_dict=True, cpu_offload=True)`` (rank 0 ends up holding the whole
  model), then ``save_torch_state_dict`` on rank 0;
- ``offline``: ``torch.distributed.checkpoint.save`` of the same DTensors, then ``ckpttool.merge`` of it in a
  fresh process (the time the goal compares with: live <= 1.5x offline merge).

Live and offline are timed the same way: the call alone (``save_hf`` after a barrier; ``merge`` after its
imports), without interpreter start-up, both with their output audit on (the default) and both fsyncing their
output. The offline merge runs with as many workers as CPUs, as the command line does. The peer does not fsync
(``save_torch_state_dict`` does not), which favours it.

Per job: wall time of the save (after a barrier) and each rank's peak RSS above its RSS before the save
(VmHWM after resetting it with ``/proc/self/clear_refs``). Rank 0's figure is the one the goal is about.

    python benchmarks/live_bench.py --size-gib 1 2
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import WORLD, config, drop_cache, sharded_state  # noqa: E402


def status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def as_module(state: dict):
    """A module whose parameters are ``state`` (what get_model_state_dict takes)."""
    import torch

    root = torch.nn.Module()
    for name, tensor in state.items():
        *path, leaf = name.split(".")
        module = root
        for part in path:
            if not hasattr(module, part):
                module.add_module(part, torch.nn.Module())
            module = getattr(module, part)
        module.register_parameter(leaf, torch.nn.Parameter(tensor, requires_grad=False))
    return root


def worker(mode: str, out: Path, size_gib: float, result: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = config(size_gib)
    state = sharded_state(cfg, "mixed", rank, init_device_mesh("cpu", (WORLD,)))
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")
    before = status("VmRSS")
    used = resource.getrusage(resource.RUSAGE_SELF)
    start = time.perf_counter()
    if mode == "live":
        from ckpttool.live import save_hf

        logging.basicConfig(level=logging.INFO, format="%(message)s")  # each rank's timeline of its gather (stderr)
        save_hf(state, out, config=cfg)
    elif mode == "peer":
        from huggingface_hub import save_torch_state_dict
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        full = get_model_state_dict(as_module(state), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            out.mkdir(parents=True, exist_ok=True)
            for name in full:  # uneven gathers are narrowed views of a padded buffer: safetensors wants their own
                full[name] = full[name].clone()
            save_torch_state_dict(full, out)  # creates ``out``
            (out / "config.json").write_text(json.dumps(cfg))
        del full
    else:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, checkpoint_id=str(out))
    dist.barrier()
    seconds = time.perf_counter() - start
    peak = status("VmHWM") - before
    now = resource.getrusage(resource.RUSAGE_SELF)
    cpu = now.ru_utime - used.ru_utime + now.ru_stime - used.ru_stime  # user + sys of the save, all threads
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (peak, cpu))
    if rank == 0:
        result.write_text(json.dumps({"seconds": seconds, "peak_above": [p for p, _ in everyone],
                                      "cpu": [c for _, c in everyone], "load": os.getloadavg()[0]}))
    dist.destroy_process_group()


#: the offline merge in a fresh process, timing ``ckpttool.merge`` alone (as the live job times ``save_hf`` alone)
OFFLINE = """
import os, resource, sys, time
from ckpttool.commands.merge import merge
used, start = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
merge(sys.argv[1], sys.argv[2], force=True, workers=os.cpu_count() or 1)
now = resource.getrusage(resource.RUSAGE_SELF)
print(time.perf_counter() - start, now.ru_utime - used.ru_utime + now.ru_stime - used.ru_stime)
"""


def run(mode: str, work: Path, size_gib: float) -> dict:
    out, result = work / mode, work / f"{mode}.json"
    shutil.rmtree(out, ignore_errors=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    job = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}",
                          __file__, "--worker", mode, "--out", str(out), "--size-gib", str(size_gib), "--result",
                          str(result)], check=True, capture_output=True, env=env, text=True)
    found = json.loads(result.read_text())
    found["timeline"] = [line for line in job.stderr.splitlines() if "live gather, rank" in line]
    if mode == "offline":  # then the merge of what DCP wrote, in one process
        (out / "config.json").write_text(json.dumps(config(size_gib)))
        drop_cache(out)
        # timed as the live save is: the call alone (no interpreter start, no imports), audit on, 2 workers
        done = subprocess.run([sys.executable, "-c", OFFLINE, str(out), str(work / "merged")], check=True,
                              capture_output=True, text=True)
        found["merge_seconds"], found["merge_cpu"] = (float(x) for x in done.stdout.split()[-2:])
        shutil.rmtree(work / "merged", ignore_errors=True)
    found["bytes"] = sum(f.stat().st_size for f in out.rglob("*") if f.is_file())
    shutil.rmtree(out, ignore_errors=True)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, nargs="+", default=[1.0, 2.0])
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.out, args.size_gib[0], args.result)
        return
    work = args.work or Path(tempfile.mkdtemp(prefix="live-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for size in args.size_gib:
        found = {mode: run(mode, work, size) for mode in ("live", "peer", "offline")}
        live, peer, offline = found["live"], found["peer"], found["offline"]
        rows.append(f"| {live['bytes'] / 2**30:.2f} GiB | {live['seconds']:.1f} s | {peer['seconds']:.1f} s | "
                    f"{offline['merge_seconds']:.1f} s | {live['seconds'] / offline['merge_seconds']:.2f} | "
                    f"{live['peak_above'][0] / 2**20:.0f} MiB | {max(live['peak_above']) / 2**20:.0f} MiB | "
                    f"{peer['peak_above'][0] / 2**20:.0f} MiB |")
        print(rows[-1], flush=True)
        print(f"  CPU s (user + sys) by rank: live {[round(c, 1) for c in live['cpu']]}, peer "
              f"{[round(c, 1) for c in peer['cpu']]}, offline merge {offline['merge_cpu']:.1f}; load "
              f"{live['load']:.1f}", flush=True)
        for line in live["timeline"]:
            print("  " + line.split("live gather, ", 1)[1], flush=True)
    print("| model | live save_hf | gather + save_torch_state_dict | offline merge | live/offline | "
          "live rank-0 peak | live max-rank peak | peer rank-0 peak |")
    print("|---|---|---|---|---|---|---|---|")
    print("\n".join(rows))
    if args.work is None:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
