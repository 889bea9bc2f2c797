#!/usr/bin/env python
"""The first run's model description (issue 31): a real-size config described in full against from one decoder
layer of each kind (``ckpttool.families.layers``), and the first-run ``merge --dry-run`` it is part of.

Each measurement runs in a fresh process (``many_tensors_bench.timed``: wall, CPU of the process and its children,
peak RSS), with an empty description cache (``CKPTTOOL_CACHE``) unless said:

- ``import``: ``import torch, transformers`` alone (what any first description pays);
- ``describe full`` / ``describe reduced``: ``model_info(config)`` without and with ``reduce=reduced_layers``, in
  that process (``CKPTTOOL_DESCRIBE=inline``), for DeepSeek-V3-671B (``truescale.config``: 61 layers, 3 dense, MTP)
  and a Qwen3-MoE-235B-shaped config (94 MoE layers of 128 experts);
- ``merge --dry-run first`` / ``second``: on truescale_readers.py's DeepSeek-V3-671B sidecar checkpoint (8 sparse
  rank files, ~90k pieces), with an empty cache, then with the cache it left; ``--tree`` picks the ckpttool tree
  (``PYTHONPATH``) so that a tree without reduction can be timed the same way;
- ``overlap`` (``--overlap``, a tree with ``start_describing``): the first run's planning of that source with the
  default describing subprocess, timing the layout's read (beside the subprocess) and the wait for the description
  after it: the wall time a first run saves is the read's, when the description takes longer.

The benchmark runs from its work directory, so that a tree's describing subprocess cannot import another
checkout's ckpttool from the current directory (trees before wt-firstrun put the wrong folder first on its path).

    python benchmarks/first_run_bench.py [--tree .] [--workdir /tmp/ckpttool-first-run] [--runs 3] [--keep] [--overlap]
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
from many_tensors_bench import timed  # noqa: E402  (this folder is no package)
from truescale import claim_workdir, config, inside_workdir  # noqa: E402
from truescale_readers import generate_sidecar  # noqa: E402

#: a Qwen3-MoE-235B-A22B-shaped config (its published sizes)
QWEN3_MOE_235B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 4096,
    "intermediate_size": 12288, "moe_intermediate_size": 1536, "num_hidden_layers": 94, "num_attention_heads": 64,
    "num_key_value_heads": 4, "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
    "mlp_only_layers": [], "vocab_size": 151936, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "norm_topk_prob": True,
}

DESCRIBE = """
import json, sys
from ckpttool.families import reduced_layers
from ckpttool.model.architecture import model_info
config = json.loads(open(sys.argv[1]).read())
model_info(config, reduce=reduced_layers if sys.argv[2] == "reduced" else None)
"""


OVERLAP = """
import sys, time
from ckpttool.commands import source
from ckpttool.model.architecture import Describing
took = {}
def timed(name, call):
    def run(*args, **kwargs):
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            took[name] = time.perf_counter() - started
    return run
source.read_layout = timed("read", source.read_layout)
Describing.result = timed("wait", Describing.result)
started = time.perf_counter()
source.plan_source(sys.argv[1])
print(f"plan_source {time.perf_counter() - started:.1f} s wall: layout read {took['read']:.1f} s beside the "
      f"describing subprocess, then {took['wait']:.1f} s waiting for its description")
"""


def _median(runs: list[dict]) -> str:
    wall, cpu, rss = (statistics.median(r[k] for r in runs) for k in ("wall", "cpu", "rss"))
    return f"{wall:6.2f} s wall  {cpu:6.2f} s CPU  peak RSS {rss / 2**20:6.0f} MiB"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", type=Path, default=Path(__file__).resolve().parent.parent)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-first-run"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--keep", action="store_true", help="reuse the sidecar checkpoint in --workdir if there")
    parser.add_argument("--skip-describe", action="store_true", help="time the merge dry runs only")
    parser.add_argument("--overlap", action="store_true", help="time the layout's read beside the description")
    args = parser.parse_args()
    workdir = claim_workdir(args.workdir.resolve())
    cache = inside_workdir(workdir / "cache", workdir)
    env = {**os.environ, "PYTHONPATH": str(args.tree.resolve())}
    env.pop("CKPTTOOL_DESCRIBE", None)
    os.environ.clear()
    os.environ.update(env)
    src = inside_workdir(workdir / "sidecar", workdir)
    if not (args.keep and src.exists()):
        shutil.rmtree(src, ignore_errors=True)
        os.environ["CKPTTOOL_CACHE"] = str(inside_workdir(workdir / "generator-cache", workdir))
        print("sidecar:", generate_sidecar(src, config(bf16=True)))
    os.environ["CKPTTOOL_CACHE"] = str(cache)
    os.chdir(workdir)
    print(f"tree {args.tree.resolve()}; {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f}; {args.runs} runs, medians")
    py = sys.executable
    if not args.skip_describe:
        runs = []
        for _ in range(args.runs):
            runs.append(timed([py, "-c", "import torch, transformers"]))
        print(f"  {'import torch, transformers':40} {_median(runs)}")
        for name, cfg in (("DeepSeek-V3-671B", config()), ("Qwen3-MoE-235B", QWEN3_MOE_235B)):
            path = workdir / f"{name}.json"
            path.write_text(json.dumps(cfg))
            for how in ("full", "reduced"):
                runs = []
                os.environ["CKPTTOOL_DESCRIBE"] = "inline"
                for _ in range(args.runs):
                    shutil.rmtree(cache, ignore_errors=True)
                    runs.append(timed([py, "-c", DESCRIBE, str(path), how]))
                os.environ.pop("CKPTTOOL_DESCRIBE")
                print(f"  {name + ' describe ' + how:40} {_median(runs)}  load {os.getloadavg()[0]:.1f}")
    merge = [py, "-m", "ckpttool", "merge", str(src), "--dry-run", "--json"]
    first, second = [], []
    for _ in range(args.runs):
        shutil.rmtree(cache, ignore_errors=True)
        first.append(timed(merge))
        second.append(timed(merge))
    for name, runs in (("first", first), ("second", second)):
        bad = [r["rc"] for r in runs if r["rc"] != 0]
        print(f"  {'sidecar merge --dry-run ' + name:40} {_median(runs)}  load {os.getloadavg()[0]:.1f}"
              f"{f'  exit {bad}' if bad else ''}")
    if args.overlap:
        for _ in range(args.runs):
            shutil.rmtree(cache, ignore_errors=True)
            print("  overlap:", subprocess.run([py, "-c", OVERLAP, str(src)], capture_output=True, text=True,
                                               check=True).stdout.strip(), f" load {os.getloadavg()[0]:.1f}")
    shutil.rmtree(cache, ignore_errors=True)


if __name__ == "__main__":
    main()
