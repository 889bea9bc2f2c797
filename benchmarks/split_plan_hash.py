#!/usr/bin/env python
"""The plan of a ``split --dry-run`` as two hashes, to prove a speed-up changed nothing, and its CPU time.

- ``plan``: every rank file's name and rank; every item's fqn, global shape, box, target (every copy: piece,
  boxes; dtype, sources, dequantization, scale, transform), archive (dtype, shape, serial), offset in its file,
  archive length and data offset, and (``--bytes``) the archive's head and tail bytes; every object item's fqn,
  offset and bytes; every tensor's sharding;
- ``json``: the document ``split --dry-run --json`` prints (:meth:`SplitResult.to_json`), keys sorted.

Run it on the tree before a change and after: the two lines must be equal.

    python benchmarks/split_plan_hash.py SRC --to megatron --tp 2 --pp 1 --ep 8 [--pp-first 4 --pp-last 1] [--bytes]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import resource
import time


def plan_hash(result, with_bytes: bool = False) -> str:
    """One SHA-256 over everything the split would write, in file order (see the module's docstring)."""
    digest = hashlib.sha256()
    for f in result.files:
        digest.update(repr((f.name, f.rank)).encode())
        for item in f.items:
            archive = item.archive
            digest.update(repr((item.fqn, item.global_shape, item.box, item.target, archive.dtype, archive.shape,
                                archive.serial, item.offset, archive.length, archive.data_offset)).encode())
            if with_bytes:
                digest.update(archive.head())
                digest.update(archive.tail(0))
        for obj in f.objects:
            digest.update(repr((obj.fqn, obj.offset)).encode())
            digest.update(obj.data)
    for sharding in result.tensors:
        digest.update(repr(sharding).encode())
    return digest.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("src")
    parser.add_argument("--to", default="megatron")
    for option in ("tp", "pp", "ep", "fsdp", "vpp"):
        parser.add_argument(f"--{option}", type=int, default=1)
    parser.add_argument("--pp-first", type=int, default=0)
    parser.add_argument("--pp-last", type=int, default=0)
    parser.add_argument("--dtype", default=None)
    parser.add_argument("--bytes", action="store_true", help="hash every archive's head and tail bytes too")
    args = parser.parse_args()

    import ckpttool

    start = time.process_time()
    result = ckpttool.split(args.src, None, to=args.to, tp=args.tp, pp=args.pp, ep=args.ep, fsdp=args.fsdp,
                            vpp=args.vpp, pp_first=args.pp_first, pp_last=args.pp_last, dtype=args.dtype,
                            dry_run=True)
    planned = time.process_time() - start
    start = time.process_time()
    document = json.dumps(result.to_json(), sort_keys=True)
    as_json = time.process_time() - start
    items = sum(len(f.items) for f in result.files)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024
    print(f"items {items}  split {planned:.2f} s CPU  to_json {as_json:.2f} s CPU  peak RSS {peak} MiB")
    print(f"plan {plan_hash(result, args.bytes)}")
    print(f"json {hashlib.sha256(document.encode()).hexdigest()}")


if __name__ == "__main__":
    main()
