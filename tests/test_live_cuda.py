"""Live gather on GPUs: the NCCL gather, the pinned host arena and the side-stream copy, in real torchrun jobs.

- With 2 or more GPUs: one process per GPU (``torchrun --nproc_per_node <GPUs>``, NCCL) shards the fixtures'
  Llama reference model with FSDP2, DTensor TP (and a 2-D mesh where the GPUs allow one) and calls
  ``ckpttool.live.save_hf``. Each output must equal, bit for bit, torch's own full state dict of the same
  model and the reference weights.
- With 1 GPU (NCCL cannot run several processes on one GPU): a one-rank NCCL group on the GPU; its output is
  compared with the same job on the CPU with 2 gloo ranks, and both with the full state dict.

Skipped without a GPU. ``tests/live_cuda_worker.py`` is the rank.

    .venv/bin/python -m pytest tests/test_live_cuda.py -v
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import fixture_dir, load_output
from safetensors.torch import load_file

GPUS = torch.cuda.device_count()
pytestmark = pytest.mark.skipif(
    GPUS == 0, reason="needs a CUDA GPU: torch.cuda.device_count() is 0 (the NCCL live gather cannot run on CPU)")

WORKER = Path(__file__).resolve().parent / "live_cuda_worker.py"
LLAMA = fixture_dir("llama_fsdp2_dcp") / "reference"
SCENARIOS = ("fsdp2", "tp") + (("mesh2d",) if GPUS >= 4 and GPUS % 2 == 0 else ())


def torchrun(nproc: int, backend: str, out: Path, *scenarios: str, timeout: float = 600) -> str:
    """One torchrun job of ``nproc`` ranks; its output (it must succeed)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if backend == "gloo":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the CPU job must not touch the GPU
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", str(WORKER),
           "--backend", backend, "--out", str(out), *scenarios]
    done = subprocess.run(cmd, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                          timeout=timeout)
    assert done.returncode == 0, done.stdout
    for name in scenarios:
        assert f"DONE {name}" in done.stdout, done.stdout
    return done.stdout


def assert_is_full_state_dict(directory: Path, full: Path) -> None:
    """Bit for bit torch's full state dict of the model, and the reference weights it was loaded from."""
    got, want, reference = load_output(directory), load_file(full), load_output(LLAMA)
    assert sorted(got) == sorted(want) == sorted(reference)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
        assert torch.equal(got[name], reference[name]), name


def digests(directory: Path) -> dict[str, str]:
    """The weights files and the index."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.name.startswith("model")}


def assert_gathered_on_gpu(output: str) -> None:
    """The rank's gather ran on CUDA tensors (NCCL path) and copied them through pinned host arenas."""
    assert "BACKEND nccl" in output, output
    assert "DATA DEVICE cuda" in output and "DATA DEVICE cpu" not in output, output
    pinned = [int(line.split()[-1]) for line in output.splitlines() if line.startswith("PINNED ARENAS")]
    assert pinned and pinned[-1] > 0, output


@pytest.fixture(scope="module")
def on_cpu(tmp_path_factory):
    """The same job on the CPU: 2 gloo ranks."""
    out = tmp_path_factory.mktemp("live_cpu")
    output = torchrun(2, "gloo", out, "fsdp2", "tp")
    assert "BACKEND gloo" in output and "DATA DEVICE cpu" in output
    return out


@pytest.mark.skipif(0 < GPUS < 2, reason=f"needs at least 2 CUDA GPUs for one NCCL rank per GPU (found {GPUS})")
def test_one_process_per_gpu_equals_the_full_state_dict(tmp_path, on_cpu):
    output = torchrun(GPUS, "nccl", tmp_path, *SCENARIOS)
    assert f"WORLD {GPUS}" in output
    assert_gathered_on_gpu(output)
    for name in SCENARIOS:
        assert_is_full_state_dict(tmp_path / name, tmp_path / f"{name}.full.safetensors")
    for name in ("fsdp2", "tp"):
        assert digests(tmp_path / name) == digests(on_cpu / name), name


@pytest.mark.skipif(GPUS > 1, reason=f"the one-GPU variant; {GPUS} GPUs run one process per GPU instead")
def test_one_gpu_nccl_rank_equals_two_cpu_gloo_ranks(tmp_path, on_cpu):
    output = torchrun(1, "nccl", tmp_path, "fsdp2", "tp")
    assert "WORLD 1" in output
    assert_gathered_on_gpu(output)
    for name in ("fsdp2", "tp"):
        assert_is_full_state_dict(tmp_path / name, tmp_path / f"{name}.full.safetensors")
        assert_is_full_state_dict(on_cpu / name, on_cpu / f"{name}.full.safetensors")
        assert digests(tmp_path / name) == digests(on_cpu / name), name
