"""The fixture script is the producer: regenerating fixtures with the real frameworks gives the same weights.

This runs torchrun with gloo on the CPU (about 20 s), so CI exercises the real producers, and proves that the
committed fixtures were made by ``fixtures/make_fixtures.py`` and not edited by hand.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import ckpttool
from conftest import FIXTURES, load_output

REGENERATED = ("llama_tp2_dcp", "mixtral_hf_tp2_ep2")


@pytest.fixture(scope="module")
def regenerated(tmp_path_factory):
    out = tmp_path_factory.mktemp("fixtures")
    subprocess.run(
        [sys.executable, str(FIXTURES / "make_fixtures.py"), "--only", *REGENERATED, "--out", str(out)],
        check=True, capture_output=True, timeout=600,
    )
    return out


@pytest.mark.parametrize("name", REGENERATED)
def test_regenerated_fixture_merges_to_the_committed_reference(regenerated, name, tmp_path):
    assert sorted(p.name for p in (regenerated / name / "checkpoint").iterdir()) == sorted(
        p.name for p in (FIXTURES / name / "checkpoint").iterdir()
    )
    ckpttool.merge(regenerated / name / "checkpoint", tmp_path / "out")
    got = load_output(tmp_path / "out")
    want = load_output(FIXTURES / name / "reference")
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[k], want[k]) for k in want)
