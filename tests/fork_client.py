"""The tests' side of tests/fork_server.py: jobs (a script on several ranks, ``python -c``) run in processes forked
from a long-lived server that imported their heavy modules once per session, instead of one Python start-up each.
conftest's fixtures ``megatron_torchrun`` and ``forked_python`` and this module's :func:`launch_ranks` use it."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

#: the venv with megatron-core 0.16.1 that the consumer tests run in
MEGATRON_VENV = Path(os.environ.get("CKPTTOOL_MEGATRON_VENV", "/work/venv-megatron"))
#: what every megatron-core consumer imports (not the Mamba modules: the hybrid consumer puts its einops stand-in
#: in place before it imports them)
MEGATRON_PRELOAD = ("torch", "torch.distributed", "safetensors.torch", "megatron.core", "megatron.core.parallel_state",
                    "megatron.core.dist_checkpointing", "megatron.core.models.gpt",
                    "megatron.core.transformer.moe.moe_utils", "megatron.core.tensor_parallel.random")
#: set to 1 to run every job as its own process again (``torchrun --standalone``, ``python -c``): slower, the same
#: scripts and environment variables, to tell a fault of the fork server from one of the job
FRESH_PROCESSES_ENV = "CKPTTOOL_TEST_FRESH_PROCESSES"


class ForkServer:
    """Short Python jobs forked from one long-lived ``tests/fork_server.py`` that has imported ``modules`` once (each
    job still gets new processes). A job's result is a ``subprocess.CompletedProcess``; a server that dies or hangs
    gives the job a non-zero code and the server's own output, and the next job starts a new server."""

    def __init__(self, python: Path, modules: tuple[str, ...], scratch: Path) -> None:
        self.python, self.modules, self.scratch = python, modules, scratch
        self.jobs = 0
        self.proc: subprocess.Popen | None = None
        self.errors = None

    def _read_line(self, timeout: float) -> str:
        """The server's next answer; '' if it gave none in ``timeout`` seconds or closed its output (then it has
        ended: waited for, for its exit code)."""
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if ready and not line:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        return line

    def _start(self) -> str:
        """Start the server; '' once it is ready, else what went wrong."""
        self.errors = open(self.scratch / f"server-{self.jobs}.err", "w+")
        self.proc = subprocess.Popen(
            [str(self.python), str(Path(__file__).with_name("fork_server.py")), *self.modules], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=self.errors, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
        line = self._read_line(600)
        return "" if line.strip() == '{"ready": true}' else self._lost(f"did not start ({line.strip()!r})")

    def _lost(self, what: str) -> str:
        """Stop a server that failed; what it wrote on stderr, for the job's report."""
        self.proc.kill()
        self.proc.wait()
        self.proc = None
        self.errors.seek(0)
        text = self.errors.read()
        self.errors.close()
        return f"fork_server ({self.python}) {what}:\n{text[-6000:]}"

    def _ask(self, request: dict, timeout: float) -> tuple[dict | None, str]:
        """Send one job (with this process's environment and directory); its answer, or what went wrong."""
        self.jobs += 1
        failure = "" if self.proc is not None and self.proc.poll() is None else self._start()
        if failure:
            return None, failure
        request = {**request, "timeout": timeout, "logs": str(self.scratch / f"job-{self.jobs}"),
                   "env": {**os.environ, "OMP_NUM_THREADS": "1"}, "cwd": os.getcwd()}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        line = self._read_line(timeout + 60)
        if line:
            return json.loads(line), ""
        return None, self._lost("gave no answer" if self.proc.poll() is None else
                                f"died with {self.proc.returncode} during the job")

    def run(self, command: list[str], request: dict, timeout: float) -> subprocess.CompletedProcess:
        """Run ``request`` (see tests/fork_server.py), or ``command`` as its own process when FRESH_PROCESSES_ENV
        is 1."""
        if os.environ.get(FRESH_PROCESSES_ENV) == "1":
            return subprocess.run(command, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                                  timeout=timeout, check=False)
        answer, failure = self._ask(request, timeout)
        if answer is None:
            return subprocess.CompletedProcess(command, -1, "", failure)
        return subprocess.CompletedProcess(command, answer["returncode"], answer["stdout"], answer["stderr"])

    def run_ranks(self, commands: list[list[str]], request: dict, timeout: float) -> tuple[list[int], list[str]]:
        """Run a ``ranks`` request (``commands``, one a rank, all at once, as their own processes when
        FRESH_PROCESSES_ENV is 1): each rank's exit code and output (stdout and stderr together)."""
        if os.environ.get(FRESH_PROCESSES_ENV) == "1":
            procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "OMP_NUM_THREADS": "1"}) for c in commands]
            start, outputs = time.monotonic(), []
            try:
                for p in procs:
                    outputs.append(p.communicate(timeout=max(1.0, timeout - (time.monotonic() - start)))[0])
            finally:
                for p in procs:
                    p.kill()
            return [p.returncode for p in procs], outputs
        answer, failure = self._ask(request, timeout)
        if answer is None:
            return [-1] * len(commands), [failure] * len(commands)
        return answer["returncodes"], answer["outputs"]

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.errors.close()


_SERVERS: dict[tuple[str, tuple[str, ...]], ForkServer] = {}
_SCRATCH: list[Path] = []


def start_session(scratch: Path) -> None:
    """Where the session's servers keep their jobs' files (conftest's ``fork_servers`` fixture)."""
    _SCRATCH.append(scratch)


def close_all() -> None:
    """Stop every server of the session."""
    for server in _SERVERS.values():
        server.close()
    _SERVERS.clear()


def fork_server(python: Path, modules: tuple[str, ...]) -> ForkServer:
    """The session's server of ``python`` that imports ``modules`` (started at its first job)."""
    key = (str(python), modules)
    if key not in _SERVERS:
        _SERVERS[key] = ForkServer(python, modules, _SCRATCH[-1] / f"server-{len(_SERVERS)}")
        _SERVERS[key].scratch.mkdir()
    return _SERVERS[key]


#: what a merge imports anyway (ckpttool checks sys.modules for torch, torch.distributed and transformers: a server
#: must import no more than the job itself would, or the job takes another path)
MERGE_PRELOAD = ("torch", "torch.distributed", "ckpttool", "ckpttool.commands.merge")
#: what every gloo worker (tests/gloo_worker.py) imports at its top
GLOO_PRELOAD = ("torch", "torch.distributed")


def launch_ranks(worker: Path, ranks: list[list[str]], timeout: float) -> tuple[list[int], list[str]]:
    """``python WORKER ARGS`` for each rank's ``ARGS`` (its rendezvous among them), all at once, forked from the
    session's server that imported torch once (instead of once a rank); each rank's exit code and output (stdout
    and stderr together). A rank past ``timeout`` is killed (-9)."""
    ranks = [[str(a) for a in args] for args in ranks]
    return fork_server(Path(sys.executable), GLOO_PRELOAD).run_ranks(
        [[sys.executable, str(worker), *args] for args in ranks], {"script": str(worker), "ranks": ranks}, timeout)
