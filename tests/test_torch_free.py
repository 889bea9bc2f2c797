"""Header-only commands need no torch: ``merge --dry-run`` and ``audit --no-data`` of an HF directory or of a
sidecar checkpoint plan from headers and JSON, so they run without importing torch (a second or more of
start-up), nor transformers once the architecture's description is cached.

Each command runs in a fresh interpreter (torch, once imported, stays in ``sys.modules``); the first run of a
source warms the description cache (:mod:`ckpttool.model.architecture`), the second is the one checked.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ckpttool.fast.deferred import torch as deferred_torch
from ckpttool.io.sidecar import PieceSpec, save_shard
from conftest import fixture_dir

HEAVY = ("torch", "transformers")


def _run(argv: list[str], cache: Path) -> tuple[dict, list[str]]:
    """Run the command line in a fresh interpreter: its JSON document and the heavy packages it imported."""
    probe = (
        "import sys\nfrom ckpttool.cli import main\n"
        "try:\n    main(sys.argv[1:])\nexcept SystemExit as e:\n    code = e.code\n"
        f"print('\\nimported:', code, *(m for m in {HEAVY!r} if m in sys.modules))"
    )
    env = {**os.environ, "CKPTTOOL_CACHE": str(cache)}
    done = subprocess.run([sys.executable, "-c", probe, *argv], capture_output=True, text=True, env=env, check=True)
    document, _, last = done.stdout.rpartition("\nimported:")
    code, *imported = last.split()
    assert code == "0", done.stdout + done.stderr
    return json.loads(document), imported


def _sidecar_checkpoint(directory: Path) -> Path:
    """Two TP ranks of a column-split projection and a replicated norm, as ``save_shard`` writes them."""
    weight = torch.arange(48, dtype=torch.float32).reshape(4, 12)
    for rank in range(2):
        save_shard(
            {"proj.weight": weight[:, rank * 6:(rank + 1) * 6], "norm.weight": torch.ones(4)},
            {"proj.weight": PieceSpec.split((4, 12), dim=1, index=rank, count=2, tp_rank=rank),
             "norm.weight": PieceSpec.replicated((4,))},
            directory, rank=rank, world_size=2,
        )
    return directory


@pytest.mark.parametrize("command", [["merge", "--dry-run", "--json"], ["audit", "--no-data", "--json"]])
def test_an_hf_directory_is_planned_and_audited_without_torch(tmp_path, command):
    src = str(fixture_dir("quantized_qwen3_fp8") / "checkpoint")
    argv = [command[0], src, *command[1:]]
    _run(argv, tmp_path)  # warms the description cache (imports transformers, and torch with it)
    document, imported = _run(argv, tmp_path)
    assert imported == []
    assert document.get("tensors", document.get("summary", {}).get("tensors")) > 0


@pytest.mark.parametrize("command", [["merge", "--dry-run", "--json"], ["audit", "--no-data", "--json"]])
def test_a_sidecar_checkpoint_is_planned_and_audited_without_torch(tmp_path, command):
    src = str(_sidecar_checkpoint(tmp_path / "ckpt"))
    document, imported = _run([command[0], src, *command[1:]], tmp_path / "cache")
    assert imported == []
    assert document.get("format", document.get("summary", {}).get("format")) == "sidecar"


def test_the_deferred_torch_is_torch_once_read():
    assert deferred_torch.float8_e4m3fn is torch.float8_e4m3fn
    assert deferred_torch.zeros(2).dtype is torch.float32
