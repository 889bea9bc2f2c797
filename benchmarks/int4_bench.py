#!/usr/bin/env python
"""A compressed-tensors ``pack-quantized`` INT4 release dequantized to BF16, against the plain merge of the same
output bytes, and the peak memory of the dequantizing merge as the release grows (it must stay flat: streamed).

Builds, in ``--workdir``, a synthetic Llama-shaped INT4 release (hidden 4096, intermediate 11008, vocab 32003;
every Linear weight of the layers as int32 ``weight_packed`` (8 values a word), a bfloat16 ``weight_scale`` per 32
values and ``weight_shape``, symmetric, Kimi K2's W4A16 scheme; embeddings, head and norms bfloat16; one
safetensors file per layer and an index; compressed-tensors' ``quantization_config``), sized so that its BF16
output is about ``--size-gib``. Then, each in a fresh process, interleaved, page cache dropped before each run,
medians of ``--runs``:

- ``dequantize``: ``ckpttool merge INT4 OUT --dtype bfloat16`` (unpack, times the scale, streamed);
- ``plain bf16``: ``ckpttool merge BF16 OUT`` of that output (byte copies of the same output bytes);
- ``re-pack``: ``ckpttool merge BF16 OUT --quantize int4 --scales-from INT4`` (the release's bytes back).

Wall time, CPU time (user + system, all threads) and peak RSS as in ``merge_bench.py``. ``--flat 1 2 4`` then
measures the dequantizing merge's peak RSS alone on releases whose outputs are 1, 2 and 4 GiB (one run each; the
release and its output on disk, nothing else: 1.25x the size).

    python benchmarks/int4_bench.py --size-gib 2 --runs 3 --flat 1 2 4
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import drop_cache, measure
from quant_bench import HEADS, HIDDEN, INTER, KV_HEADS, VOCAB, interleaved, write_model

GROUP = 32
CT_CONFIG = {"config_groups": {"group_0": {"format": "pack-quantized", "input_activations": None,
                                           "output_activations": None, "targets": ["Linear"],
                                           "weights": {"dynamic": False, "group_size": GROUP, "num_bits": 4,
                                                       "strategy": "group", "symmetric": True, "type": "int"}}},
             "format": "pack-quantized", "ignore": ["lm_head"], "quant_method": "compressed-tensors",
             "quantization_status": "compressed", "version": "0.20.0"}


def config(size_gib: float) -> dict:
    """A Llama config whose BF16 model is about ``size_gib``."""
    kv = HIDDEN * KV_HEADS // HEADS
    per_layer = 2 * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 3 * HIDDEN * INTER)  # bfloat16 bytes
    layers = max(1, round((size_gib * 2**30 - 2 * VOCAB * HIDDEN * 2) / per_layer))
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "tie_word_embeddings": False, "dtype": "bfloat16",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "quantization_config": CT_CONFIG}


def build(src: Path, size_gib: float) -> None:
    """The synthetic INT4 release: seeded codes and scales, one file per layer (memory: one layer at a time)."""
    import torch

    def int4(name: str, shape: tuple[int, int], g) -> dict:
        rows, cols = shape
        words = torch.randint(-2**31, 2**31, (rows, cols // 8), generator=g, dtype=torch.int64)
        scales = torch.rand(rows, cols // GROUP, generator=g).mul_(4e-3).add_(1e-3).to(torch.bfloat16)
        return {name + ".weight_packed": words.to(torch.int32), name + ".weight_scale": scales,
                name + ".weight_shape": torch.tensor(shape, dtype=torch.int64)}

    write_model(src, config(size_gib), int4)


def gib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.iterdir()) / 2**30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0, help="the BF16 output's size")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--flat", type=float, nargs="*", default=[], help="BF16 output sizes for the memory curve")
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-int4-bench"))
    args = parser.parse_args()
    work = args.workdir
    merge = [sys.executable, "-m", "ckpttool", "merge", "--force", "-q", "--max-shard-size", "1000GB",
             "--workers", str(args.workers)]
    if args.runs > 0:
        shutil.rmtree(work, ignore_errors=True)
        src, bf16, out = work / "int4", work / "bf16", work / "out"
        build(src, args.size_gib)
        subprocess.run([*merge, str(src), str(bf16), "--dtype", "bfloat16"], check=True, capture_output=True)
        commands = {
            "dequantize": [*merge, str(src), str(out), "--dtype", "bfloat16"],
            "plain bf16": [*merge, str(bf16), str(out)],
            "re-pack": [*merge, str(bf16), str(out), "--quantize", "int4", "--scales-from", str(src)],
        }
        t, m, cpu = interleaved(commands, args.runs, out, (src, bf16))
        print(f"int4 input {gib(src):.2f} GiB, bf16 {gib(bf16):.2f} GiB; {args.workers} workers; {args.runs} runs, "
              "medians")
        for name in commands:
            print(f"  {name:10s} {t[name]:7.2f} s  CPU {cpu[name]:6.2f} s  peak RSS {m[name] / 2**20:6.0f} MiB")
        print(f"  dequantize / plain bf16 = {t['dequantize'] / t['plain bf16']:.2f} (CPU "
              f"{cpu['dequantize'] / cpu['plain bf16']:.2f}); re-pack / plain bf16 = "
              f"{t['re-pack'] / t['plain bf16']:.2f} (CPU {cpu['re-pack'] / cpu['plain bf16']:.2f})")
        shutil.rmtree(work, ignore_errors=True)
    for size in args.flat:
        shutil.rmtree(work, ignore_errors=True)
        src, out = work / "int4", work / "out"
        build(src, size)
        drop_cache(src)
        wall, peak, cpu_s = measure([*merge, str(src), str(out), "--dtype", "bfloat16"])
        print(f"  flat: int4 {gib(src):.2f} GiB -> bf16 {gib(out):.2f} GiB: {wall:6.1f} s, CPU {cpu_s:6.1f} s, "
              f"peak RSS {peak / 2**20:6.0f} MiB")
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
