#!/usr/bin/env python
"""True-scale plans without true-scale disks: DeepSeek-V3-671B's FP8 release as sparse files.

The files hold DeepSeek-V3's real tensors, shapes and ``config.json`` (hidden 7168, 61 layers: 3 dense, then 256
routed experts + 1 shared; MLA with q_lora 1536 and kv_lora 512; vocab 129280; the MTP layer 61; every linear
weight FP8 e4m3 with a float32 ``weight_scale_inv`` per 128 x 128 block), in 163 ``model-*-of-00163.safetensors``
files and ``model.safetensors.index.json``. Each file is a real safetensors header followed by a hole of the size
its data would take (``os.truncate``), but for the block scales: ``audit --no-data`` reads them (they are
metadata of the FP8 weights: NaN, zero or negative scales lose their blocks), so they hold a valid value, 1/4096
of the FP8 bytes. About 690 GB apparent then takes a few MB of headers and ~170 MB of scales on disk; the weights
are never read by the commands timed here. The names come from
``many_tensors_bench.release`` (the same checkpoint at tiny dims), so the two benchmarks describe one layout.

Each command runs in a fresh process (``many_tensors_bench.timed``: wall, CPU, peak RSS) twice: the first with an
empty description cache (``CKPTTOOL_CACHE``, as on a user's first run), the second with the cache it left:

- ``merge --dry-run --json``: plan and coverage proof; prints the predicted peak of the real merge (FP8 kept);
- ``merge --dry-run --json --dtype bfloat16``: the same, dequantized while merging (the predicted peak then counts
  the dequantization's buffers);
- ``audit --no-data --json``: the header and metadata checks;
- ``split --to megatron --dry-run --json --dtype bfloat16`` at ``--tp 8 --pp 16 --ep 64 --pp-first 4 --pp-last 1``
  (61 layers = 4 + 14 x 4 + 1; the FP8 weights dequantized while splitting; whatever it answers, refusal included).

Everything is written under ``--workdir`` (default ``/tmp/ckpttool-truescale``); the script refuses a workdir that
holds anything but its own earlier output.

    python benchmarks/truescale.py [--workdir /tmp/ckpttool-truescale] [--keep] [--layers 61] [--bf16] [--only split]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from many_tensors_bench import release, timed  # noqa: E402  (the shared naming; this folder is no package)

#: DeepSeek-V3's config.json as released (``auto_map`` and its remote code left out: transformers has the class)
CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1, "first_k_dense_replace": 3,
    "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02, "intermediate_size": 18432,
    "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1,
    "q_lora_rank": 1536, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}
FILES = 163
#: the file this script leaves in its workdir, so that it never deletes a folder it did not make
MARKER = ".ckpttool-truescale"
ITEMSIZE = {"F8_E4M3": 1, "BF16": 2, "F32": 4}
#: every block scale: 2**-10 as float32 (a scale of a trained model's order; any positive finite value is valid)
SCALE = struct.pack("<f", 2.0**-10)


def config(layers: int = 61, dense: int = 3, bf16: bool = False) -> dict:
    """DeepSeek-V3's config with ``layers`` decoder layers of which the first ``dense`` are dense (a cut-down
    variant keeps every dim of the real one; its MTP layer then sits at index ``layers``); ``bf16``: without its
    ``quantization_config`` (the release dequantized, as ``merge --dtype bfloat16`` writes it: 1.3 TB apparent)."""
    found = {**CONFIG, "num_hidden_layers": layers, "first_k_dense_replace": dense}
    if bf16:
        del found["quantization_config"]
    return found


def _order(name: str) -> tuple:
    """Release order: the embedding, then layer by layer (numerically), then the rest (norm, head)."""
    match = re.match(r"model\.layers\.(\d+)\.", name)
    if match:
        return (1, int(match[1]), name)
    return (0 if "embed_tokens" in name else 2, 0, name)


def generate(root: Path, cfg: dict, files: int = FILES) -> dict:
    """Write the sparse release of ``cfg`` into ``root`` (a new directory): ``files`` safetensors files cut at
    equal shares of the bytes, each a real header and a hole for its data, the index and ``config.json``.
    Returns ``{"tensors", "files", "apparent_bytes", "disk_bytes"}``."""
    tensors = release(cfg)
    names = sorted(tensors, key=_order)
    sizes = {}
    for name in names:
        dtype, shape = tensors[name]
        n = ITEMSIZE[dtype]
        for d in shape:
            n *= d
        sizes[name] = n
    total = sum(sizes.values())
    parts: list[list[str]] = [[] for _ in range(files)]
    position = 0
    for name in names:  # a tensor goes to the file its first byte falls in, as the release cuts them by size
        parts[min(files - 1, position * files // total)].append(name)
        position += sizes[name]
    root.mkdir(parents=True)
    (root / "config.json").write_text(json.dumps(cfg, indent=2))
    weight_map = {}
    for i, part in enumerate(parts):
        file = f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        # the scales first, side by side: they take their own bytes on disk, not a 4 KiB page each between holes
        part.sort(key=lambda n: not n.endswith("weight_scale_inv"))
        for name in part:
            dtype, shape = tensors[name]
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + sizes[name]]}
            offset += sizes[name]
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned, as safetensors writes it
        path = root / file
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            for name in part:  # the scales hold values (an audit reads them even with --no-data); the rest: holes
                if name.endswith("weight_scale_inv"):
                    f.seek(8 + len(raw) + header[name]["data_offsets"][0])
                    f.write(SCALE * (sizes[name] // 4))
        os.truncate(path, 8 + len(raw) + offset)  # the data up to the file's end: a hole
        weight_map.update(dict.fromkeys(part, file))
    (root / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    paths = list(root.iterdir())
    return {"tensors": len(names), "files": files, "apparent_bytes": sum(p.stat().st_size for p in paths),
            "disk_bytes": sum(p.stat().st_blocks * 512 for p in paths)}


def claim_workdir(workdir: Path) -> Path:
    """``workdir`` resolved, made if absent; refused (SystemExit) if it holds anything but this script's output."""
    workdir = workdir.resolve()
    if workdir == Path(workdir.anchor) or workdir == Path.home().resolve():
        raise SystemExit(f"refusing --workdir {workdir}: give a folder of its own (default /tmp/ckpttool-truescale)")
    if workdir.exists() and any(workdir.iterdir()) and not (workdir / MARKER).exists():
        raise SystemExit(f"refusing --workdir {workdir}: it is not empty and holds no {MARKER} (not made here)")
    workdir.mkdir(parents=True, exist_ok=True)
    (workdir / MARKER).write_text("made by benchmarks/truescale.py; everything here may be deleted by it\n")
    return workdir


