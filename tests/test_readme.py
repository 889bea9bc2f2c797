"""The README's commands are the ones CI runs, and the fixture it names exists."""

from __future__ import annotations

import os
import re
import subprocess
import sys

from conftest import ROOT


def _commands() -> list[str]:
    readme = (ROOT / "README.md").read_text()
    return [block.strip() for block in re.findall(r"```bash\n(.*?)```", readme, re.S)]


def _expanded(command: str) -> str:
    """The command, followed by the text of the repository script it runs (``bash scripts/test.sh``), if any."""
    script = re.fullmatch(r"bash (\S+)", command)
    return command if script is None else command + "\n" + (ROOT / script.group(1)).read_text()


def test_ci_runs_the_readme_test_command():
    test_command = _commands()[1]  # Quick start, command 2
    ci = (ROOT / ".ci" / "run").read_text()
    assert test_command in [line.strip() for line in ci.splitlines() if not line.lstrip().startswith("#")]


def test_the_readme_test_command_installs_chromium_and_requires_the_browser_test():
    """What CI runs must not skip the HTML report's browser test: chromium is installed, and its absence fails."""
    script = _expanded(_commands()[1])
    assert "apt-get install -y -qq chromium" in script and "sudo" in script
    assert 'CKPTTOOL_REQUIRE_CHROMIUM="${CKPTTOOL_REQUIRE_CHROMIUM:-1}"' in script
    assert re.search(r"^pytest -q\b", script, re.M)
    syntax = subprocess.run(["bash", "-n", str(ROOT / "scripts" / "test.sh")], capture_output=True, text=True)
    assert syntax.returncode == 0, syntax.stderr


def test_readme_main_job_uses_a_shipped_fixture_and_pins_torch():
    main_job = next(c for c in _commands() if "ckpttool merge" in c)
    fixture = re.search(r"ckpttool merge (\S+)", main_job).group(1)
    assert (ROOT / fixture / ".metadata").is_file()
    for command in map(_expanded, _commands()[:2]):
        assert "pip install torch==2.13.0" in command or "pip install -q torch==2.13.0" in command
        assert "-c .ci/constraints.txt" in command


def test_readme_main_job_runs(tmp_path):
    """The ckpttool part of the main job, with its /tmp paths moved into tmp_path: every step exits 0."""
    main_job = next(c for c in _commands() if "ckpttool merge" in c)
    steps = main_job[main_job.index("ckpttool merge"):].replace("/tmp/", f"{tmp_path}/")
    env = {**os.environ, "PATH": f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"}
    result = subprocess.run(steps, shell=True, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "audit: PASS" in result.stdout and "equal: 21 tensors identical" in result.stdout
    assert (tmp_path / "ckpttool-demo" / "ckpttool-audit.json").is_file()
    assert (tmp_path / "ckpttool-demo-audit.html").read_text().startswith("<!DOCTYPE html>")
