#!/usr/bin/env python
"""``merge --adapter`` (a LoRA fuse) against the plain merge of the same base: wall time, CPU, peak RSS, predicted peak.

Builds, in ``--workdir``, a Llama-shaped bfloat16 base of about ``--size-gib`` (hidden 2048, FFN 5504, GQA 16/4
heads, vocab 32000; layers to fit) saved as one ``model.safetensors`` with its ``config.json``, and a PEFT adapter
folder of rank ``--rank`` (64) on q/k/v/o and gate/up/down, float32 as PEFT saves one for a bf16 base (``lora_B``
filled: a trained adapter), ``lora_alpha`` = 2 x rank. Then runs, each in a fresh process with the page cache of the
inputs dropped first: the plain ``merge`` of the base, and ``merge --adapter``. Peak RSS is ``ru_maxrss`` of the
command as the only child of a small probe; it is also given above the ``--dry-run`` baseline (imports and plan, no
data, the architecture's description cached by a first dry run), next to the merge's own prediction (``predict_peak_bytes`` of the plan, the adapter's deltas attached):
the fuse must stay within it (issue 27). A dry run, and a plain merge of safetensors (file-to-file copies), import
no torch, and a fuse does, so the fuse's peak is also given above a process that only imports what a merge
imports, torch included (merge_bench.py's start-up). Not a timed test: run it by hand and keep the figures.

    python benchmarks/lora_bench.py --size-gib 2 --workers 2
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
from merge_bench import STARTUP, drop_cache, measure, tool  # noqa: E402  (the same probe, cache drop and start-up)

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB = 2048, 5504, 16, 4, 32000
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def config(size_gib: float) -> dict:
    kv = HIDDEN * KV_HEADS // HEADS
    per_layer = (2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 3 * HIDDEN * INTER) * 2
    layers = max(1, round((size_gib * 2**30 - 2 * VOCAB * HIDDEN * 2) / per_layer))
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "tie_word_embeddings": False, "dtype": "bfloat16",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}


def shapes(cfg: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of the base, by its HuggingFace name."""
    h, i, kv = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] * KV_HEADS // HEADS
    out = {"model.embed_tokens.weight": (VOCAB, h), "model.norm.weight": (h,), "lm_head.weight": (VOCAB, h)}
    for n in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{n}."
        out.update({p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
                    p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
                    p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i)})
    return out


def build(work: Path, size_gib: float, rank: int) -> tuple[Path, Path]:
    """The base and the adapter folders, written once (the tensors are random: only their sizes matter)."""
    import torch
    from safetensors.torch import save_file

    cfg = config(size_gib)
    base, adapter = work / "base", work / "adapter"
    base.mkdir(parents=True)
    adapter.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    every = shapes(cfg)
    save_file({name: (torch.randn(shape, generator=g) * 0.02).to(torch.bfloat16) for name, shape in every.items()},
              str(base / "model.safetensors"), metadata={"format": "pt"})
    (base / "config.json").write_text(json.dumps(cfg, indent=2))
    lora = {}
    for name, shape in every.items():
        module = name[: -len(".weight")]
        if module.rsplit(".", 1)[-1] in TARGETS:
            lora[f"base_model.model.{module}.lora_A.weight"] = torch.randn(rank, shape[1], generator=g) * 0.01
            lora[f"base_model.model.{module}.lora_B.weight"] = torch.randn(shape[0], rank, generator=g) * 0.01
    save_file(lora, str(adapter / "adapter_model.safetensors"), metadata={"format": "pt"})
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(TARGETS), "bias": "none",
        "task_type": "CAUSAL_LM", "fan_in_fan_out": False, "use_rslora": False, "use_dora": False}, indent=2))
    return base, adapter


def predicted(base: Path, adapter: Path | None, workers: int) -> int:
    """The merge's predicted peak for the plan it carries out (the adapter's deltas attached when given)."""
    from ckpttool.commands.merge import prepare
    from ckpttool.families.registry import adapter_for
    from ckpttool.lora.adapter import read_adapter
    from ckpttool.lora.attach import attach_to_family
    from ckpttool.writers.hf import predict_peak_bytes

    prepared = prepare(base)
    plan = prepared.plan
    if adapter is not None:
        plan = attach_to_family(plan, [read_adapter(adapter)], adapter_for(prepared.model))
    return predict_peak_bytes(plan, workers)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--rank", type=int, default=64)
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-lora-bench"))
    parser.add_argument("--keep", action="store_true", help="reuse the input in --workdir if it is there, and keep it")
    args = parser.parse_args()
    work = args.workdir
    base, adapter = work / "base", work / "adapter"
    if not (args.keep and (base / "model.safetensors").is_file() and (adapter / "adapter_config.json").is_file()):
        shutil.rmtree(work, ignore_errors=True)
        base, adapter = build(work, args.size_gib, args.rank)
    out = work / "out"
    options = ["merge", str(base), str(out), "--force", "-q", "--max-shard-size", "1000GB", "--workers", str(args.workers)]
    commands = {"merge": [*tool(None), *options], "merge --adapter": [*tool(None), *options, "--adapter", str(adapter)]}
    results: dict[str, list[tuple[float, int, float]]] = {name: [] for name in commands}
    measure([*commands["merge"], "--dry-run"])  # the architecture described once: every run finds it cached
    for _ in range(args.runs):
        for name, cmd in commands.items():
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            drop_cache(base, adapter)
            results[name].append(measure(cmd))
    baseline = {name: measure([*cmd, "--dry-run"])[1] for name, cmd in commands.items()}
    # a dry run (and a plain merge's copies) need no torch; a fuse does: its peak is also given above a process
    # that only imports what a merge imports, torch included
    startup = measure([sys.executable, "-c", STARTUP + ", ckpttool.lora.attach"])[1]
    predictions = {"merge": predicted(base, None, args.workers), "merge --adapter": predicted(base, adapter, args.workers)}
    nbytes = (base / "model.safetensors").stat().st_size
    print(f"input: bf16 Llama {nbytes / 2**30:.2f} GiB ({config(args.size_gib)['num_hidden_layers']} layers), LoRA rank "
          f"{args.rank} on {', '.join(TARGETS)} ({(adapter / 'adapter_model.safetensors').stat().st_size / 2**20:.0f} MiB "
          f"float32); {args.workers} workers; load average {os.getloadavg()[0]:.1f}")
    for name in commands:
        t = statistics.median(r[0] for r in results[name])
        rss = statistics.median(r[1] for r in results[name])
        cpu = statistics.median(r[2] for r in results[name])
        print(f"  {name:16s} {t:7.2f} s  cpu {cpu:6.2f} s  {nbytes / t / 2**20:7.1f} MiB/s  peak RSS {rss / 2**20:6.0f} MiB"
              f"  above --dry-run {(rss - baseline[name]) / 2**20:5.0f} MiB (predicted at most "
              f"{predictions[name] / 2**20:.0f} MiB); above start-up with torch ({startup / 2**20:.0f} MiB) "
              f"{(rss - startup) / 2**20:.0f} MiB")
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
