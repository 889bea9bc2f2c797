"""What the terminal shows: exit codes through a closed pipe, a progress bar that never tears or lingers,
units that mean what they say, names that cannot forge lines, and Ctrl-C while the command starts."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import ROOT, fixture_dir
from safetensors.torch import save_file
from test_audit_cli import dead_expert_mixtral

from ckpttool.console.terminal import size_text as _size
from ckpttool.console.startup import MESSAGE, started_as_command
from ckpttool.console.terminal import Bar, escaped, shown

LLAMA = fixture_dir("llama_tp2_dcp") / "checkpoint"
COMMAND = [sys.executable, "-m", "ckpttool"]


def visible(stderr: str) -> list[str]:
    """The lines a terminal shows at the end: each as its last carriage return leaves it, blank ones dropped."""
    lines = [line.rsplit("\r", 1)[-1].rstrip() for line in stderr.split("\n")]
    return [line for line in lines if line]


# ---------------------------------------------------------------------------------------------- closed pipes


@pytest.mark.parametrize("options", [(), ("--json",)])
def test_audit_exit_code_survives_a_closed_stdout(tmp_path, options):
    broken = dead_expert_mixtral(tmp_path)
    proc = subprocess.Popen([*COMMAND, "audit", broken, *options], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # the reader is gone before the report is printed: every write meets a broken pipe
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 3, stderr
    assert "Traceback" not in stderr and "BrokenPipe" not in stderr and "Exception ignored" not in stderr


def test_audit_piped_into_head_exits_3(tmp_path):
    broken = dead_expert_mixtral(tmp_path)
    shell = f"{' '.join(COMMAND)} audit '{broken}' -q | head -1; exit ${{PIPESTATUS[0]}}"
    result = subprocess.run(["bash", "-c", shell], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 3, result.stderr
    assert result.stdout.startswith("error    zero-tensor") and result.stdout.count("\n") == 1
    assert "Traceback" not in result.stderr


def test_merge_dry_run_into_a_closed_pipe_exits_0():
    proc = subprocess.Popen([*COMMAND, "merge", LLAMA, "--dry-run"], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    stderr = proc.stderr.read()
    assert proc.wait(timeout=300) == 0, stderr
    assert stderr == ""


# ------------------------------------------------------------------------------------------- progress bars

#: a merge that draws its bar, logs a warning halfway, then fails or is interrupted
FAKE_MERGE = """
import logging, sys
import ckpttool.cli as cli
from ckpttool.errors import SourceError

def fake(src, out, *, progress, **options):
    progress(1000, 10000)
    logging.getLogger("ckpttool.test").warning("a warning while the bar is drawn")
    progress(1000, 10000)
    if sys.argv[1] == "interrupt":
        raise KeyboardInterrupt
    raise SourceError("'x.pt': broken")

