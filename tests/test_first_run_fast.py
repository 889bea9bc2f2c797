"""A first run (empty description cache) starts describing its config at once, in a subprocess, and reads a source
whose reader needs no model meanwhile (issue 31): the seconds of transformers' imports overlap the headers' reading.
The description is the same as ever (the subprocess's answer is the in-process one: tests/test_architecture_cold.py);
what is new is when it starts, what runs beside it, and that a description nobody takes is stopped, leaving no entry.

The subprocess here is a shell script standing in for the interpreter (``sys.executable``), so that no test pays
for importing transformers: it answers ``{"none": true}`` (transformers builds no model of the config), which a
source is then planned without."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from conftest import FIXTURES, fixture_dir

from ckpttool.commands import source
from ckpttool.errors import ConfigError
from ckpttool.model import architecture
from ckpttool.model.architecture import DESCRIBE_ENV, Describing, start_describing
from ckpttool.model.describer import CannotSpawn, DescribingProcess

LLAMA_CONFIG = FIXTURES / "llama_fsdp2_dcp" / "reference" / "config.json"


@pytest.fixture
def cold(tmp_path, monkeypatch):
    """An empty description cache of this test's own, described in a subprocess; the cache's entries folder."""
    monkeypatch.setenv("CKPTTOOL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(DESCRIBE_ENV, "subprocess")
    return tmp_path / "cache" / "models"


def fake_python(tmp_path: Path, monkeypatch, script: str) -> None:
    """``sys.executable`` replaced by a shell script (run in ``tmp_path``) for the describing subprocess."""
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\ncd '{tmp_path}'\n{script}\n")
    path.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(path))


def wait_for(path: Path) -> None:
    """Until ``path`` exists (a stand-in subprocess made it); fails after a minute rather than hanging."""
    for _ in range(1200):
        if path.exists():
            return
        time.sleep(0.05)  # the test asserts an order, never a duration
    pytest.fail(f"{path.name} never appeared: the describing subprocess did not run")


#: a stand-in describing subprocess that says it started, then waits for ``go`` (at most ~30 s) before answering
GATED = "touch started; i=0; while [ ! -e go ] && [ $i -lt 600 ]; do sleep 0.05; i=$((i+1)); done; " \
        "[ -e go ] || { echo 'never told to go' >&2; exit 1; }; echo '{\"none\": true, \"peak\": 0}'"


def test_the_subprocess_starts_before_the_result_is_asked_for(cold, tmp_path, monkeypatch):
    fake_python(tmp_path, monkeypatch, GATED)
    config = json.loads(LLAMA_CONFIG.read_text())
    with start_describing(config, label="llama.json") as describing:
        wait_for(tmp_path / "started")  # running while this process does other work
        assert not list(cold.glob("*.json"))
        (tmp_path / "go").touch()
        assert describing.result() is None
        assert describing.result() is None  # taken once
    [entry] = cold.glob("*.json")
    assert json.loads(entry.read_text()) == {"none": True}


def test_a_description_nobody_takes_is_stopped_and_leaves_no_entry(cold, tmp_path, monkeypatch):
    fake_python(tmp_path, monkeypatch, "echo $$ > pid; exec sleep 60")
    with start_describing(json.loads(LLAMA_CONFIG.read_text()), label="llama.json"):
        wait_for(tmp_path / "pid")
    pid = int((tmp_path / "pid").read_text())
    with pytest.raises(ProcessLookupError):  # killed and reaped when the block was left
        os.kill(pid, 0)
    assert not cold.exists() or not list(cold.glob("*.json"))


def test_a_cached_description_starts_no_subprocess(cold, tmp_path, monkeypatch):
    config = json.loads(LLAMA_CONFIG.read_text())
    fake_python(tmp_path, monkeypatch, "echo '{\"none\": true, \"peak\": 0}'")
    assert architecture.model_info(config) is None  # now cached
    fake_python(tmp_path, monkeypatch, "touch started; exit 1")
    with start_describing(config) as describing:
        assert describing.result() is None
    assert not (tmp_path / "started").exists()


def test_a_failed_early_subprocess_names_the_config_when_the_result_is_asked_for(cold, tmp_path, monkeypatch):
    fake_python(tmp_path, monkeypatch, "echo 'MemoryError: cannot allocate' >&2; exit 1")
    with start_describing(json.loads(LLAMA_CONFIG.read_text()), label="models/llama/config.json") as describing:
        with pytest.raises(ConfigError) as failed:
            describing.result()
    assert str(failed.value) == (
        "'models/llama/config.json': describing the llama architecture with transformers in a subprocess failed "
        f"(MemoryError: cannot allocate). Set {DESCRIBE_ENV}=inline to describe it in this process")
    assert not cold.exists() or not list(cold.glob("*.json"))


def test_a_process_that_cannot_start_says_why_when_its_answer_is_asked_for(tmp_path, monkeypatch):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    with DescribingProcess("llama", {"model_type": "llama"}, "llama.json") as child:
        with pytest.raises(CannotSpawn, match="no-such-python"):
            child.answer()


def order_of_calls(monkeypatch) -> list[str]:
    """The order :func:`source.read_layout` and :meth:`Describing.result` are called in, as a list that grows."""
    calls: list[str] = []
    read, result = source.read_layout, Describing.result
    monkeypatch.setattr(source, "read_layout", lambda *a, **k: calls.append("read layout") or read(*a, **k))
    monkeypatch.setattr(Describing, "result", lambda self: calls.append("description") or result(self))
    return calls


def test_a_dcp_source_is_read_while_its_config_is_described(cold, tmp_path, monkeypatch):
    fake_python(tmp_path, monkeypatch, GATED)
    calls = order_of_calls(monkeypatch)
    read = source.read_layout

    def read_while_describing(*args, **kwargs):
        wait_for(tmp_path / "started")  # the subprocess runs beside this read
        (tmp_path / "go").touch()
        return read(*args, **kwargs)

    monkeypatch.setattr(source, "read_layout", read_while_describing)
    planned = source.plan_source(fixture_dir("llama_fsdp2_dcp") / "checkpoint", config=LLAMA_CONFIG)
    assert calls == ["read layout", "description"]
    assert planned.model is None and "model.embed_tokens.weight" in planned.layout.tensors
    assert len(list(cold.glob("*.json"))) == 1


def test_a_megatron_source_is_read_with_its_description(cold, tmp_path, monkeypatch):
    fake_python(tmp_path, monkeypatch, "echo '{\"none\": true, \"peak\": 0}'")
    calls = order_of_calls(monkeypatch)
    source.plan_source(FIXTURES / "megatron_tp2_pp2" / "legacy", config=FIXTURES / "megatron_tp2_pp2" / "config.json")
    assert calls == ["description", "read layout"]  # its training args are checked against the description


def test_a_config_larger_than_a_pipe_reaches_the_subprocess_whole(cold, tmp_path, monkeypatch):
    config = {**json.loads(LLAMA_CONFIG.read_text()), "id2label": {str(i): f"label {i}" for i in range(20_000)}}
    fake_python(tmp_path, monkeypatch, "wc -c > size; echo '{\"none\": true, \"peak\": 0}'")
    with start_describing(config, label="llama.json") as describing:
        assert describing.result() is None
    request = json.dumps({"config": config, "label": "llama.json"}).encode()
    assert len(request) > 2**16 and int((tmp_path / "size").read_text()) == len(request)
