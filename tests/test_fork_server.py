"""The tests' fork server (tests/fork_server.py, conftest's ForkServer): a job forked from it reports what a process
of its own would (exit code, stdout, stderr, the signal that killed it), several ranks get torchrun's environment and
the first that fails ends the others, and a server that dies fails the job it ran with its reason, never the next."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from fork_client import FRESH_PROCESSES_ENV, ForkServer


@pytest.fixture
def server(tmp_path):
    forks = ForkServer(Path(sys.executable), ("json",), tmp_path)
    yield forks
    forks.close()


def python_c(server: ForkServer, code: str, *args: str, timeout: float = 60):
    return server.run([sys.executable, "-c", code, *args], {"code": code, "args": list(args)}, timeout)


def test_a_job_reports_its_code_and_output_as_its_own_process_would(server):
    done = python_c(server, "import sys; print(sys.argv[1:]); print('oops', file=sys.stderr); sys.exit(3)", "a", "b")
    assert (done.returncode, done.stdout, done.stderr) == (3, "['a', 'b']\n", "oops\n")
    done = python_c(server, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert done.returncode == -signal.SIGKILL
    done = python_c(server, "raise ValueError('bad input')")
    assert done.returncode == 1 and "ValueError: bad input" in done.stderr


def test_every_job_gets_a_fresh_process(server):
    first = python_c(server, "import os, json; json.marker = 1; print(os.getpid())")
    second = python_c(server, "import os, json; print(os.getpid(), hasattr(json, 'marker'))")
    assert first.returncode == second.returncode == 0
    assert second.stdout.split()[1] == "False" and first.stdout.split()[0] != second.stdout.split()[0]


def test_ranks_get_torchruns_environment_and_the_first_failure_ends_the_others(server, tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import os, sys, time\n"
                      "from pathlib import Path\n"
                      "rank = os.environ['RANK']\n"
                      "print(rank, os.environ['WORLD_SIZE'], os.environ['MASTER_PORT'] != '', sys.argv[1], flush=True)\n"
                      f"Path('{tmp_path}', 'printed' + rank).touch()\n"
                      "if rank == '1':\n"
                      f"    while len(list(Path('{tmp_path}').glob('printed*'))) < 3:\n"
                      "        time.sleep(0.01)\n"
                      "    sys.exit(5)\n"
                      "time.sleep(600)\n")
    start = time.monotonic()
    done = server.run(["torchrun"], {"script": str(script), "args": ["x"], "nproc": 3}, 60)
    assert time.monotonic() - start < 30  # not the 600 s rank 0 and 2 would sleep
    assert done.returncode == 5
    assert done.stdout == "[rank 0]\n0 3 True x\n[rank 1]\n1 3 True x\n[rank 2]\n2 3 True x\n"
    assert "rank 1 exited with 5; the other ranks were ended" in done.stderr


def test_a_job_past_its_timeout_is_killed_and_says_so(server):
    done = python_c(server, "import time; time.sleep(600)", timeout=1)
    assert done.returncode == -signal.SIGKILL
    assert "fork_server: timed out after 1 s" in done.stderr


def test_a_server_that_dies_fails_its_job_with_the_reason_and_the_next_job_gets_a_new_one(server):
    done = python_c(server, "import os, sys; print('server going', file=sys.stderr); os.kill(os.getppid(), 9)")
    assert done.returncode == -1
    assert "fork_server" in done.stderr and "died with -9 during the job" in done.stderr
    assert python_c(server, "print('again')").stdout == "again\n"


def test_fresh_processes_on_request(server, monkeypatch):
    monkeypatch.setenv(FRESH_PROCESSES_ENV, "1")
    done = python_c(server, "import os; print(os.getppid())")
    assert done.returncode == 0 and int(done.stdout) == os.getpid()  # started by this process, not by a server
    assert server.proc is None
