"""``python -m ckpttool`` for ``tests/test_multinode.py``, with one fault: the process whose ``RANK`` is
``CKPTTOOL_TEST_DIE_RANK`` kills itself (SIGKILL, like a node powered off) when it starts writing its share
of the output files (merge or split). Run by torchrun (not a test module itself)."""

from __future__ import annotations

import os
import signal

import ckpttool.commands.merge as merge
import ckpttool.writers.dcp as dcp

if os.environ.get("RANK") == os.environ.get("CKPTTOOL_TEST_DIE_RANK"):
    def _die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    merge.write_weights = _die  # the merge's share of the output files
    dcp.write_files = _die  # the split's

from ckpttool.cli import main  # noqa: E402 - after the fault is in place

main()