cli.merge = fake
cli.main(["merge", "src", "out"], prog_name="ckpttool")
"""


@pytest.mark.parametrize(("how", "message"), [
    ("error", "Error: 'x.pt': broken"),
    ("interrupt", "Error: interrupted; nothing was published"),
])
def test_log_lines_and_errors_never_share_a_line_with_the_bar(how, message):
    result = subprocess.run([sys.executable, "-c", FAKE_MERGE, how], cwd=ROOT, capture_output=True, timeout=300)
    stderr = result.stderr.decode()  # not text=True: universal newlines would turn the bar's "\r" into "\n"
    assert result.returncode == (130 if how == "interrupt" else 1)
    assert "merge:  10%" in stderr and "1.00kB/10.0kB" in stderr  # drawn, in decimal units
    assert visible(stderr) == ["WARNING ckpttool.test: a warning while the bar is drawn", message]


def test_a_closed_bar_ignores_late_progress(capsys):
    bar = Bar("merge")
    bar(10, 100)
    bar.close(clear=True)
    drawn = capsys.readouterr().err
    assert "merge:" in drawn and visible(drawn) == []  # erased
    bar(10, 100)  # a worker thread finishing after the failure
    bar.close()
    assert capsys.readouterr().err == ""


# -------------------------------------------------------------------------------------------------- units


def test_sizes_say_binary_units_when_they_are_binary(cli):
    assert [_size(n) for n in (512, 1536, 5 * 2**20, 5 * 2**30)] == ["512 B", "1.5 KiB", "5.0 MiB", "5.0 GiB"]
    doc = json.loads(cli("merge", LLAMA, "--dry-run", "--json").stdout)
    text = cli("merge", LLAMA, "--dry-run").stdout
    assert f"would write {doc['total_bytes'] / 1024:.1f} KiB in 1 file" in text


# ------------------------------------------------------------------------------------------ forged lines

EVIL = "evil\nerror    forged-code  x.weight"
ANSI = "clear\x1b[2J.weight"


def evil_source(path: Path, value: float) -> Path:
    path.mkdir()
    save_file({"ok.weight": torch.arange(4.0), EVIL: torch.full((4,), value), ANSI: torch.arange(2.0)},
              str(path / "model.safetensors"))
    return path


def assert_not_forged(output: str) -> None:
    assert not any(line.startswith("error    forged") for line in output.splitlines())
    assert "\x1b" not in output
    assert repr(EVIL) in output


def test_names_are_escaped_in_every_terminal_output(cli, tmp_path):
    src = evil_source(tmp_path / "a", float("nan"))
    listing = cli("merge", src, "--dry-run")
    assert listing.exit_code == 0
    assert_not_forged(listing.stdout)
    assert f"  {repr(ANSI)}  F32 [2]  <- {repr(ANSI)} (1 piece)" in listing.stdout
    audit = cli("audit", src)
    assert audit.exit_code == 3
    assert_not_forged(audit.stdout)
    assert re.search(f"^error +nan +{re.escape(repr(EVIL))}$", audit.stdout, re.MULTILINE)
    assert f"         {escaped(repr(EVIL))[:-1]}" in audit.stdout  # the message quotes it escaped
    diff = cli("diff", src, evil_source(tmp_path / "b", 1.0))
    assert diff.exit_code == 3
    assert_not_forged(diff.stdout)
    assert diff.stdout.startswith(f"  {repr(EVIL)}: ")


def test_escape_helpers():
    assert shown("model.norm.weight") == "model.norm.weight"
    assert shown("a\nb") == "'a\\nb'" and shown("tab\there") == "'tab\\there'"
    assert escaped("'a\nb' is bad\x1b[0m") == "'a\\nb' is bad\\x1b[0m"
    assert escaped("two\nlines\r", lines=True) == "two\nlines\\r"


# ---------------------------------------------------------------------------------------- Ctrl-C at start


def interrupted_while_importing(argv: list[str]) -> subprocess.CompletedProcess:
    """Start the command with ``-X importtime`` (a line per imported module on stderr) and send SIGINT as soon
    as torch is being imported, i.e. after ckpttool's first line and long before click parses anything."""
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    seen = []
    for line in proc.stderr:
        seen.append(line)
        if "torch" in line:
            proc.send_signal(signal.SIGINT)
            break
    out, rest = proc.communicate(timeout=120)
    return subprocess.CompletedProcess(argv, proc.returncode, out, "".join(seen) + rest)


def without_importtime(stderr: str) -> str:
    return "".join(line for line in stderr.splitlines(True) if not line.startswith("import time:"))


@pytest.mark.parametrize("how", ["python -m ckpttool", "console script"])
def test_ctrl_c_while_starting_prints_one_line(how):
    script = Path(sys.executable).parent / "ckpttool"
    if how == "console script" and not script.is_file():
        pytest.skip(f"no console script beside {sys.executable} (package not installed)")
    start = ["-m", "ckpttool"] if how.startswith("python") else [str(script)]
    result = interrupted_while_importing([sys.executable, "-X", "importtime", *start, "audit", str(LLAMA)])
    assert result.returncode == 1
    assert without_importtime(result.stderr).strip() == MESSAGE
    assert result.stdout == ""


def test_importing_ckpttool_leaves_ctrl_c_alone():
    code = "import signal, ckpttool; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    # the child starts with Ctrl-C at its default whatever launched the suite (a background job started without
    # job control ignores SIGINT, and its children inherit that), so Python installs its own handler at start-up
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert result.stdout.strip() == "True", result.stderr
    assert not started_as_command()
