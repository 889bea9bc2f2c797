#!/usr/bin/env python
"""Split and merge of a model larger than the machine's memory, against ``cp`` of the same bytes.

Builds split_bench's synthetic Llama-shaped bf16 HuggingFace checkpoint at ``--size-gib`` (32 by default: larger
than this machine's 24 GiB of RAM, so no page cache can hold it), then runs, each once, in a fresh process, with
the page cache of its input dropped and every write synced:

1. ``cp -r`` of the HF checkpoint + ``sync`` (the copy is deleted after);
2. ``ckpttool split SRC DCP --to dcp --fsdp 4 --tp 2``; then the HF checkpoint is deleted;
3. ``cp -r`` of the DCP checkpoint + ``sync`` (deleted after);
4. ``ckpttool merge DCP BACK`` (audit on), then every tensor of BACK is hashed and compared with the hash of the
   same tensor in the original, taken before it was deleted.

At most two copies of the model exist at any moment, so the disk needs about twice ``--size-gib`` free (and 1 GiB); the
script checks that first and refuses otherwise. It writes only under ``--workdir`` (which must not exist) and
deletes it at the end. Peak RSS is ``ru_maxrss`` of each command as the only child of a probe; CPU is user + sys.

    python benchmarks/big_bench.py --size-gib 32 --workdir /tmp/ckpttool-big
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from merge_bench import drop_cache, measure  # noqa: E402
from split_bench import build  # noqa: E402


def tensor_hashes(folder: Path) -> dict[str, str]:
    """SHA-1 of every tensor's bytes in the safetensors files of ``folder``, read one tensor at a time."""
    import torch
    from safetensors import safe_open

    hashes = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            for name in handle.keys():
                tensor = handle.get_tensor(name)
                hashes[name] = hashlib.sha1(tensor.contiguous().view(torch.uint8).numpy()).hexdigest()
                del tensor
    return hashes


def run(label: str, cmd: list[str], inputs: list[Path], nbytes: int, rows: list[dict]) -> None:
    os.sync()
    drop_cache(*inputs)
    wall, peak, cpu = measure(cmd)
    rows.append({"step": label, "wall_s": round(wall, 2), "cpu_s": round(cpu, 2), "peak_rss_mib": round(peak / 2**20),
                 "gib_per_s": round(nbytes / 2**30 / wall, 3), "cpu_s_per_gib": round(cpu / (nbytes / 2**30), 3),
                 "load": round(os.getloadavg()[0], 1)})
    print(json.dumps(rows[-1]), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=32.0)
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    parser.add_argument("--mesh", default="--fsdp 4 --tp 2", help="split's mesh options")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-big"))
    args = parser.parse_args()
    work = args.workdir
    if work.exists():
        sys.exit(f"{work} exists: give a --workdir that does not (this script deletes it when done)")
    need = 2 * args.size_gib * 2**30 + 2**30
    free = shutil.disk_usage(work.parent).free
    if free < need:
        sys.exit(f"{work.parent} has {free / 2**30:.1f} GiB free; a {args.size_gib:g} GiB run needs {need / 2**30:.1f} GiB "
                 "(two copies of the model and 1 GiB to spare)")
    work.mkdir(parents=True)
    src, dcp, back, copy = work / "src", work / "dcp", work / "back", work / "copy"
    ckpttool = [sys.executable, "-m", "ckpttool"]
    rows: list[dict] = []
    try:
        start = time.perf_counter()
        nbytes = build(src, args.size_gib)
        print(f"built {nbytes / 2**30:.2f} GiB in {time.perf_counter() - start:.0f} s", flush=True)
        run("cp HF", ["sh", "-c", f"cp -r '{src}' '{copy}' && sync"], [src], nbytes, rows)
        shutil.rmtree(copy)
        run("split --to dcp", [*ckpttool, "split", str(src), str(dcp), "--to", "dcp", *args.mesh.split(), "-q",
                               "--workers", str(args.workers)], [src], nbytes, rows)
        os.sync()
        drop_cache(src)
        start = time.perf_counter()
        original = tensor_hashes(src)
        print(f"hashed the original in {time.perf_counter() - start:.0f} s", flush=True)
        shutil.rmtree(src)
        dcp_bytes = sum(f.stat().st_size for f in dcp.rglob("*") if f.is_file())
        run("cp DCP", ["sh", "-c", f"cp -r '{dcp}' '{copy}' && sync"], [dcp], dcp_bytes, rows)
        shutil.rmtree(copy)
        run("merge", [*ckpttool, "merge", str(dcp), str(back), "-q", "--max-shard-size", "5GB", "--workers",
                      str(args.workers)], [dcp], dcp_bytes, rows)
        merged = tensor_hashes(back)
        equal = merged == original
        print(f"merged tensors equal the original's: {equal} ({len(original)} tensors)", flush=True)
        by = {row["step"]: row for row in rows}
        print(f"split / cp HF = {by['split --to dcp']['wall_s'] / by['cp HF']['wall_s']:.2f}; "
              f"merge / cp DCP = {by['merge']['wall_s'] / by['cp DCP']['wall_s']:.2f}")
        if not equal:
            sys.exit("the merge of the split differs from the original")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