def inside_workdir(path: Path, workdir: Path) -> Path:
    """``path``, checked to lie inside ``workdir`` (every path this script writes or deletes goes through this)."""
    if not path.resolve().is_relative_to(workdir):
        raise SystemExit(f"refusing to write {path}: outside --workdir {workdir}")
    return path


def peaks(doc: object) -> dict[str, int]:
    """Every ``*peak*`` number in a command's JSON document, by its key path."""
    found: dict[str, int] = {}

    def walk(node: object, at: str) -> None:
        if isinstance(node, dict):
            for key, value in node.items():
                path = f"{at}.{key}" if at else str(key)
                if "peak" in str(key) and isinstance(value, int | float) and not isinstance(value, bool):
                    found[path] = int(value)
                walk(value, path)

    walk(doc, "")
    return found


def measure(name: str, argv: list[str], workdir: Path) -> dict:
    """Run ``argv`` once in a fresh process, its stdout and stderr kept in ``workdir``; timings, exit, peaks."""
    out, err = inside_workdir(workdir / f"{name}.out", workdir), inside_workdir(workdir / f"{name}.err", workdir)
    result = timed(["sh", "-c", 'o=$0 e=$1; shift; exec "$@" >"$o" 2>"$e"', str(out), str(err), *argv])
    try:
        result["peaks"] = peaks(json.loads(out.read_text()))
    except ValueError:
        result["peaks"] = {}
    lines = (err.read_text().strip() or out.read_text().strip()).splitlines()
    result["message"] = lines[-1][:300] if result["rc"] and lines else ""
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/ckpttool-truescale"))
    parser.add_argument("--layers", type=int, default=61, help="decoder layers (61: DeepSeek-V3 as released)")
    parser.add_argument("--files", type=int, default=FILES)
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--pp", type=int, default=16)
    parser.add_argument("--ep", type=int, default=64)
    parser.add_argument("--pp-first", type=int, default=4, help="layers of the first stage (61 = 4 + 14 x 4 + 1)")
    parser.add_argument("--pp-last", type=int, default=1, help="layers of the last stage")
    parser.add_argument("--only", choices=("merge", "audit", "split"), help="time only the commands of this name")
    parser.add_argument("--keep", action="store_true", help="reuse the release in --workdir if it is there")
    parser.add_argument("--bf16", action="store_true", help="the release dequantized to BF16 (what split takes)")
    args = parser.parse_args()
    workdir = claim_workdir(args.workdir)
    src, cache = inside_workdir(workdir / "src", workdir), inside_workdir(workdir / "cache", workdir)
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)  # as many_tensors_bench: modules from their bytecode
    # the generator describes the config too: in a cache of its own, so that the timed first runs find none
    os.environ["CKPTTOOL_CACHE"] = str(inside_workdir(workdir / "generator-cache", workdir))
    if not (args.keep and (src / "model.safetensors.index.json").exists()):
        shutil.rmtree(src, ignore_errors=True)
        start = time.perf_counter()
        made = generate(src, config(args.layers, bf16=args.bf16), args.files)
        print(f"built in {time.perf_counter() - start:.1f} s: {made['tensors']} tensors in {made['files']} files, "
              f"{made['apparent_bytes'] / 1e9:.1f} GB apparent, {made['disk_bytes'] / 1e6:.1f} MB on disk")
    tool = [sys.executable, "-m", "ckpttool"]
    cmds = {
        "merge --dry-run": [*tool, "merge", str(src), "--dry-run", "--json"],
        "merge --dry-run --dtype bf16": [*tool, "merge", str(src), "--dry-run", "--json", "--dtype", "bfloat16"],
        "audit --no-data": [*tool, "audit", str(src), "--no-data", "--json"],
        "split --dry-run": [*tool, "split", str(src), "--to", "megatron", "--tp", str(args.tp), "--pp",
                            str(args.pp), "--ep", str(args.ep), "--pp-first", str(args.pp_first), "--pp-last",
                            str(args.pp_last), "--dtype", "bfloat16", "--dry-run", "--json"],
    }
    cmds = {name: argv for name, argv in cmds.items() if args.only is None or name.split()[0] == args.only}
    print(f"{os.cpu_count()} CPUs; load {os.getloadavg()[0]:.1f}; split at TP{args.tp} x PP{args.pp} x EP{args.ep}"
          f" (pp_first {args.pp_first}, pp_last {args.pp_last})")
    os.environ["CKPTTOOL_CACHE"] = str(cache)
    for name, argv in cmds.items():
        shutil.rmtree(cache, ignore_errors=True)  # each command's first run finds no description cached
        for run in ("first", "second"):
            r = measure(f"{'-'.join(name.split()[::2])}-{run}", argv, workdir)
            peak = ", ".join(f"{k} {v / 2**30:.2f} GiB" for k, v in r["peaks"].items()) or "no predicted peak"
            print(f"{name:28} {run:6} {r['wall']:6.2f} s  cpu {r['cpu']:6.2f} s  peak RSS {r['rss'] / 2**20:7.1f} MiB"
                  f"  exit {r['rc']}  {peak}")
            if r["message"]:
                print(f"{'':36}{r['message']}")


if __name__ == "__main__":
    main()
