#!/usr/bin/env python
"""The MXFP4 encoder's speed (``ckpttool.quant.encode.mxfp4_encode``) and the memory a worker thread takes for it.

Encodes one gpt-oss expert as ``merge --quantize mxfp4`` does, on one thread, its buffers reused from run to run
as the executor's thread reuses them: gpt-oss-20b/120b's ``gate_up_proj[e]`` (transformers' ``[in, out]`` =
``[2880, 5760]``, bfloat16) and ``down_proj[e]`` (``[2880, 2880]``), random normal values. For each: CPU seconds
(median of ``--runs``; the figure to compare on a shared machine), values per second, and the bytes of the scratch
buffers the encoder took, per value, beside what ``--dry-run`` predicts per worker thread for a chunk of it (the
codec's ``scratch_bytes``: the same named buffers and torch's temporaries; ``ckpttool.execute.buffers`` sums them). ``--stages`` adds where the time goes (each pass
of the encoder timed alone on the same buffers).

    python benchmarks/mxfp4_bench.py --runs 5
    python benchmarks/mxfp4_bench.py --runs 3 --stages --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from ckpttool.quant.encode import E2M1_MAX, MXFP4_BLOCKS, e2m1_codes, encoder, mxfp4_encode, transposed_copy
from ckpttool.quant.formats import MXFP4_GROUP, MXFP4_GROUP_BYTES

#: gpt-oss-20b and -120b share the expert shapes: hidden 2880, intermediate 2880 (gate and up: 5760 columns)
SHAPES = {"gate_up_proj[e]": (1, 2880, 5760), "down_proj[e]": (1, 2880, 2880)}


class Buffers:
    """A thread's scratch buffers by name, grown when asked for more (the executor's ``Reader.scratch``)."""

    def __init__(self) -> None:
        self.held: dict[str, torch.Tensor] = {}

    def __call__(self, name: str, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        kind = {"F32": torch.float32, "BF16": torch.bfloat16, "I32": torch.int32, "U8": torch.uint8}[dtype]
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=kind).element_size()
        held = self.held.get(name)
        if held is None or held.numel() < nbytes:
            held = self.held[name] = torch.empty(nbytes, dtype=torch.uint8)
        return held[:nbytes].view(kind).view(shape)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() for t in self.held.values())


def cpu_seconds(call, runs: int) -> float:
    times = []
    for _ in range(runs):
        start = time.process_time()
        call()
        times.append(time.process_time() - start)
    return statistics.median(times)


def stages(stored: torch.Tensor, scratch: Buffers, runs: int) -> dict[str, float]:
    """Each pass of :func:`mxfp4_encode`, timed alone (CPU seconds, median)."""
    experts, cols, rows = stored.shape
    shape = (experts, rows, cols // MXFP4_GROUP, MXFP4_GROUP)
    work = scratch("work", shape, "F32")
    size = scratch("abs", shape, "F32")
    amax = scratch("amax", shape[:3], "F32")
    found = {"transpose bf16 -> f32": cpu_seconds(lambda: transposed_copy(work.view(experts, rows, cols), stored), runs)}
    found["(whole view, one copy_)"] = cpu_seconds(lambda: work.view(experts, rows, cols).copy_(stored.transpose(1, 2)),
                                                   runs)
    found["abs + amax"] = cpu_seconds(lambda: torch.amax(torch.abs(work, out=size), dim=-1, out=amax), runs)
    bits = amax.div_(E2M1_MAX).view(torch.int32).add_(0x007FFFFF).bitwise_and_(0x7F800000)
    scale = bits.view(torch.float32)
    inverse = torch.where(scale == 0, 0.0, torch.reciprocal(scale))
    found["q = w / scale"] = cpu_seconds(lambda: torch.mul(work, inverse.unsqueeze(-1), out=size), runs)
    found["E2M1 codes"] = cpu_seconds(lambda: e2m1_codes(size, scratch), runs)
    codes = e2m1_codes(size, scratch)
    pairs = codes.view(experts, rows, cols // MXFP4_GROUP, MXFP4_GROUP_BYTES, 2)
    found["pack nibbles"] = cpu_seconds(lambda: pairs[..., 0].bitwise_or(pairs[..., 1].bitwise_left_shift(4)), runs)
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--stages", action="store_true", help="time each pass of the encoder too")
    parser.add_argument("--json", action="store_true", help="one JSON document")
    args = parser.parse_args()
    torch.set_num_threads(1)  # one executor worker thread
    generator = torch.Generator().manual_seed(0)
    results = {}
    for name, shape in SHAPES.items():
        stored = torch.randn(shape, generator=generator).to(torch.bfloat16)
        experts, cols, rows = shape
        blocks = torch.empty((experts, rows, cols // MXFP4_GROUP, MXFP4_GROUP_BYTES), dtype=torch.uint8)
        scales = torch.empty((experts, rows, cols // MXFP4_GROUP), dtype=torch.uint8)
        scratch = Buffers()
        mxfp4_encode(stored, blocks, scales, scratch)  # buffers sized once, as a thread's are
        seconds = cpu_seconds(lambda: mxfp4_encode(stored, blocks, scales, scratch), args.runs)
        values = stored.numel()
        results[name] = {
            "shape": list(shape), "cpu_s": round(seconds, 4), "mvalues_per_s": round(values / seconds / 1e6, 1),
            "scratch_bytes": scratch.nbytes, "scratch_bytes_per_value": round(scratch.nbytes / values, 2),
            # what the executor (and --dry-run's peak) counts for a chunk of this expert, temporaries included
            "predicted_bytes_per_value": round(sum(encoder(MXFP4_BLOCKS, ()).scratch_bytes(shape, None, "U8").values())
                                               / values, 2),
            **({"stages_cpu_s": {k: round(v, 4) for k, v in stages(stored, scratch, args.runs).items()}}
               if args.stages else {}),
        }
    if args.json:
        print(json.dumps({"threads": 1, "runs": args.runs, "results": results}, indent=2))
        return
    for name, r in results.items():
        print(f"{name} {r['shape']}: {r['cpu_s']:.3f} CPU s, {r['mvalues_per_s']} M values/s, scratch "
              f"{r['scratch_bytes'] / 2**20:.1f} MiB ({r['scratch_bytes_per_value']} B/value named; "
              f"{r['predicted_bytes_per_value']} B/value predicted per worker with torch's temporaries)")
        for stage, s in r.get("stages_cpu_s", {}).items():
            print(f"  {stage:24s} {s:.3f} s")


if __name__ == "__main__":
    main()
