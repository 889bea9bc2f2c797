#!/usr/bin/env python
"""``ckpttool split --to dcp`` against the physical limit (``cp -r`` + ``sync``) and against the merge back.

Builds a synthetic Llama-shaped bf16 HuggingFace checkpoint of about ``--size-gib`` (the shapes of
``merge_bench.py``: vocab 32003, hidden 4096; one safetensors file per layer with an index), then times, each in
a fresh process with the page cache of its input dropped, medians of ``--runs``:

- ``split``: ``ckpttool split SRC OUT --to dcp`` for ``--mesh`` (default ``--fsdp 4 --tp 2``: FSDP2 over TP,
  ``_StridedShard`` rows, an uneven vocab);
- ``cp``: ``cp -r SRC`` and ``sync``, the same bytes through the same disk;
- ``merge``: ``ckpttool merge`` of the split back into one safetensors file (left out with ``--no-merge``, which
  also keeps the work directory at two copies of the model: the source and one output at a time);
- ``base``: with ``--base TREE``, the split of the ckpttool package in ``TREE`` (a ``git archive`` of another
  commit), run alternately with this one's, so before and after share the machine's load.

CPU seconds (user + sys, the command and its children) are given per GiB beside the wall time: a fast disk
shows what a slow one hides. Peak RSS is ``ru_maxrss`` of the command as the only child of a small probe, and
also above ``split --dry-run`` (imports and plan, no data): with several sizes it shows whether memory stays
flat as the model grows.

    python benchmarks/split_bench.py --size-gib 1 2 --runs 3
    python benchmarks/split_bench.py --size-gib 2 --runs 2 --no-merge --base /tmp/base-tree
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import config, drop_cache, measure, tool  # noqa: E402


#: normal values drawn once for every tensor of the synthetic model (128 MiB of bf16)
POOL = 2**26


def build(src: Path, size_gib: float) -> int:
    """Write the HF checkpoint one layer at a time (never the whole model in memory); returns its bytes."""
    import torch
    from safetensors.torch import save_file

    cfg = config(size_gib)
    h, inter, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] * cfg["num_key_value_heads"] // cfg["num_attention_heads"]
    groups = [{"model.embed_tokens.weight": (cfg["vocab_size"], h), "lm_head.weight": (cfg["vocab_size"], h), "model.norm.weight": (h,)}]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        groups.append({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                       p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                       p + "mlp.gate_proj.weight": (inter, h), p + "mlp.up_proj.weight": (inter, h),
                       p + "mlp.down_proj.weight": (h, inter), p + "input_layernorm.weight": (h,),
                       p + "post_attention_layernorm.weight": (h,)})
    src.mkdir(parents=True)
    weight_map, total = {}, 0
    # normal values drawn once; each tensor is a run of windows of them at offsets of its own, so building tens of
    # GiB costs memory copies, not random draws, and no two tensors hold the same bytes
    pool = torch.randn(POOL, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    start = 0

    def values(shape: tuple) -> torch.Tensor:
        nonlocal start
        out = torch.empty(shape, dtype=torch.bfloat16).view(-1)
        for at in range(0, out.numel(), POOL // 2):
            n = min(POOL // 2, out.numel() - at)
            start = (start + 7919) % (POOL // 2)
            out[at:at + n] = pool[start:start + n]
        return out.view(shape)

    for n, group in enumerate(groups, 1):
        name = f"model-{n:05d}-of-{len(groups):05d}.safetensors"
        tensors = {k: values(shape) for k, shape in group.items()}
        save_file(tensors, str(src / name), {"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
        total += sum(t.numel() * 2 for t in tensors.values())
        del tensors
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps(cfg))
    return sum(f.stat().st_size for f in src.iterdir())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, nargs="+", default=[1.0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--mesh", default="--fsdp 4 --tp 2", help="split's mesh options")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-split-bench"))
    parser.add_argument("--no-merge", action="store_true", help="time no merge back (less disk)")
    parser.add_argument("--base", type=Path, help="also time the split of the ckpttool package in this tree")
    args = parser.parse_args()
    for size in args.size_gib:
        work = args.workdir
        shutil.rmtree(work, ignore_errors=True)
        src, out, copy, back = work / "src", work / "dcp", work / "copy", work / "back"
        nbytes = build(src, size)
        options = ["split", str(src), str(out), "--to", "dcp", *args.mesh.split(), "--force", "-q", "--workers",
                   str(args.workers)]
        split = [*tool(None), *options]
        commands = {
            "split": split,
            "cp": ["sh", "-c", f"cp -r '{src}' '{copy}' && sync"],
            "merge": [*tool(None), "merge", str(out), str(back), "--force", "-q", "--no-audit",
                      "--max-shard-size", "1000GB", "--workers", str(args.workers)],
        }
        if args.no_merge:
            del commands["merge"]
        if args.base is not None:
            commands["base"] = [*tool(args.base), *options]
        results: dict[str, list[tuple[float, int]]] = {name: [] for name in commands}
        for _ in range(args.runs):
            for name, cmd in commands.items():
                for leftover in ([copy, *([out] if args.no_merge else [])] if name == "cp" else [back] if name == "merge"
                                 else [out, back, copy]):
                    shutil.rmtree(leftover, ignore_errors=True)
                os.sync()
                drop_cache(src, out)
                results[name].append(measure(cmd))
                if name == "cp":
                    shutil.rmtree(copy, ignore_errors=True)
        baseline = measure([*split[:-3], "--dry-run"])[1]  # keeps --force: OUT holds the last split
        t = {name: statistics.median(r[0] for r in runs) for name, runs in results.items()}
        m = {name: statistics.median(r[1] for r in runs) for name, runs in results.items()}
        cpu = {name: statistics.median(r[2] for r in runs) for name, runs in results.items()}
        print(f"{nbytes / 2**30:.2f} GiB bf16, mesh {args.mesh}, {args.workers} workers:")
        for name in commands:
            print(f"  {name:6s} {t[name]:7.2f} s  {nbytes / t[name] / 2**20:7.1f} MiB/s  peak RSS {m[name] / 2**20:6.0f} MiB  "
                  f"CPU {cpu[name]:6.2f} s ({cpu[name] / (nbytes / 2**30):.2f} s/GiB)")
        print(f"  split/cp = {t['split'] / t['cp']:.2f}; split peak above its --dry-run baseline "
              f"({baseline / 2**20:.0f} MiB): {(m['split'] - baseline) / 2**20:.0f} MiB")
        if "base" in t:
            print(f"  base/cp = {t['base'] / t['cp']:.2f}; CPU split/base = {cpu['split'] / cpu['base']:.2f}")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
