#!/usr/bin/env python
"""``ckpttool merge`` against the physical limit (``cp -r`` + ``sync``) and against torch's own converters.

Builds a synthetic Llama-shaped bf16 model of about ``--size-gib`` (vocab 32003, so the vocab splits unevenly;
embedding and head of 250 MiB; hidden 4096), saved by torch itself from DTensors on 4 gloo ranks (torchrun):

- ``dcp``: ``torch.distributed.checkpoint.save``; the peer is ``dcp_to_torch_save`` followed by a safetensors
  save of the loaded state dict (what users do today);
- ``hf``: DCP's ``HuggingFaceStorageWriter(save_distributed=True)`` (per-rank safetensors with
  ``DCP_SHARDING_INFO``); the peer is torch's ``consolidate_safetensors_files``.

``--split dim0`` shards every matrix on dim 0, ``dim1`` on dim 1 (row runs), ``mixed`` as Megatron does
(q/k/v/gate/up on dim 0, o/down on dim 1). Each command runs in a fresh process, interleaved, with the page
cache of the benchmark's files dropped first (posix_fadvise DONTNEED); wall time and peak RSS (``ru_maxrss`` of
the command as the only child of a small probe) are medians of ``--runs``. Peak RSS is also reported above
the baseline of ``merge --dry-run`` (imports and plan, no data). CPU time (user + sys) is given beside wall time,
since a shared machine makes wall time noisy. ``start-up`` is a process that only imports what a merge imports
(Python, torch, ckpttool); ``net`` ratios take it off ckpttool's time (the goal of issue 19 is stated net of it).
``--baseline DIR`` also runs the ckpttool package found in ``DIR`` (a copy of an earlier tree), interleaved, for a
before/after on the same input; ``--keep`` reuses the input built in ``--workdir`` and leaves it there.

    python benchmarks/merge_bench.py --size-gib 1 --runs 3 --format dcp --split dim0
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, WORLD = 4096, 11008, 32, 8, 32003, 4


def config(size_gib: float) -> dict:
    per_layer = (2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN * KV_HEADS // HEADS + 3 * HIDDEN * INTER) * 2
    layers = max(1, round((size_gib * 2**30 - 2 * VOCAB * HIDDEN * 2) / per_layer))
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "tie_word_embeddings": False, "dtype": "bfloat16",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}


def produce(out: Path, fmt: str, split: str, size_gib: float) -> None:
    """Run under torchrun: every rank builds its pieces as DTensors and torch saves them."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    mesh = init_device_mesh("cpu", (WORLD,))
    cfg = config(size_gib)
    state = sharded_state(cfg, split, rank, mesh)
    if fmt == "dcp":
        dcp.save(state, checkpoint_id=str(out))
    else:
        from torch.distributed.checkpoint import HuggingFaceStorageWriter

        dcp.save(state, storage_writer=HuggingFaceStorageWriter(str(out), save_distributed=True))
    if rank == 0:
        (_files(out) / "config.json").write_text(json.dumps(cfg))
    dist.destroy_process_group()


def sharded_state(cfg: dict, split: str, rank: int, mesh) -> dict:
    """This rank's DTensors of the synthetic model (bf16, seeded per tensor and rank; norms replicated)."""
    import torch
    from torch.distributed.tensor import DTensor, Replicate, Shard

    kv = HIDDEN * KV_HEADS // HEADS
    shapes = {"model.embed_tokens.weight": ((VOCAB, HIDDEN), 0), "lm_head.weight": ((VOCAB, HIDDEN), 0),
              "model.norm.weight": ((HIDDEN,), None)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        for name, shape, dim in (("self_attn.q_proj", (HIDDEN, HIDDEN), 0), ("self_attn.k_proj", (kv, HIDDEN), 0),
                                 ("self_attn.v_proj", (kv, HIDDEN), 0), ("self_attn.o_proj", (HIDDEN, HIDDEN), 1),
                                 ("mlp.gate_proj", (INTER, HIDDEN), 0), ("mlp.up_proj", (INTER, HIDDEN), 0),
                                 ("mlp.down_proj", (HIDDEN, INTER), 1)):
            shapes[p + name + ".weight"] = (shape, {"dim0": 0, "dim1": 1, "mixed": dim}[split])
        shapes[p + "input_layernorm.weight"] = ((HIDDEN,), None)
        shapes[p + "post_attention_layernorm.weight"] = ((HIDDEN,), None)
    state = {}
    for n, (name, (shape, dim)) in enumerate(shapes.items()):
        g = torch.Generator().manual_seed(1000 * n + rank)
        if dim is None:
            local, placement = torch.ones(shape, dtype=torch.bfloat16), Replicate()
        else:
            sizes = [len(c) for c in torch.arange(shape[dim]).chunk(WORLD)] + [0] * WORLD
            local_shape = list(shape)
            local_shape[dim] = sizes[rank]
            local, placement = (0.02 * torch.randn(local_shape, generator=g)).to(torch.bfloat16), Shard(dim)
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        state[name] = DTensor.from_local(local, mesh, [placement], run_check=False, shape=torch.Size(shape), stride=stride)
    return state


def build(work: Path, fmt: str, split: str, size_gib: float) -> Path:
    out = work / "src"
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={WORLD}", __file__, "--produce", str(out), "--format", fmt,
                    "--split", split, "--size-gib", str(size_gib)], check=True, capture_output=True)
    return _files(out)


