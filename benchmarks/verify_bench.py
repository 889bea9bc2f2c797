#!/usr/bin/env python
"""Peak memory of ``ckpttool verify`` against model size: streamed (the default) and loaded whole.

Each model is a Llama-shaped float32 checkpoint of random weights (hidden 1024, intermediate 4096, vocab 32000,
so embedding and head are 125 MiB each), saved in 100 MB safetensors files with an index, as ``save_pretrained``
writes it. Each measurement runs in a fresh process and reads its own ``/proc/self/status``: ``VmHWM`` (peak
resident memory) after importing torch, transformers and ckpttool.verify, and after ``verify(path, tokens=16)``.

Usage:
    python benchmarks/verify_bench.py --layers 4 16 40 --dir /tmp/verify-bench
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import re, sys, json
def status():
    text = open("/proc/self/status").read()
    return {k: int(re.search(k + r":\s+(\d+)", text).group(1)) // 1024 for k in ("VmHWM", "VmPeak")}
import torch, transformers
from ckpttool.commands.verify import verify
base = status()
result = verify(sys.argv[1], tokens=16, stream=sys.argv[2] == "stream")
assert result.ok, result.problems
print(json.dumps({"base": base, "after": status()}))
"""


def build(path: Path, layers: int) -> int:
    """A Llama-shaped float32 model of random weights in 100 MB files; returns its size in bytes."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_hidden_layers=layers,
                         num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=128,
                         tie_word_embeddings=False, architectures=["LlamaForCausalLM"], dtype="float32")
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in AutoModelForCausalLM.from_config(config).state_dict().items()}
    path.mkdir(parents=True, exist_ok=True)
    config.to_json_file(path / "config.json")
    g = torch.Generator().manual_seed(0)
    files: list[dict[str, torch.Tensor]] = [{}]
    weight_map, total, current = {}, 0, 0
    for name, shape in shapes.items():
        tensor = torch.ones(shape) if name.endswith("norm.weight") else 0.02 * torch.randn(shape, generator=g)
        size = tensor.numel() * 4
        if current and current + size > 100_000_000:
            files.append({})
            current = 0
        files[-1][name] = tensor
        current += size
        total += size
    for i, tensors in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, path / name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, name))
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                    "weight_map": weight_map}))
    return total


def measure(path: Path, mode: str) -> dict[str, dict[str, int]]:
    out = subprocess.run([sys.executable, "-c", CHILD, str(path), mode], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 40])
    parser.add_argument("--dir", type=Path, default=Path("/tmp/verify-bench"))
    args = parser.parse_args()
    print("| model | size | imports (peak RSS) | verify, streamed | above imports | verify, whole | above imports |")
    print("|---|---|---|---|---|---|---|")
    for layers in args.layers:
        path = args.dir / f"llama-{layers}"
        size = build(path, layers)
        stream, whole = measure(path, "stream"), measure(path, "whole")
        base = stream["base"]["VmHWM"]
        print(f"| {layers} layers | {size / 2**20:.0f} MiB | {base} MiB | {stream['after']['VmHWM']} MiB | "
              f"{stream['after']['VmHWM'] - base} MiB | {whole['after']['VmHWM']} MiB | "
              f"{whole['after']['VmHWM'] - whole['base']['VmHWM']} MiB |", flush=True)


if __name__ == "__main__":
    main()
