"""``python -m ckpttool`` for ``tests/test_multinode.py``, with one fault: the process whose ``RANK`` is
``CKPTTOOL_TEST_DIE_RANK`` kills itself (SIGKILL, like a node powered off) when it starts writing its share
of the output files. Run by torchrun (not a test module itself)."""

from __future__ import annotations

import os
import signal

import ckpttool.commands.merge as merge

if os.environ.get("RANK") == os.environ.get("CKPTTOOL_TEST_DIE_RANK"):
    def _die(*args, **kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    merge.write_weights = _die

from ckpttool.cli import main  # noqa: E402 - after the fault is in place

main()
