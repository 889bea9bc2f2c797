"""What the live gather costs besides moving and writing bytes: the timeline it logs, and the plan that no longer
travels between ranks (each rank builds its own; only whether it could is shared).

One process, no process group, tiny tensors: the multi-rank behaviour is tests/test_live.py's.
"""

from __future__ import annotations

import logging

import pytest
import torch
from safetensors.torch import load_file

import ckpttool.live as live
from ckpttool.live import save_hf
from ckpttool.live.gather import Timeline
from ckpttool.plan.plan import Plan


@pytest.fixture(scope="module")
def state() -> dict[str, torch.Tensor]:
    return {"model.embed_tokens.weight": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32),
            "model.norm.weight": torch.ones(32, dtype=torch.float32),
            "lm_head.weight": torch.arange(64 * 32, dtype=torch.float32).reshape(64, 32).flip(0).contiguous()}


def test_the_gather_logs_where_its_time_went(state, tmp_path, caplog):
    with caplog.at_level(logging.INFO, logger="ckpttool.live.gather"):
        save_hf(state, tmp_path / "hf", bucket_bytes=16 * 1024)
    lines = [r.getMessage() for r in caplog.records if r.name == "ckpttool.live.gather"]
    assert len(lines) == 1 and lines[0].startswith("live gather, rank 0: ")
    for step in ("waiting for the writer", "receiving", "writer waiting for buckets", "writing"):
        assert f"{step} " in lines[0] and " s (CPU " in lines[0], step
    got = load_file(tmp_path / "hf" / "model.safetensors")
    assert sorted(got) == sorted(state) and all(torch.equal(got[n], state[n]) for n in state)


def test_a_timeline_adds_wall_and_cpu_seconds_by_step():
    clock = Timeline()
    clock.add("receiving", 1.5, 0.25)
    clock.add("receiving", 0.5, 0.25)
    with clock.timing("writing"):
        sum(range(1000))
    assert clock.seconds["receiving"] == [2.0, 0.5]
    assert set(clock.seconds) == {"receiving", "writing"} and min(clock.seconds["writing"]) >= 0
    assert str(clock).startswith("receiving 2.00 s (CPU 0.50 s); writing ")


def test_no_plan_travels_between_the_ranks(state, tmp_path, monkeypatch):
    shared: dict[str, list] = {}
    collect = live.collect

    def spy(group, watch, step, work, **kw):
        shared[step] = result = collect(group, watch, step, work, **kw)
        return result

    monkeypatch.setattr(live, "collect", spy)
    result = save_hf(state, tmp_path / "hf")
    assert shared["plan"] == [None]  # the plan stays on the rank that built it
    assert isinstance(result.plan, Plan) and sorted(t.name for t in result.plan.targets) == sorted(state)
    assert (tmp_path / "hf" / "model.safetensors").is_file()


def test_a_plan_refused_on_a_rank_still_stops_the_save(tmp_path):
    from ckpttool.errors import SourceError

    with pytest.raises(SourceError, match=r"^'w': the local tensor of shape \[2, 2\] at offsets \[3, 0\] does not fit "
                                          r"the global shape \[4, 2\]$"):
        from ckpttool.io.sidecar import PieceSpec

        save_hf({"w": torch.ones(2, 2)}, tmp_path / "hf", specs={"w": PieceSpec(global_shape=(4, 2), offsets=(3, 0))})
    assert not (tmp_path / "hf").exists() and list(tmp_path.iterdir()) == []


def test_the_early_audit_import_never_raises(monkeypatch):
    import importlib

    def fail(name):
        raise ImportError(f"no module named {name!r}")

    monkeypatch.setattr(importlib, "import_module", fail)
    assert live._load_audit() is None