def _files(out: Path) -> Path:
    """Where the checkpoint's files are (some torch versions put DCP's per-rank HF files under ``sharded/``)."""
    return out / "sharded" if (out / "sharded").is_dir() else out


PEER_DCP = r"""
import sys, torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from safetensors.torch import save_file
dcp_to_torch_save(sys.argv[1], sys.argv[2] + ".pt")
state = torch.load(sys.argv[2] + ".pt", weights_only=True)
save_file({k: v.contiguous() for k, v in state.items()}, sys.argv[2] + "/model.safetensors")
"""

PEER_HF = r"""
import json, sys
from pathlib import Path
from torch.distributed.checkpoint._consolidate_hf_safetensors import consolidate_safetensors_files
from safetensors import safe_open
names = set()
for f in Path(sys.argv[1]).glob("*.safetensors"):
    with safe_open(f, "pt") as h:
        names.update(h.keys())
consolidate_safetensors_files(sys.argv[1], sys.argv[2], dict.fromkeys(names, 1), num_threads=int(sys.argv[3]))
"""


def drop_cache(*roots: Path) -> None:
    for root in roots:
        for f in (root.rglob("*") if root.is_dir() else [root] if root.exists() else []):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                finally:
                    os.close(fd)


def measure(cmd: list[str]) -> tuple[float, int, float]:
    """Wall seconds, peak RSS and CPU seconds (user + sys) of ``cmd`` run as the only child of a small probe."""
    probe = (
        "import resource,subprocess,sys,time;t=time.perf_counter();subprocess.run(sys.argv[1:],check=True,"
        "stdout=subprocess.DEVNULL,stderr=subprocess.DEVNULL);u=resource.getrusage(resource.RUSAGE_CHILDREN);"
        "print(time.perf_counter()-t,u.ru_maxrss*1024,u.ru_utime+u.ru_stime)"
    )
    out = subprocess.run([sys.executable, "-c", probe, *cmd], check=True, capture_output=True, text=True).stdout.split()
    return float(out[0]), int(out[1]), float(out[2])


def tool(tree: Path | None) -> list[str]:
    """How to start ``ckpttool``: this checkout's, or the package in ``tree`` (ahead of this one on the path)."""
    if tree is None:
        return [sys.executable, "-m", "ckpttool"]
    run = f"import runpy, sys; sys.path.insert(0, {str(tree)!r}); runpy.run_module('ckpttool', run_name='__main__')"
    return [sys.executable, "-c", run]


