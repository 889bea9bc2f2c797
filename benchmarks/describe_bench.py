#!/usr/bin/env python
"""A merge on a cold description cache against a warm one: peak RSS of the merging process against the plan's
prediction, and the time the description costs (issue 19).

Builds the synthetic Llama-shaped DCP checkpoint of ``merge_bench.py`` (``--size-gib``, 4 gloo ranks, dim-0
splits), then runs ``ckpttool merge`` in fresh processes, interleaved, page cache of the source dropped first,
``--runs`` times each:

- ``cold, subprocess``: an empty ``CKPTTOOL_CACHE``; the architecture is described in a subprocess (the default);
- ``cold, inline``: an empty cache, ``CKPTTOOL_DESCRIBE=inline`` (transformers imported by the merge itself, as
  before issue 19);
- ``warm``: the cache the cold run filled.

Each command runs inside a small wrapper that reports the merging process's own peak RSS (``RUSAGE_SELF``) apart
from its subprocesses' (``RUSAGE_CHILDREN``: the description's), and its wall time. Peaks are also given above
the baseline of a warm ``merge --dry-run`` (imports and plan, no data), next to the plan's prediction of the
merge's buffers (``predict_peak_bytes``). Medians of ``--runs``.

    python benchmarks/describe_bench.py --size-gib 1 --runs 3
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import build, drop_cache

#: runs the ckpttool CLI in this process and writes its wall time and peak RSS (own, subprocesses') to $BENCH_OUT
WRAPPER = """
import json, os, resource, runpy, sys, time
started = time.perf_counter()
sys.argv = ["ckpttool", *sys.argv[1:]]
try:
    runpy.run_module("ckpttool", run_name="__main__", alter_sys=True)
except SystemExit as e:
    if e.code not in (0, None):
        raise
own, children = (resource.getrusage(w).ru_maxrss * 1024 for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
with open(os.environ["BENCH_OUT"], "w") as f:
    json.dump({"wall": time.perf_counter() - started, "own": own, "children": children}, f)
"""


def run(args: list[str], env: dict[str, str], out: Path) -> dict[str, float]:
    """Wall seconds, the merging process's peak RSS and its subprocesses' of ``ckpttool ARGS``."""
    subprocess.run([sys.executable, "-c", WRAPPER, *args], env={**env, "BENCH_OUT": str(out)}, check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return json.loads(out.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-describe-bench"))
    args = parser.parse_args()
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    src = build(work, "dcp", "dim0", args.size_gib)
    out, report = work / "out", work / "report.json"
    merge = ["merge", str(src), str(out), "--force", "-q", "--max-shard-size", "1000GB", "--workers", str(args.workers)]
    base_env = {k: v for k, v in os.environ.items() if k != "CKPTTOOL_DESCRIBE"}
    modes = {"cold, subprocess": {}, "cold, inline": {"CKPTTOOL_DESCRIBE": "inline"}, "warm": {}}
    results: dict[str, list[dict[str, float]]] = {name: [] for name in modes}
    for n in range(args.runs):
        cache = work / f"cache-{n}"
        for name, extra in modes.items():
            if name.startswith("cold"):
                shutil.rmtree(cache, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            drop_cache(src)
            results[name].append(run(merge, {**base_env, **extra, "CKPTTOOL_CACHE": str(cache)}, report))
    baseline = run([*merge, "--dry-run"], {**base_env, "CKPTTOOL_CACHE": str(work / "cache-0")}, report)["own"]

    os.environ["CKPTTOOL_CACHE"] = str(work / "cache-0")
    from ckpttool.commands.merge import prepare
    from ckpttool.writers.hf import predict_peak_bytes

    predicted = predict_peak_bytes(prepare(src).plan, args.workers)
    mib = 2**20
    print(f"input: dcp, split dim0, {sum(f.stat().st_size for f in src.iterdir()) / 2**30:.2f} GiB; {args.workers} "
          f"workers; {args.runs} runs, medians; --dry-run baseline {baseline / mib:.0f} MiB; predicted at most "
          f"{predicted / mib:.0f} MiB above it")
    for name, runs in results.items():
        wall, own, children = (statistics.median(r[k] for r in runs) for k in ("wall", "own", "children"))
        print(f"  {name:17s} {wall:6.2f} s  merge peak RSS {own / mib:5.0f} MiB ({(own - baseline) / mib:+5.0f} above "
              f"--dry-run{', over the prediction' if own - baseline > predicted else ''}); subprocesses' peak "
              f"{children / mib:4.0f} MiB")
    cold = statistics.median(r["wall"] for r in results["cold, subprocess"])
    warm = statistics.median(r["wall"] for r in results["warm"])
    print(f"  a cold cache costs {cold - warm:.2f} s (cold, subprocess - warm)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
