"""The Megatron-Core ``torch_dist`` files around the DCP ones: ``common.pt``, ``metadata.json`` and the tracker.

An iteration directory ``iter_0000000/`` holds the DCP files (:mod:`.dcp`) and what megatron-core's
``dist_checkpointing.load`` and Megatron-LM's ``load_checkpoint`` read besides: ``metadata.json`` (which backends
wrote it), ``common.pt`` (``torch.save`` of the non-sharded state: the training ``args`` as an
``argparse.Namespace`` of plain values, ``checkpoint_version`` 3.0, ``iteration``); one level up,
``latest_checkpointed_iteration.txt`` names the iteration. Nothing is pickled but plain containers and the
Namespace, which megatron-core lists among its safe globals for ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Mapping
from pathlib import Path

from ckpttool.errors import OutputError
from ckpttool.writers.trust import create_file

TRACKER = "latest_checkpointed_iteration.txt"
COMMON = "common.pt"
METADATA_JSON = "metadata.json"
#: what megatron-core 0.16 writes in ``metadata.json`` for ``torch_dist``
BACKENDS = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
            "common_backend_version": 1}


def iteration_name(iteration: int) -> str:
    """Megatron-LM's name for the directory of ``iteration``."""
    return f"iter_{iteration:07d}"


def write_common(directory: Path, args: Mapping[str, object], iteration: int) -> None:
    """``common.pt`` and ``metadata.json`` in the iteration ``directory``.

    Raises:
        OutputError: a file cannot be written; nothing is published.
    """
    import torch

    state = {"args": argparse.Namespace(**args), "checkpoint_version": 3.0, "iteration": iteration}
    try:
        with os.fdopen(create_file(directory / COMMON), "wb") as f:
            torch.save(state, f)
        with os.fdopen(create_file(directory / METADATA_JSON), "w") as f:
            f.write(json.dumps(BACKENDS))
    except OSError as e:
        raise OutputError(f"'{COMMON}': cannot write: {e.strerror or e}; nothing was published") from None


def write_tracker(root: Path, iteration: int) -> None:
    """``latest_checkpointed_iteration.txt`` naming ``iteration`` (Megatron-LM writes the bare number)."""
    try:
        with os.fdopen(create_file(root / TRACKER), "w") as f:
            f.write(str(iteration))
    except OSError as e:
        raise OutputError(f"'{TRACKER}': cannot write: {e.strerror or e}; nothing was published") from None
