#!/usr/bin/env python
"""Fixed costs per tensor: ``ckpttool`` on a checkpoint of DeepSeek-V3's topology with tiny dims.

DeepSeek-V3's release holds ~91k tensors in 163 files: 61 layers (3 dense, then 256 routed experts + 1 shared),
MLA attention, every linear weight FP8 (e4m3) with a float32 ``weight_scale_inv`` beside it. This script builds
the same names and counts with hidden size 32 (each expert 16 x 32): about 90k tensors, 47 MB, in 163 files
with ``model.safetensors.index.json`` and a ``config.json`` (``quantization_config``: fp8, 16 x 16 blocks).
The MTP layer is left out (``num_nextn_predict_layers`` 0). The bytes are a few MB, so every figure is the cost
of the tensors' number, not of their bytes.

Each command runs in a fresh process (start-up and imports included in ``wall``). The architecture
description cache (``CKPTTOOL_CACHE``) is warmed once first, as a second run on a user's machine finds it, and
so is the bytecode of ckpttool's modules (an environment that sets ``PYTHONDONTWRITEBYTECODE`` has it unset for
the commands); the page cache of the source is warm (47 MB). Medians of ``--runs``:

- ``dry-run``: ``merge --dry-run`` (reads headers, plans, checks coverage);
- ``merge``: ``merge`` with its output audit on (as users run it), ``--workers`` threads, fsync as it always does;
- ``merge --no-audit``; ``cp``: ``cp -r`` + ``sync`` of the source, the same bytes (the floor);
- ``audit``: ``audit`` of the merged output with its data checks; ``audit --no-data``;
- ``diff``: source against the merged output.

Per-tensor overhead is ``(merge wall - cp wall) / tensors``; RSS growth per tensor is the peak RSS of the
merge above that of a process that only imports the API (torch included), divided by the tensor count.

    python benchmarks/many_tensors_bench.py --runs 3 [--workdir /tmp/ckpttool-many-tensors] [--profile dry-run]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

LAYERS, DENSE, EXPERTS, FILES, BLOCK = 61, 3, 256, 163, 16
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "dtype": "bfloat16",
    "hidden_size": 32, "intermediate_size": 64, "moe_intermediate_size": 16, "num_hidden_layers": LAYERS,
    "first_k_dense_replace": DENSE, "n_routed_experts": EXPERTS, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "n_group": 8, "topk_group": 4, "norm_topk_prob": True, "routed_scaling_factor": 2.5, "num_attention_heads": 4,
    "num_key_value_heads": 4, "q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
    "v_head_dim": 8, "head_dim": 8, "num_nextn_predict_layers": 0, "vocab_size": 256, "max_position_embeddings": 64,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "hidden_act": "silu", "rope_interleave": True,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [BLOCK, BLOCK]},
}
#: linear weights DeepSeek-V3 stores in FP8 (the router ``mlp.gate``, norms, embeddings and head stay as they are)
QUANTIZED = ("proj.weight", "proj_with_mqa.weight")
#: an MTP layer's ``eh_proj`` (it joins the embedding and the hidden state) ends like them but stays BF16
KEPT = ("eh_proj.weight",)


def shapes(config: dict | None = None) -> dict[str, tuple[int, ...]]:
    """On-disk names and shapes of the bf16 model, as transformers saves it (ckpttool's own description), with
    the MTP layers ``config`` declares as a release stores them (none for :data:`CONFIG`)."""
    from ckpttool.families import mtp
    from ckpttool.model.architecture import model_info

    info = model_info(config or CONFIG)
    found = dict(info.disk_shapes)
    for layer in mtp.expected(info).values():
        found.update(layer)
    return found


def release(config: dict | None = None) -> dict[str, tuple[str, tuple[int, ...]]]:
    """Every tensor of the FP8 release of ``config`` (default :data:`CONFIG`): name -> (safetensors dtype, shape).
    The linear weights are ``F8_E4M3``, each with its ``F32`` ``weight_scale_inv`` of one value per block of
    ``quantization_config.weight_block_size`` (a config without one: all ``BF16``); the router bias is ``F32``;
    the rest ``BF16``. Shared by
    :func:`build` and ``benchmarks/truescale.py`` (the same names at DeepSeek-V3's real dims)."""
    config = config or CONFIG
    block = config.get("quantization_config", {}).get("weight_block_size")  # none: a BF16 release
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for name, shape in shapes(config).items():
        if block and name.endswith(QUANTIZED) and not name.endswith(KEPT):
            found[name] = ("F8_E4M3", shape)
            scales = tuple(-(-n // b) for n, b in zip(shape, block))
            found[name.removesuffix("weight") + "weight_scale_inv"] = ("F32", scales)
        elif "e_score_correction_bias" in name:
            found[name] = ("F32", shape)
        else:
            found[name] = ("BF16", shape)
    return found


def build(root: Path) -> tuple[int, int]:
    """Write the checkpoint; returns (tensors, bytes)."""
    import torch
    from safetensors.torch import save_file

    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(CONFIG, indent=2))
    tensors: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    for name, (dtype, shape) in sorted(release().items()):
        if dtype == "F8_E4M3":
            tensors[name] = (0.5 * torch.randn(shape, generator=g)).to(torch.float8_e4m3fn)
        elif name.endswith("weight_scale_inv"):
            tensors[name] = 0.01 + torch.rand(shape, generator=g) / 100
        elif "e_score_correction_bias" in name:
            tensors[name] = torch.randn(shape, generator=g)
        elif "norm" in name:  # RMSNorm weights near 1, as trained (the audit flags norms near 0)
            tensors[name] = (1 + 0.05 * torch.randn(shape, generator=g)).to(torch.bfloat16)
        else:
            tensors[name] = (0.02 * torch.randn(shape, generator=g)).to(torch.bfloat16)
    names = sorted(tensors)
    weight_map, total = {}, 0
    for i in range(FILES):
        file = f"model-{i + 1:05d}-of-{FILES:05d}.safetensors"
        part = {n: tensors[n] for n in names[i * len(names) // FILES:(i + 1) * len(names) // FILES]}
        save_file(part, str(root / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        total += sum(t.numel() * t.element_size() for t in part.values())
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return len(tensors), sum(f.stat().st_size for f in root.iterdir())


def timed(argv: list[str]) -> dict:
    """Run a command as a child; its wall time, CPU time (user + sys) and peak RSS (of this probe's only child)."""
    probe = ("import resource, subprocess, sys, time\nt = time.perf_counter()\n"
             "rc = subprocess.run(sys.argv[1:], stdout=subprocess.DEVNULL).returncode\n"
             "u = resource.getrusage(resource.RUSAGE_CHILDREN)\n"
             "print(time.perf_counter() - t, u.ru_utime + u.ru_stime, u.ru_maxrss * 1024, rc)")
    out = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, check=True)
    wall, cpu, rss, rc = out.stdout.split()
    return {"wall": float(wall), "cpu": float(cpu), "rss": int(rss), "rc": int(rc)}


def commands(src: Path, out: Path, workers: int) -> dict[str, list[str]]:
    tool = [sys.executable, "-m", "ckpttool"]
    return {
        "--help": [*tool, "--help"],
        "imports": [sys.executable, "-c", "import ckpttool; ckpttool.merge, ckpttool.audit, ckpttool.diff"],
        "dry-run": [*tool, "merge", str(src), "--dry-run", "--json"],
        "merge": [*tool, "merge", str(src), str(out), "--force", "-q", f"--workers={workers}"],
        "merge --no-audit": [*tool, "merge", str(src), str(out), "--force", "-q", "--no-audit", f"--workers={workers}"],
        "audit": [*tool, "audit", str(out), "--json"],
        "audit --no-data": [*tool, "audit", str(out), "--no-data", "--json"],
        "diff": [*tool, "diff", str(src), str(out), "--json"],
        "cp": ["sh", "-c", f'rm -rf "{out}.cp" && cp -r "{src}" "{out}.cp" && sync'],
    }


def profile(argv: list[str], path: Path) -> None:
    """cProfile one command (``python -m cProfile``) and print its 25 costliest functions by their own time."""
    subprocess.run([sys.executable, "-m", "cProfile", "-o", str(path), "-m", "ckpttool", *argv[3:]],
                   stdout=subprocess.DEVNULL, check=False)
    import pstats

    pstats.Stats(str(path)).sort_stats("tottime").print_stats(25)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-many-tensors"))
    parser.add_argument("--only", nargs="*", help="run only these commands (names as printed)")
    parser.add_argument("--profile", help="cProfile this command once (dry-run, merge, ...) instead of timing")
    parser.add_argument("--keep", action="store_true", help="reuse the checkpoint in --workdir if it is there")
    args = parser.parse_args()
    src, out = args.workdir / "src", args.workdir / "out"
    os.environ["CKPTTOOL_CACHE"] = str(args.workdir / "cache")  # its own description cache, warmed below
    # ckpttool's modules run from their cached bytecode, as an installed package's do (pip compiles them); where
    # the environment says PYTHONDONTWRITEBYTECODE, each run would compile them again (0.1-0.15 s). The first
    # command below writes the cache (``__pycache__`` beside the modules, as Python does by default).
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    if not (args.keep and (src / "model.safetensors.index.json").exists()):
        shutil.rmtree(src, ignore_errors=True)
        start = time.perf_counter()
        build(src)
        print(f"built in {time.perf_counter() - start:.1f} s")
    count = len(json.loads((src / "model.safetensors.index.json").read_text())["weight_map"])
    size = sum(f.stat().st_size for f in src.iterdir())
    print(f"checkpoint: {count} tensors, {size / 1e6:.1f} MB in {len(list(src.glob('*.safetensors')))} files; "
          f"{args.workers} workers; {os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f}")
    cmds = commands(src, out, args.workers)
    subprocess.run(cmds["merge"], check=True)  # warms the description cache and leaves an output to audit
    if args.profile:
        profile(cmds[args.profile], args.workdir / "profile.out")
        return
    names = [n for n in cmds if not args.only or n in args.only or n in ("--help", "imports", "cp", "merge --no-audit")]
    results: dict[str, list[dict]] = {n: [] for n in names}
    for _ in range(args.runs):
        for name in names:
            results[name].append(timed(cmds[name]))
    med = {n: {k: statistics.median(r[k] for r in runs) for k in ("wall", "cpu", "rss")} for n, runs in results.items()}
    base_rss = med["imports"]["rss"]  # the interpreter, torch and transformers' helpers: no tensor yet
    for name, m in med.items():
        rc = sorted({r["rc"] for r in results[name]})
        print(f"{name:18} {m['wall']:7.2f} s  cpu {m['cpu']:7.2f} s  peak RSS {m['rss'] / 2**20:7.1f} MiB  exit {rc}")
    for name in ("merge", "merge --no-audit"):
        if name in med:
            per = (med[name]["wall"] - med["cp"]["wall"]) / count * 1e3
            per_cpu = (med[name]["cpu"] - med["cp"]["cpu"]) / count * 1e3
            grow = (med[name]["rss"] - base_rss) / count
            print(f"{name}: {per:.3f} ms wall ({per_cpu:.3f} ms cpu) per tensor beyond cp (start-up included), "
                  f"RSS +{grow / 1024:.2f} KiB per tensor")
    for name in ("audit", "diff"):
        if name in med and "merge" in med:
            print(f"{name} / merge: {med[name]['wall'] / med['merge']['wall']:.2f} wall, "
                  f"{med[name]['cpu'] / med['merge']['cpu']:.2f} cpu")
    print(f"(resource: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024} MiB in this script)")


if __name__ == "__main__":
    main()