#: what every merge imports before it reads a byte: the start-up the goals are stated net of
STARTUP = "import torch, safetensors, huggingface_hub, ckpttool.cli, ckpttool.commands.merge, ckpttool.execute.executor"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=1.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--format", choices=["dcp", "hf"], default="dcp")
    parser.add_argument("--split", choices=["dim0", "dim1", "mixed"], default="mixed")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-bench"))
    parser.add_argument("--produce", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--no-peer", action="store_true", help="skip torch's converter (it needs RAM for the whole model)")
    parser.add_argument("--baseline", type=Path, help="also run the ckpttool package in this directory (an earlier tree)")
    parser.add_argument("--keep", action="store_true", help="reuse the input in --workdir if it is there, and keep it")
    args = parser.parse_args()
    if args.produce:
        produce(args.produce, args.format, args.split, args.size_gib)
        return
    work = args.workdir
    src = _files(work / "src")
    if not (args.keep and src.is_dir() and any(src.iterdir())):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        src = build(work, args.format, args.split, args.size_gib)
    nbytes = sum(f.stat().st_size for f in src.iterdir() if f.is_file())
    out, copy, peer_out = work / "out", work / "copy", work / "peer"
    options = ["merge", str(src), str(out), "--force", "-q", "--max-shard-size", "1000GB", "--workers", str(args.workers)]
    ckpttool = [*tool(None), *options]
    commands = {"ckpttool": ckpttool, "cp": ["sh", "-c", f"cp -r '{src}' '{copy}' && sync"],
                "start-up": [sys.executable, "-c", STARTUP]}
    if args.baseline is not None:
        commands["baseline"] = [*tool(args.baseline), *options]
    if not args.no_peer:
        peer = (PEER_DCP, str(src), str(peer_out)) if args.format == "dcp" else (PEER_HF, str(src), str(peer_out), str(args.workers))
        commands["torch"] = ["sh", "-c", f"mkdir -p '{peer_out}' && {sys.executable} -c '{peer[0]}' {' '.join(peer[1:])} && sync"]
    results: dict[str, list[tuple[float, int, float]]] = {name: [] for name in commands}
    for _ in range(args.runs):
        for name, cmd in commands.items():
            for leftover in (copy, peer_out, out):
                shutil.rmtree(leftover, ignore_errors=True)
            os.sync()  # the last command's deletes and writes are on disk before the next one starts
            drop_cache(src)
            results[name].append(measure(cmd))
    baseline = measure([*ckpttool, "--dry-run"])[1]
    from ckpttool.commands.merge import prepare
    from ckpttool.writers.hf import predict_peak_bytes

    plan = prepare(src).plan
    largest_piece = max(math.prod(c.piece.box.sizes) * 2 for t in plan.targets for c in t.copies)
    t = {name: statistics.median(r[0] for r in runs) for name, runs in results.items()}
    m = {name: statistics.median(r[1] for r in runs) for name, runs in results.items()}
    cpu = {name: statistics.median(r[2] for r in runs) for name, runs in results.items()}
    print(f"input: {args.format}, split {args.split}, {nbytes / 2**30:.2f} GiB, {len(plan.targets)} tensors, largest piece "
          f"{largest_piece / 2**20:.0f} MiB, largest tensor {plan.largest_target_bytes() / 2**20:.0f} MiB; {args.workers} workers; "
          f"load average {os.getloadavg()[0]:.1f}")
    for name in commands:
        print(f"  {name:9s} {t[name]:7.2f} s  cpu {cpu[name]:6.2f} s  {nbytes / t[name] / 2**20:7.1f} MiB/s  "
              f"peak RSS {m[name] / 2**20:7.0f} MiB")
    for name in ("ckpttool", "baseline"):
        if name in t:
            net = t[name] - t["start-up"]
            print(f"  {name}/cp = {t[name] / t['cp']:.2f}; net of start-up ({t['start-up']:.2f} s): {net / t['cp']:.2f} "
                  f"({net:.2f} s, cpu {cpu[name] - cpu['start-up']:.2f} s)")
    # the prediction counts the buffers above what the process holds once its imports are done: a dry run of a DCP
    # source imports no torch (31 MiB), the merge does (the start-up row), so the floor is the larger of the two
    floor = max(baseline, m["start-up"])
    print(f"  ckpttool peak above its --dry-run ({baseline / 2**20:.0f} MiB) or start-up ({m['start-up'] / 2**20:.0f} MiB) "
          f"baseline, the larger: {(m['ckpttool'] - floor) / 2**20:.0f} MiB "
          f"(predicted at most {predict_peak_bytes(plan, args.workers) / 2**20:.0f} MiB; goal 2 x largest piece + 64 MiB = "
          f"{(2 * largest_piece + 2**26) / 2**20:.0f} MiB)")
    if "torch" in commands:
        print(f"  ckpttool/torch: time {t['ckpttool'] / t['torch']:.2f}, peak RSS {m['ckpttool'] / m['torch']:.2f}")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
