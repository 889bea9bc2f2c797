"""The consumer proof of ``split --to dcp``: torch's own ``dcp.load`` into really parallelized models.

Each job (``tests/split_worker.py``, one process per rank on gloo) builds the model with other weights,
parallelizes it (torch FSDP2, DTensor tensor parallel, FSDP2 over TP on a 2-D mesh, transformers'
``DistributedConfig`` with expert parallel), loads what :func:`ckpttool.split` wrote from the HuggingFace reference,
and compares its logits with the unsharded transformers model's. FSDP2 computes exactly the reference's logits;
tensor parallel sums partial products in another order, so the logits agree to float32 rounding (the bound
below is 20x what these runs show, and 10^4 times smaller than the differences a wrong chunk makes). Negative
controls: a chunk swapped in ``.metadata`` loads but changes the logits; a missing rank file fails the load.
"""

from __future__ import annotations

import re
import socket
from pathlib import Path

import pytest

import ckpttool
from conftest import fixture_dir
from fork_client import launch_ranks

WORKER = Path(__file__).resolve().parent / "split_worker.py"
LLAMA = fixture_dir("llama_fsdp2_dcp") / "reference"
MIXTRAL = fixture_dir("mixtral_fsdp2_dcp") / "reference"
#: float32 rounding of a tensor-parallel forward (measured: 3e-7) stays far below this
ROUNDING = 1e-5


def launch(world: int, splits: Path, *scenarios: str, timeout: float = 400, worker: Path = WORKER) -> list[str]:
    """Run ``worker`` on ``world`` ranks; every rank must exit 0. Returns every rank's output."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    codes, outputs = launch_ranks(worker, [["--rank", r, "--world", world, "--port", port, "--splits", splits, *scenarios]
                                           for r in range(world)], timeout)
    assert codes == [0] * world, "\n".join(outputs)
    return outputs


def results(output: str, kind: str = "RESULT") -> dict[str, float]:
    """``{scenario: max |logits - reference|}`` from rank 0's ``RESULT`` (or ``SCRAMBLED``) lines."""
    return {m.group(1): float(m.group(2)) for m in re.finditer(rf"^{kind} (\S+) (\S+)$", output, re.M)}


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    splits = tmp_path_factory.mktemp("splits2")
    for name, source, mesh in [
        ("llama_fsdp2", LLAMA, dict(fsdp=2)), ("llama_tp", LLAMA, dict(tp=2)), ("mixtral_fsdp2", MIXTRAL, dict(fsdp=2)),
        ("mixtral_tp_ep", MIXTRAL, dict(tp=2, ep=2)), ("wrong_chunk", LLAMA, dict(fsdp=2)), ("missing_file", LLAMA, dict(fsdp=2)),
    ]:
        ckpttool.split(source, splits / name, **mesh)
    output = launch(2, splits, "llama_fsdp2", "llama_tp", "mixtral_fsdp2", "mixtral_tp_ep", "wrong_chunk", "missing_file")[0]
    return results(output), output


def test_fsdp2_loads_the_split_and_computes_the_reference_logits_exactly(two):
    assert two[0]["llama_fsdp2"] == 0.0
    assert two[0]["mixtral_fsdp2"] == 0.0


def test_tensor_parallel_loads_the_split(two):
    assert two[0]["llama_tp"] < ROUNDING


def test_transformers_expert_parallel_loads_the_split(two):
    assert results(two[1], "SCRAMBLED")["mixtral_tp_ep"] > 0.1  # before the load, other weights: far off
    assert two[0]["mixtral_tp_ep"] < ROUNDING


def test_a_swapped_chunk_loads_but_changes_the_logits(two):
    assert two[0]["wrong_chunk"] > 1000 * ROUNDING


def test_a_missing_rank_file_fails_the_load(two):
    assert re.search(r"^REFUSED missing_file: CheckpointException: FileNotFoundError: .*No such file or directory: "
                     r"'.*/missing_file/__1_0\.distcp'$", two[1], re.M), two[1]
    assert "LOADED missing_file" not in two[1]


def test_two_dimensional_meshes_on_four_ranks(tmp_path):
    """FSDP2 over TP (torch), and transformers' fsdp x tp with experts over ep and FSDP2 over efsdp."""
    ckpttool.split(LLAMA, tmp_path / "llama_2d", fsdp=2, tp=2)
    ckpttool.split(MIXTRAL, tmp_path / "mixtral_2d_ep", fsdp=2, tp=2, ep=2)
    found = results(launch(4, tmp_path, "llama_2d", "mixtral_2d_ep")[0])
    assert found["llama_2d"] < ROUNDING
    assert found["mixtral_2d_ep"] < ROUNDING
