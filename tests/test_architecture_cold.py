"""A config not in the description cache is described by transformers in a short-lived subprocess, so that the
merging process never imports transformers (issue 19: a cold cache raised a merge's peak memory above the plan's
prediction). The subprocess's answer is the in-process one; its failures name the config and the reason; a host
that cannot start one describes the config in its own process; the time it took is logged."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import FIXTURES, fixture_dir

from ckpttool.model import architecture
from ckpttool.model.architecture import DESCRIBE_ENV, model_info
from ckpttool.errors import ArgumentError, ConfigError

CONFIGS = {
    "moe": FIXTURES / "mixtral_fsdp2_dcp" / "reference" / "config.json",  # stacked experts saved per expert
    "mtp": FIXTURES / "deepseek_v3_hf_mtp" / "checkpoint" / "config.json",  # a family alias and MTP layers
}


def config_of(name: str) -> dict:
    return json.loads(CONFIGS[name].read_text())


def tied_llama() -> dict:
    return {**json.loads((fixture_dir("llama_tp2_dcp") / "config.json").read_text()), "tie_word_embeddings": True}


@pytest.fixture
def cold(tmp_path, monkeypatch):
    """An empty description cache of this test's own, and the description made where ``mode`` says."""

    def use(mode: str, cache: str = "cache") -> Path:
        monkeypatch.setenv("CKPTTOOL_CACHE", str(tmp_path / cache))
        monkeypatch.setenv(DESCRIBE_ENV, mode)
        return tmp_path / cache / "models"

    return use


@pytest.mark.parametrize("name", ["moe", "mtp", "tied"])
def test_the_subprocess_describes_a_config_as_this_process_does(cold, monkeypatch, name):
    config = tied_llama() if name == "tied" else config_of(name)
    cold("inline", "inline")
    inline = model_info(config)
    entries = cold("subprocess")
    with monkeypatch.context() as m:
        m.setattr(architecture, "_describe", lambda *a: pytest.fail("described in the merging process"))
        assert model_info(config) == inline
        m.setattr(architecture, "_build", lambda *a: pytest.fail("the entry the subprocess's answer made is not read"))
        assert model_info(config) == inline
    assert len(list(entries.glob("*.json"))) == 1
    what = {"moe": lambda: "model.layers.0.block_sparse_moe.experts.0.w1.weight" in inline.disk_shapes,
            "mtp": lambda: inline.family == "qwen2_moe" and inline.mtp_shapes, "tied": lambda: inline.tied}
    assert inline is not None and what[name]()


def test_a_config_transformers_rejects_gives_the_same_error_from_the_subprocess(cold):
    config = {**tied_llama(), "hidden_act": "swiglu-typo"}
    cold("inline")
    with pytest.raises(ConfigError) as inline:
        model_info(config, label="bad.json")
    cold("subprocess", "cache-2")
    with pytest.raises(ConfigError) as described:
        model_info(config, label="bad.json")
    assert str(described.value) == str(inline.value)
    assert str(inline.value).startswith("'bad.json': transformers cannot build a llama model from it: 'swiglu-typo'")


def fake_python(tmp_path: Path, script: str) -> str:
    path = tmp_path / "python"
    path.write_text(f"#!/bin/sh\n{script}\n")
    path.chmod(0o755)
    return str(path)


@pytest.mark.parametrize("script,reason", [
    ("echo 'Traceback (most recent call last):' >&2; echo 'MemoryError: cannot allocate' >&2; exit 1",
     "MemoryError: cannot allocate"),
    ("kill -9 $$", "killed by SIGKILL"),
    ("exit 3", "exit status 3"),
    ("echo '{not json'", "its answer is not a description: "),
])
def test_a_failed_subprocess_names_the_config_and_the_reason(cold, tmp_path, monkeypatch, script, reason):
    entries = cold("subprocess")
    monkeypatch.setattr(sys, "executable", fake_python(tmp_path, script))
    with pytest.raises(ConfigError) as failed:
        model_info(tied_llama(), label="models/llama/config.json")
    message = str(failed.value)
    assert message.startswith("'models/llama/config.json': describing the llama architecture with transformers in a "
                              f"subprocess failed ({reason}")
    assert message.endswith(f"). Set {DESCRIBE_ENV}=inline to describe it in this process")
    assert not list(entries.glob("*.json"))  # no entry for a description that was not made


def test_a_host_that_cannot_start_a_subprocess_describes_here(cold, tmp_path, monkeypatch, caplog):
    cold("inline", "inline")
    expected = model_info(tied_llama())
    cold("subprocess")
    monkeypatch.setattr(sys, "executable", str(tmp_path / "no-such-python"))
    with caplog.at_level(logging.INFO, logger="ckpttool.model.architecture"):
        assert model_info(tied_llama()) == expected
    assert "cannot start a subprocess to describe the architecture" in caplog.text
    assert "in this process; cached for the next run" in caplog.text


def test_the_time_a_cold_description_takes_is_logged(cold, caplog):
    cold("subprocess")
    with caplog.at_level(logging.INFO, logger="ckpttool.model.architecture"):
        model_info(tied_llama(), label="llama.json")
        described = caplog.text
        caplog.clear()
        model_info(tied_llama(), label="llama.json")  # warm: nothing to say
    assert "described the llama architecture of 'llama.json' with transformers in " in described
    assert " s, in a subprocess (peak RSS " in described and "MiB); cached for the next run" in described
    assert "described" not in caplog.text


def test_an_unknown_describe_mode_is_refused(cold):
    cold("fork")
    with pytest.raises(ArgumentError) as refused:
        model_info(tied_llama())
    assert str(refused.value) == (f"{DESCRIBE_ENV}='fork': expected 'subprocess' or 'inline' (describe the "
                                  "architecture in this process)")


COLD_MERGE = """
import json, sys
import ckpttool
result = ckpttool.merge(sys.argv[1], sys.argv[2])
print(json.dumps({"transformers": sorted(m for m in sys.modules if m.split(".")[0] == "transformers"),
                  "generic": result.generic, "adapter": result.adapter}))
"""


def test_a_merge_on_a_cold_cache_does_not_import_transformers(tmp_path):
    """In a fresh process with an empty cache: the architecture is mapped, the entry written, and transformers
    never imported by the merging process."""
    env = {k: v for k, v in os.environ.items() if k != DESCRIBE_ENV}
    env["CKPTTOOL_CACHE"] = str(tmp_path / "cache")
    done = subprocess.run([sys.executable, "-c", COLD_MERGE, str(fixture_dir("llama_tp2_dcp") / "checkpoint"),
                           str(tmp_path / "out")], env=env, capture_output=True, text=True, check=True)
    answer = json.loads(done.stdout.splitlines()[-1])
    assert answer == {"transformers": [], "generic": False, "adapter": "llama (names as transformers saves them)"}
    assert len(list((tmp_path / "cache" / "models").glob("*.json"))) == 1
