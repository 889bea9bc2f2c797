#!/usr/bin/env python
"""Quantized merges against the plain merge of the same bytes: ``--dtype bfloat16`` on an FP8 checkpoint
(dequantizing) and ``--quantize fp8`` on its BF16 equivalent (quantizing).

Builds, in ``--workdir``, a synthetic Llama-shaped FP8 checkpoint of about ``--size-gib`` in the DeepSeek-V3
convention (hidden 4096, intermediate 11008, vocab 32003; every Linear weight of the layers F8_E4M3 with a float32
``weight_scale_inv`` per 128x128 block; embeddings, head and norms bfloat16; one safetensors file per layer and an
index; ``quantization_config`` in config.json). Then, each in a fresh process, interleaved, page cache of the
inputs dropped before each run, medians of ``--runs``:

- ``plain fp8``: ``ckpttool merge SRC OUT`` (kept quantized: byte copies);
- ``dequantize``: ``ckpttool merge SRC OUT --dtype bfloat16`` (FP8 x scale, streamed);
- ``plain bf16``: ``ckpttool merge BF16 OUT`` of the dequantized output (byte copies of twice the bytes);
- ``quantize``: ``ckpttool merge BF16 OUT --quantize fp8`` (amax, scale, divide, round, and the round trip).

Wall time, CPU time (user + system, all threads) and peak RSS as in ``merge_bench.py`` (the command the only child
of a small probe; start-up, plan and the headers-only audit of the output included). Peak RSS is also given above
``merge --dry-run``'s. CPU time is the figure to compare on a shared machine: other jobs stretch the wall time, not
the CPU seconds the merge itself spends.

``--codec`` first times the FP8 decoder alone (one thread, CPU seconds per GiB of FP8 codes decoded into
bfloat16): a [11008, 4096] weight with 128x128 block scales, in chunks of 32 MiB of output as the executor cuts
them (``CHUNK_BYTES``), its buffers reused from chunk to chunk.

    python benchmarks/quant_bench.py --size-gib 2 --runs 3
    python benchmarks/quant_bench.py --codec --runs 0
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

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import drop_cache, measure

HIDDEN, INTER, HEADS, KV_HEADS, VOCAB, BLOCK = 4096, 11008, 32, 8, 32003, 128


def config(size_gib: float) -> dict:
    kv = HIDDEN * KV_HEADS // HEADS
    per_layer = 2 * HIDDEN * HIDDEN + 2 * HIDDEN * kv + 3 * HIDDEN * INTER  # FP8: one byte each
    layers = max(1, round((size_gib * 2**30 - 2 * VOCAB * HIDDEN * 2) / per_layer))
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": VOCAB, "hidden_size": HIDDEN,
            "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "tie_word_embeddings": False, "dtype": "bfloat16",
            "max_position_embeddings": 4096, "rms_norm_eps": 1e-5,
            "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                    "weight_block_size": [BLOCK, BLOCK], "modules_to_not_convert": ["lm_head"]}}


def build(src: Path, size_gib: float) -> None:
    """The synthetic FP8 checkpoint: seeded values, one file per layer (memory: one layer at a time)."""
    import torch

    def fp8(name: str, shape: tuple[int, int], g) -> dict:
        values = torch.randn(shape, generator=g).mul_(100).clamp_(-448, 448).to(torch.float8_e4m3fn)
        grid = (math.ceil(shape[0] / BLOCK), math.ceil(shape[1] / BLOCK))
        return {name + ".weight": values,
                name + ".weight_scale_inv": torch.rand(grid, generator=g).mul_(1e-4).add_(1e-5)}

    write_model(src, config(size_gib), fp8)


def write_model(src: Path, cfg: dict, linear) -> None:
    """A seeded Llama-shaped checkpoint of ``cfg`` in ``src``: bfloat16 embeddings, head and norms, and each Linear
    weight of the layers as the tensors ``linear(name, shape, generator)`` gives (its quantized form); one
    safetensors file per layer and an index (memory: one layer at a time)."""
    import torch
    from safetensors.torch import save_file

    src.mkdir(parents=True)
    kv = HIDDEN * KV_HEADS // HEADS
    weight_map: dict[str, str] = {}
    total = 0

    def save(tensors: dict, file: str) -> None:
        nonlocal total
        save_file(tensors, src / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, file))
        total += sum(t.numel() * t.element_size() for t in tensors.values())

    g = torch.Generator().manual_seed(0)
    embed = {n: (0.02 * torch.randn(VOCAB, HIDDEN, generator=g)).to(torch.bfloat16)
             for n in ("model.embed_tokens.weight", "lm_head.weight")}
    save({**embed, "model.norm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}, "model-embed.safetensors")
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        tensors = {p + "input_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16),
                   p + "post_attention_layernorm.weight": torch.ones(HIDDEN, dtype=torch.bfloat16)}
        for name, shape in (("self_attn.q_proj", (HIDDEN, HIDDEN)), ("self_attn.k_proj", (kv, HIDDEN)),
                            ("self_attn.v_proj", (kv, HIDDEN)), ("self_attn.o_proj", (HIDDEN, HIDDEN)),
                            ("mlp.gate_proj", (INTER, HIDDEN)), ("mlp.up_proj", (INTER, HIDDEN)),
                            ("mlp.down_proj", (HIDDEN, INTER))):
            tensors.update(linear(p + name, shape, g))
        save(tensors, f"model-layer-{i:03d}.safetensors")
    (src / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (src / "config.json").write_text(json.dumps(cfg))


def codec_cpu(repeats: int = 8) -> float:
    """CPU seconds per GiB of FP8 codes the FP8 block decoder spends, on one thread (see the module docstring)."""
    import time

    import torch

    from ckpttool.execute.buffers import CHUNK_BYTES
    from ckpttool.quant.decode import Fp8Blocks

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    values = torch.randn(INTER, HIDDEN, generator=g).mul_(100).clamp_(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.rand(math.ceil(INTER / BLOCK), HIDDEN // BLOCK, generator=g).mul_(1e-4).add_(1e-5)
    buffers: dict[str, torch.Tensor] = {}

    def scratch(name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        kind = {"F32": torch.float32, "I32": torch.int32, "BF16": torch.bfloat16}[dtype]
        n = math.prod(shape) * kind.itemsize
        if name not in buffers or buffers[name].numel() < n:
            buffers[name] = torch.empty(n, dtype=torch.uint8)
        return buffers[name][:n].view(kind).reshape(shape)

    decoder, rows = Fp8Blocks((BLOCK, BLOCK)), CHUNK_BYTES // (2 * HIDDEN)
    out = torch.empty(rows, HIDDEN, dtype=torch.bfloat16)
    start_cpu = None
    for repeat in range(repeats + 1):  # the first pass allocates the buffers and is not timed
        if repeat == 1:
            start_cpu = time.process_time()
        for start in range(0, INTER, rows):
            stop = min(start + rows, INTER)
            decoder.decode(values[start:stop], scales[start // BLOCK : -(-stop // BLOCK)], start, out[: stop - start], scratch)
    return (time.process_time() - start_cpu) / (repeats * values.numel() / 2**30)


def interleaved(commands: dict[str, list[str]], runs: int, out: Path, inputs: tuple[Path, ...]) -> tuple[
        dict[str, float], dict[str, float], dict[str, float]]:
    """Each command ``runs`` times, interleaved, ``out`` removed and the page cache of ``inputs`` dropped before
    each run: the medians of wall seconds, peak RSS and CPU seconds, by name."""
    results: dict[str, list[tuple[float, int, float]]] = {name: [] for name in commands}
    for _ in range(runs):
        for name, cmd in commands.items():
            shutil.rmtree(out, ignore_errors=True)
            os.sync()
            drop_cache(*inputs)
            results[name].append(measure(cmd))
    return tuple({name: statistics.median(r[i] for r in done) for name, done in results.items()}  # type: ignore[return-value]
                 for i in range(3))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-quant-bench"))
    parser.add_argument("--codec", action="store_true", help="time the FP8 decoder alone first (CPU s per GiB)")
    args = parser.parse_args()
    if args.codec:
        per_gib = codec_cpu()
        print(f"FP8 decoder: {per_gib:.2f} CPU s per GiB of FP8 codes ({per_gib / 2:.2f} per GiB of bfloat16 written), "
              f"one thread")
    if args.runs <= 0:
        return
    work = args.workdir
    shutil.rmtree(work, ignore_errors=True)
    src, bf16, out = work / "fp8", work / "bf16", work / "out"
    build(src, args.size_gib)
    merge = [sys.executable, "-m", "ckpttool", "merge", "--force", "-q", "--max-shard-size", "1000GB",
             "--workers", str(args.workers)]
    subprocess.run([*merge, str(src), str(bf16), "--dtype", "bfloat16"], check=True, capture_output=True)
    commands = {
        "plain fp8": [*merge, str(src), str(out)],
        "dequantize": [*merge, str(src), str(out), "--dtype", "bfloat16"],
        "plain bf16": [*merge, str(bf16), str(out)],
        "quantize": [*merge, str(bf16), str(out), "--quantize", "fp8"],
    }
    t, m, cpu = interleaved(commands, args.runs, out, (src, bf16))
    baselines = {name: measure([*cmd, "--dry-run"])[1] for name, cmd in commands.items()}
    size = {name: sum(f.stat().st_size for f in (src if "fp8" in name or name == "dequantize" else bf16).iterdir())
            for name in commands}
    print(f"fp8 input {size['plain fp8'] / 2**30:.2f} GiB, bf16 input {size['plain bf16'] / 2**30:.2f} GiB; "
          f"{args.workers} workers; {args.runs} runs, medians")
    for name in commands:
        print(f"  {name:10s} {t[name]:7.2f} s  CPU {cpu[name]:6.2f} s  peak RSS {m[name] / 2**20:6.0f} MiB "
              f"({(m[name] - baselines[name]) / 2**20:5.0f} MiB above --dry-run)")
    print(f"  dequantize / plain fp8 = {t['dequantize'] / t['plain fp8']:.2f} (CPU {cpu['dequantize'] / cpu['plain fp8']:.2f}); "
          f"dequantize / plain bf16 = {t['dequantize'] / t['plain bf16']:.2f} (CPU {cpu['dequantize'] / cpu['plain bf16']:.2f})")
    print(f"  quantize / plain bf16 = {t['quantize'] / t['plain bf16']:.2f}; quantize / plain fp8 = "
          f"{t['quantize'] / t['plain fp8']:.2f}")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
