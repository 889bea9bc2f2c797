#!/usr/bin/env python
"""How much ``ckpttool audit`` reads and how fast it runs, with and without its data checks.

Builds a synthetic Llama-shaped HuggingFace checkpoint of about ``--size-gib`` (bf16, random weights, sharded
with an index, a config transformers builds the architecture from), then runs in a fresh process each:

- ``audit --no-data``: bytes read by the audit itself (``rchar`` of /proc/self/io around the call, after a
  warm-up run so imports are not counted) against the checkpoint's bytes; the goal is <= 1%.
- ``audit`` (data checks): wall time, throughput, and peak RSS (VmHWM, reset before the call) above the
  RSS before the call.

The page cache of the checkpoint is dropped (posix_fadvise DONTNEED) before each run; medians of ``--runs``.

    python benchmarks/audit_bench.py --size-gib 1 --runs 3 [--workdir /tmp/ckpttool-audit-bench]
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

import torch
from safetensors.torch import save_file
from transformers import LlamaConfig

CHILD = r"""
import json, os, sys, time
from pathlib import Path
import ckpttool

root, data = Path(sys.argv[1]), sys.argv[2] == "data"
ckpttool.audit(root, data=False)  # warm-up: imports and the meta-device model
for f in root.iterdir():
    fd = os.open(f, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)

def rchar():
    return int(next(l for l in open("/proc/self/io") if l.startswith("rchar")).split()[1])

def status(key):  # kB lines of /proc/self/status (ru_maxrss would start at the parent's peak)
    return 1024 * int(next(l for l in open("/proc/self/status") if l.startswith(key)).split()[1])

base_rss = status("VmRSS")
open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
before, start = rchar(), time.perf_counter()
report = ckpttool.audit(root, data=data)
seconds, read = time.perf_counter() - start, rchar() - before
peak = status("VmHWM")
print(json.dumps({"seconds": seconds, "read": read, "peak_above": max(0, peak - base_rss), "ok": report.ok,
                  "findings": [f.code for f in report.findings], "tensors": report.tensors}))
"""


def build(root: Path, size_gib: float) -> tuple[int, int]:
    """A Llama-shaped bf16 checkpoint of about ``size_gib``; returns (bytes, largest tensor bytes)."""
    hidden, inter, vocab = 2048, 5632, 32000
    per_layer = (2 * hidden * hidden + 2 * hidden * (hidden // 4) + 3 * hidden * inter) * 2
    layers = max(1, int((size_gib * 2**30 - 2 * vocab * hidden * 2) // per_layer))
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=False, dtype="bfloat16")
    root.mkdir(parents=True)
    config.to_json_file(root / "config.json")
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    weight_map, total, largest = {}, 0, 0
    names = sorted(shapes)
    files = max(1, len(names) // 16)
    for i in range(files):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        part = {}
        for name in names[i::files]:
            shape = shapes[name]
            t = (1 + 0.05 * torch.randn(shape, generator=g)) if len(shape) == 1 else 0.02 * torch.randn(shape, generator=g)
            part[name] = t.to(torch.bfloat16)
            weight_map[name] = file
            total += part[name].numel() * 2
            largest = max(largest, part[name].numel() * 2)
        save_file(part, str(root / file), metadata={"format": "pt"})
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return sum(f.stat().st_size for f in root.iterdir()), largest


def run(root: Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, str(root), mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-audit-bench"))
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    root = args.workdir / "hf"
    size, largest = build(root, args.size_gib)
    print(f"checkpoint: {size / 2**30:.2f} GiB in {len(list(root.glob('*.safetensors')))} files, largest tensor "
          f"{largest / 2**20:.0f} MiB")
    results: dict[str, list[dict]] = {"headers": [], "data": []}
    for _ in range(args.runs):
        results["headers"].append(run(root, "headers"))
        results["data"].append(run(root, "data"))
    for mode, runs in results.items():
        seconds = statistics.median(r["seconds"] for r in runs)
        read = statistics.median(r["read"] for r in runs)
        peak = statistics.median(r["peak_above"] for r in runs)
        print(f"audit {'--no-data' if mode == 'headers' else '(data)  '}: {seconds:6.2f} s, read {read / 2**20:9.2f} MiB "
              f"({100 * read / size:.3f}% of the checkpoint), {size / 2**30 / seconds:5.2f} GiB/s, peak RSS +"
              f"{peak / 2**20:.0f} MiB, findings {sorted(set(runs[0]['findings']))}, {runs[0]['tensors']} tensors")
    shutil.rmtree(args.workdir, ignore_errors=True)
    os.sync()


if __name__ == "__main__":
    main()
