"""True-scale dry runs of the sidecar reader (benchmarks/truescale_readers.py): DeepSeek-V3's BF16 model cut to two
layers, every dim real, as 8 sparse rank files (real headers, holes for the data) with their sidecars, each 2-D
tensor cut in two along dim 0. ``merge --dry-run`` covers every tensor exactly once and predicts a peak
independent of the tensors' size; ``audit --no-data`` passes. Timing is the benchmark's business, not this file's.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from ckpttool.execute.buffers import OVERHEAD_BYTES
from ckpttool.execute.executor import CHUNK_BYTES

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _bench():
    sys.path.insert(0, str(BENCHMARKS))  # truescale_readers imports its siblings (this folder is no package)
    spec = importlib.util.spec_from_file_location("truescale_readers_bench", BENCHMARKS / "truescale_readers.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    """(the sidecar checkpoint's folder, its tensors: name -> (dtype, shape), what the generator reported)."""
    bench = _bench()
    root = tmp_path_factory.mktemp("truescale-readers") / "sidecar"
    cfg = bench.config(layers=2, dense=1, bf16=True)
    made = bench.generate_sidecar(root, cfg)
    return root, bench.release(cfg), made


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in root.iterdir()}


def test_the_sidecar_checkpoint_is_true_shape_sparse_and_sharded(sidecar):
    root, tensors, made = sidecar
    assert tensors["model.embed_tokens.weight"] == ("BF16", (129280, 7168))
    assert made["files"] == 8 and len(list(root.glob("*.ckpttool.json"))) == 8
    assert made["tensors"] < made["pieces"] < 2 * made["tensors"]  # the 2-D tensors in two pieces, the rest whole
    assert made["apparent_bytes"] > 30e9
    assert made["disk_bytes"] < 32 * 2**20


def test_merge_dry_run_covers_every_tensor_once_in_bounded_memory(sidecar, cli):
    root, tensors, _ = sidecar
    before = _snapshot(root)
    result = cli("merge", root, "--dry-run", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["status"] == "ok" and doc["dry_run"] and doc["output"] is None
    assert doc["coverage"] == "every target tensor is covered exactly once"
    names = [t["name"] for t in doc["targets"]]
    assert len(names) == len(set(names)) and set(names) == set(tensors)
    assert doc["largest_tensor_bytes"] == 129280 * 7168 * 2
    # streamed in CHUNK_BYTES chunks (a read and an output buffer per worker, bounded by 6 as in test_truescale)
    bound = doc["workers"] * 6 * CHUNK_BYTES + OVERHEAD_BYTES
    assert 0 < doc["predicted_peak_bytes"] <= bound < 2 * 2**30
    assert _snapshot(root) == before


def test_audit_no_data_passes(sidecar, cli):
    root, tensors, _ = sidecar
    before = _snapshot(root)
    result = cli("audit", root, "--no-data", "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    summary = doc["summary"]
    assert summary["verdict"] == "pass" and summary["errors"] == 0 and not summary["data_checked"], doc["findings"]
    assert summary["tensors"] == len(tensors)
    assert _snapshot(root) == before
