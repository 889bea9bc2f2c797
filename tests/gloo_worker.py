"""What every test worker does to become one rank of a gloo job (not a test module).

A test starts ``python tests/X_worker.py --rank R --world W --port P --DIR PATH [scenario ...]`` once per rank;
:func:`join` parses that line and joins the process group, and :func:`run_scenarios` runs the named scenarios,
with a barrier after each, then leaves the group.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Mapping
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

Scenario = Callable[[Path, int], None]


def join(directory: str, timeout: float, scenarios: Mapping[str, Scenario] | None = None) -> argparse.Namespace:
    """Parse this rank's command line (``--DIRECTORY`` is its working directory; with ``scenarios``, their names
    follow) and join the gloo group on 127.0.0.1; one intra-op thread per rank."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument(f"--{directory}", dest="directory", type=Path, required=True)
    if scenarios is not None:
        parser.add_argument("scenarios", nargs="+", choices=sorted(scenarios))
    args = parser.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port), RANK=str(args.rank),
                      WORLD_SIZE=str(args.world), LOCAL_RANK=str(args.rank))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=args.rank, world_size=args.world, timeout=timedelta(seconds=timeout))
    return args


def run_scenarios(scenarios: Mapping[str, Scenario], directory: str, timeout: float, *, announce: bool = True,
                  tear_down: bool = True) -> None:
    """Join (:func:`join`), run each named scenario with a barrier after it (rank 0 prints ``DONE name`` when
    ``announce``), then leave: destroy the group, or, without ``tear_down``, exit at once (gloo's teardown can
    abort a rank after a control that failed a load on purpose, which says nothing of the code under test)."""
    args = join(directory, timeout, scenarios)
    for name in args.scenarios:
        scenarios[name](args.directory, args.world)
        dist.barrier()
        if announce and args.rank == 0:
            print(f"DONE {name}", flush=True)
    if tear_down:
        dist.destroy_process_group()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
