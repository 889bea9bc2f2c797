"""A Python that imports its heavy modules once and runs many short jobs in processes forked from it (started by
``tests/conftest.py``'s :class:`ForkServer`: the megatron-core consumers' stand-in for ``torchrun``, and the crash
test's merge children).

Importing megatron-core costs ~12.6 s of CPU per process before any work, and each consumer test started a torchrun
of 2 to 8 ranks, each rank importing it again; each of the crash test's 20 children imported torch again (~4.5 s).
Here a job is run as a fresh process would run it, but forked from this server, so it starts with those modules
imported and with nothing of an earlier job (every job gets new processes):

- ``{"script": PATH, "args": [...], "nproc": N}``: the script as ``__main__`` on N ranks, each with torchrun's
  environment (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``/``MASTER_PORT``, ...) for its ``dist.init_process_group``;
  as torchrun does, the first rank that fails ends the others and the job's exit code is that rank's.
- ``{"code": SOURCE, "args": [...]}``: as ``python -c SOURCE ARGS`` (one process, no torchrun environment).
- ``{"script": PATH, "ranks": [[...], ...]}``: one process a list of arguments, as ``python PATH ARGS`` each (their
  own rendezvous in their arguments), all at once; each runs to its end (a test may kill one rank to see what the
  others do) and has its stdout and stderr in one text. The answer: ``{"returncodes", "outputs"}``, one a rank.

Protocol: ``python tests/fork_server.py MODULE...`` imports the modules and prints ``{"ready": true}``; then one JSON
object a line on stdin (also ``"timeout"``, seconds, ``"logs"``, a directory for the ranks' output files, and the
job's ``"env"`` and ``"cwd"``), one
JSON object a line on stdout: ``{"returncode", "stdout", "stderr"}`` (several ranks: rank by rank). A job killed by
a signal has ``-signal`` as its code, as ``subprocess`` reports it. Only imports are done before a fork: no thread,
no process group, no CUDA.
"""

from __future__ import annotations

import json
import os
import runpy
import signal
import socket
import sys
import time
import traceback
from pathlib import Path

#: the file descriptor the answers go to
_ANSWERS = -1


def _free_port() -> int:
    # torchrun --standalone's workers get a port found the same way (bind to 0); rank 0 binds it for its store
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _child(request: dict, rank: int, port: int | None, logs: Path) -> None:
    """In the forked process: output to ``logs``, torchrun's environment for ``rank`` (when ``port``), the job."""
    code = 1
    try:
        os.close(_ANSWERS)  # the server's answers: a job that outlives it must not hold the pipe open
        ranks = request.get("ranks")
        for fd, name in ((1, f"rank{rank}.out"), (2, f"rank{rank}.out" if ranks else f"rank{rank}.err")):
            out = os.open(logs / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)  # the server's requests are not the job's input
        if "env" in request:  # the test's environment now, not the one the server started with
            os.environ.clear()
            os.environ.update(request["env"])
        if "cwd" in request:
            os.chdir(request["cwd"])
        args = [str(a) for a in (ranks[rank] if ranks else request.get("args", ()))]
        if port is not None:
            nproc = str(request["nproc"])
            os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
                               "WORLD_SIZE": nproc, "LOCAL_WORLD_SIZE": nproc, "ROLE_WORLD_SIZE": nproc,
                               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                               "TORCHELASTIC_RESTART_COUNT": "0"})
        if "script" in request:
            sys.argv = [request["script"], *args]
            sys.path[0] = str(Path(request["script"]).resolve().parent)
            runpy.run_path(request["script"], run_name="__main__")
        else:
            sys.argv = ["-c", *args]
            sys.path[0] = ""
            exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__"})
        code = 0
    except SystemExit as stop:
        if stop.code is None or isinstance(stop.code, int):
            code = stop.code or 0
        else:
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 (the job's failure is its report)
        traceback.print_exc()
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _wait(pids: dict[int, int], timeout: float, codes: dict[int, int], independent: bool = False) -> tuple[int, str]:
    """Wait for every rank (``pid -> rank``, each one's exit code put in ``codes``); the timeout, or the first that
    fails unless ``independent``, ends the others (as torchrun does). Returns the job's exit code and a note on what
    ended it."""
    deadline, code, note = time.monotonic() + timeout, 0, ""
    while pids:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                code, note = -signal.SIGKILL, f"\nfork_server: timed out after {timeout:.0f} s"
                for other in pids:
                    os.kill(other, signal.SIGKILL)
                deadline = float("inf")
            time.sleep(0.02)
            continue
        rank = pids.pop(pid)
        exit_code = codes[rank] = os.waitstatus_to_exitcode(status)
        if exit_code != 0 and code == 0 and not independent:
            code = exit_code
            if pids:
                note = f"\nfork_server: rank {rank} exited with {exit_code}; the other ranks were ended"
                for other in pids:
                    os.kill(other, signal.SIGKILL)
    return code, note


def _job(request: dict) -> dict:
    """Run one job (see the module's docstring); its answer."""
    logs = Path(request["logs"])
    logs.mkdir(parents=True, exist_ok=True)
    nproc = len(request["ranks"]) if "ranks" in request else int(request.get("nproc", 1))
    port = _free_port() if "nproc" in request else None
    sys.stdout.flush()
    sys.stderr.flush()
    pids = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _child(request, rank, port, logs)
        pids[pid] = rank
    codes: dict[int, int] = {}
    code, note = _wait(pids, float(request.get("timeout", 600)), codes, independent="ranks" in request)
    if "ranks" in request:
        outputs = [(logs / f"rank{r}.out").read_text(errors="replace") for r in range(nproc)]
        return {"returncodes": [codes[r] for r in range(nproc)], "outputs": [o + note for o in outputs]}

    def output(kind: str) -> str:
        texts = [(logs / f"rank{r}.{kind}").read_text(errors="replace") for r in range(nproc)]
        return texts[0] if nproc == 1 else "".join(f"[rank {r}]\n{t}" for r, t in enumerate(texts))

    return {"returncode": code, "stdout": output("out"), "stderr": output("err") + note}


def main(modules: list[str]) -> None:
    """Import ``modules``, say ``ready``, then run the jobs read from stdin until it closes."""
    import importlib

    global _ANSWERS
    for name in modules:
        importlib.import_module(name)
    _ANSWERS = os.dup(1)
    respond = os.fdopen(_ANSWERS, "w")
    os.dup2(2, 1)  # a stray print goes to stderr, never into the answers
    respond.write(json.dumps({"ready": True}) + "\n")
    respond.flush()
    for line in sys.stdin:
        if line.strip():
            respond.write(json.dumps(_job(json.loads(line))) + "\n")
            respond.flush()
    # nothing to clean up, and tearing megatron-core's modules down costs seconds: leave at once
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1:])
