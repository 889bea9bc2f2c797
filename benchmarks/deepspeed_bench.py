#!/usr/bin/env python
"""``ckpttool merge`` against DeepSpeed's own ``zero_to_fp32`` on a real DeepSpeed ZeRO checkpoint.

Run it in a venv that has DeepSpeed (see fixtures/make_deepspeed.py); ckpttool runs from its own venv
(``--ckpttool``, default ``/work/venv/bin/ckpttool``)::

    /work/venv-deepspeed/bin/python benchmarks/deepspeed_bench.py --hidden 1024 --layers 8 --stage 2 --runs 3

It builds a Llama of the given size (vocab 32003) under DeepSpeed on 2 CPU ranks (gloo), ZeRO stage ``--stage``,
and saves it with ``engine.save_checkpoint`` without a training step (so the optimizer files hold the fp32
master partitions and no Adam moments). Then, interleaved, each run in a fresh process with the page cache of
the checkpoint dropped first (posix_fadvise DONTNEED):

- ``ckpttool``: ``ckpttool merge CKPT OUT`` (fp32 master weights to HF safetensors);
- ``zero_to_fp32``: ``python -m deepspeed.utils.zero_to_fp32 CKPT OUT --safe_serialization``.

Wall time and peak RSS (``ru_maxrss`` of the command as the only child of a small probe) are medians of
``--runs``; the outputs are compared tensor by tensor once. One JSON document goes to stdout.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import drop_cache  # noqa: E402

PROBE = """
import os, resource, subprocess, sys, time
start = time.perf_counter()
code = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE).returncode
wall = time.perf_counter() - start
print(wall, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024, code)
"""


def produce(out: Path, hidden: int, layers: int, stage: int) -> None:
    """One rank (under torch.distributed.run): build the model under DeepSpeed and save a checkpoint."""
    import deepspeed
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    deepspeed.init_distributed(dist_backend="gloo")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32003, hidden_size=hidden, intermediate_size=int(hidden * 2.75) // 64 * 64,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 256,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True, "steps_per_print": 10**9})
    engine.save_checkpoint(str(out / "checkpoint"))
    if torch.distributed.get_rank() == 0:
        config.save_pretrained(out / "checkpoint")
        for script in ("zero_to_fp32.py", "zero_to_torch.py"):
            (out / "checkpoint" / script).unlink(missing_ok=True)


def measure(command: list[str], root: Path) -> tuple[float, int]:
    drop_cache(root)
    done = subprocess.run([sys.executable, "-c", PROBE, *command], capture_output=True, text=True, check=True)
    wall, rss, code = done.stdout.split()
    if code != "0":
        raise SystemExit(f"{command[0]} failed ({code}): {done.stderr[-2000:]}")
    return float(wall), int(rss)


def compare(a: Path, b: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    def load(d: Path) -> dict:
        out = {}
        for f in sorted(d.glob("*.safetensors")):
            out.update(load_file(f))
        return out

    x, y = load(a), load(b)
    same = sorted(x) == sorted(y) and all(torch.equal(x[k], y[k]) for k in x)
    return {"tensors": len(x), "bytes": sum(t.numel() * t.element_size() for t in x.values()), "bit_identical": same}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ckpttool", default="/work/venv/bin/ckpttool")
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--produce", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.produce:
        produce(args.produce, args.hidden, args.layers, args.stage)
        return
    work = args.workdir or Path(tempfile.mkdtemp(prefix="ds-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", __file__,
                    "--produce", str(work), "--hidden", str(args.hidden), "--layers", str(args.layers),
                    "--stage", str(args.stage)], check=True, env=env, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL)
    ckpt = work / "checkpoint"
    commands = {
        "ckpttool": lambda out: [args.ckpttool, "merge", str(ckpt), str(out), "-q", "--no-audit"],
        "zero_to_fp32": lambda out: [sys.executable, "-m", "deepspeed.utils.zero_to_fp32", str(ckpt), str(out),
                                     "--safe_serialization"],
    }
    results: dict[str, list[tuple[float, int]]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, command in commands.items():  # interleaved
            out = work / f"out-{name}"
            shutil.rmtree(out, ignore_errors=True)
            results[name].append(measure(command(out), ckpt))
    checkpoint_bytes = sum(p.stat().st_size for p in ckpt.rglob("*") if p.is_file())
    report = {
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": 32003, "zero_stage": args.stage, "dp": 2},
        "checkpoint_bytes": checkpoint_bytes,
        "runs": args.runs,
        "output": compare(work / "out-ckpttool", work / "out-zero_to_fp32"),
        "results": {
            name: {"wall_s": round(statistics.median(w for w, _ in runs), 3),
                   "peak_rss_mib": round(statistics.median(r for _, r in runs) / 2**20, 1)}
            for name, runs in results.items()
        },
    }
    print(json.dumps(report, indent=2))
    if args.workdir is None:
        shutil.rmtree(work)


if __name__ == "__main__":
    main()
