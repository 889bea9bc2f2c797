"""Live gather (``ckpttool.live.save_hf``) from real sharded jobs on gloo: 2 and 4 processes.

Each job loads the fixtures' reference model on every rank, shards it (FSDP2, DTensor TP, a 2-D mesh, experts
over ranks, transformers DistributedConfig, plain tensors with PieceSpecs) and saves it live. The outputs
must equal the reference weights bit for bit, load in transformers with equal logits, and equal the offline
merge of a DCP save of the same model.
"""

from __future__ import annotations

import hashlib
import re
import socket
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import ckpttool
from ckpttool.live import WATCH_SECONDS
from conftest import fixture_dir, load_output
from fork_client import launch_ranks

WORKER = Path(__file__).resolve().parent / "live_worker.py"
LLAMA = fixture_dir("llama_fsdp2_dcp") / "reference"
MIXTRAL = fixture_dir("mixtral_fsdp2_dcp") / "reference"


def launch(world: int, out: Path, *scenarios: str, timeout: float = 300, worker: Path = WORKER) -> tuple[list[int], list[str], float]:
    """Run ``world`` ``worker`` processes (one per rank) and wait; their return codes, outputs and the time taken."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    codes, outputs = launch_ranks(worker, [["--rank", r, "--world", world, "--port", port, "--out", out, *scenarios]
                                           for r in range(world)], timeout)
    return codes, outputs, time.monotonic() - start


def assert_is_reference(directory: Path, reference: Path) -> None:
    """Bit for bit the reference weights, and the same logits from transformers."""
    from transformers import AutoModelForCausalLM

    got, want = load_output(directory), load_output(reference)
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    tokens = torch.tensor([[1, 17, 250, 999, 4, 500, 1000, 2]])
    with torch.no_grad():
        a = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()(tokens).logits
        b = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32).eval()(tokens).logits
    assert torch.equal(a, b)


def digests(directory: Path) -> dict[str, str]:
    """The weights files and the index (config and tokenizer files come from different places)."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())
            if p.name.startswith("model")}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    out = tmp_path_factory.mktemp("live4")
    codes, outputs, _ = launch(4, out, "fsdp2", "mesh2d", "moe", "spec", "spec_missing")
    assert codes == [0, 0, 0, 0], "\n".join(outputs)
    return out, outputs


@pytest.fixture(scope="module")
def two(tmp_path_factory):
    out = tmp_path_factory.mktemp("live2")
    codes, outputs, _ = launch(2, out, "tp", "hf_tp", "partial", "empty")
    assert codes == [0, 0], "\n".join(outputs)
    return out, outputs


def test_fsdp2_four_ranks_equals_the_reference_and_the_offline_merge(four, tmp_path):
    out, outputs = four
    assert_is_reference(out / "fsdp2", LLAMA)
    ckpttool.merge(out / "fsdp2_dcp", tmp_path / "offline", config=LLAMA, max_shard_size="60KB")
    assert digests(out / "fsdp2") == digests(tmp_path / "offline")
    assert len(list((out / "fsdp2").glob("model-*.safetensors"))) == 4
    assert "WRITERS [0, 1, 2, 3]" in outputs[0]  # every rank wrote a file


def test_two_dimensional_mesh_with_strided_shards(four):
    assert_is_reference(four[0] / "mesh2d", LLAMA)


def test_experts_sharded_over_ranks(four):
    assert_is_reference(four[0] / "moe", MIXTRAL)


def test_plain_tensors_with_specs_strip_the_padded_vocab(four):
    out = four[0] / "spec"
    assert_is_reference(out, LLAMA)  # 1001 rows: the 7 junk rows of the padded vocab are gone


def test_a_missing_piece_is_refused_on_every_rank_and_nothing_is_written(four):
    out, outputs = four
    for text in outputs:
        assert "REFUSED: the checkpoint does not cover its tensors exactly" in text
        assert "'model.embed_tokens.weight': rows 753..1001 covered by no piece" in text
    assert not (out / "spec_missing").exists()
    assert not [p for p in out.iterdir() if "partial" in p.name]


def test_tensor_parallel_with_an_uneven_vocab(two):
    assert_is_reference(two[0] / "tp", LLAMA)


def test_transformers_distributed_config_model(two):
    assert_is_reference(two[0] / "hf_tp", LLAMA)


def test_tensors_with_no_elements_are_written_not_dropped(two):
    got = load_output(two[0] / "empty")
    assert {name: tuple(t.shape) for name, t in got.items()} == {
        "rows.empty": (0, 4), "cols.empty": (4, 0), "plain.empty": (0,), "uneven": (1, 4)}
    assert torch.equal(got["uneven"], torch.arange(4.0).reshape(1, 4))


def test_a_partial_dtensor_is_refused(two):
    for text in two[1]:
        assert "REFUSED: 'model.norm.weight': a DTensor with a Partial placement holds unreduced sums" in text


def test_a_killed_rank_stops_the_others_naming_it(tmp_path):
    codes, outputs, seconds = launch(2, tmp_path, "die", timeout=120)
    assert codes[1] != 0  # killed
    assert codes[0] == 3, outputs[0]
    assert "RANK 0 FAILED: rank 1 stopped responding (died, hung or never arrived)" in outputs[0]
    assert "nothing was published" in outputs[0]
    assert seconds < 60  # the worker's timeout is 20 s
    assert not (tmp_path / "die").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".die")]


def test_a_rank_that_never_arrives_is_named(tmp_path):
    codes, outputs, _ = launch(2, tmp_path, "absent", timeout=120)
    assert codes[0] == 3, outputs[0]
    match = re.search(r"RANK 0 FAILED after (\d+) s: rank 1 stopped responding \(died, hung or never arrived\)", outputs[0])
    assert match is not None, outputs[0]
    assert int(match.group(1)) <= 5 + WATCH_SECONDS + 5  # the timeout, the heartbeat watch, a margin
    assert not (tmp_path / "absent").exists()


# ---- one process: no process group -------------------------------------------------------------


def reference_state() -> dict[str, torch.Tensor]:
    return load_file(LLAMA / "model.safetensors")


def llama_config() -> dict:
    import json

    return json.loads((LLAMA / "config.json").read_text())


def test_one_process_without_a_process_group(tmp_path):
    from ckpttool.live import save_hf

    result = save_hf(reference_state(), tmp_path / "hf", config=llama_config(), max_shard_size="100KB",
                     bucket_bytes=64 * 1024)
    assert_is_reference(tmp_path / "hf", LLAMA)
    assert set(result.writers.values()) == {0} and len(result.files) == 3
    assert result.audit is not None and result.audit.ok


def test_large_tensors_are_built_from_the_buckets_not_copied_from_files(tmp_path):
    """Chunks of 1 MiB and more that an offline merge copies file to file (or reads with one pread) are built from
    the gathered buffers: a live rank's pieces are in memory, not in files named "rank N"."""
    from ckpttool.live import save_hf

    state = {"big": torch.arange(2**20, dtype=torch.float32).reshape(1024, 1024),
             "rows": torch.arange(3 * 2**18, dtype=torch.float32).reshape(3 * 2**9, 2**9)}
    save_hf(state, tmp_path / "hf", bucket_bytes=16 * 2**20)
    got = load_output(tmp_path / "hf")
    assert sorted(got) == ["big", "rows"]
    assert all(torch.equal(got[name], state[name]) for name in state)


def test_buckets_bound_what_a_rank_holds(tmp_path):
    from ckpttool.execute.distributed import Group
    from ckpttool.live.gather import Gather as _Gather
    from ckpttool.live.pieces import describe_held as _describe
    from ckpttool.live.pieces import plan_gather as _plan
    from ckpttool.writers.hf import assign_files

    state = reference_state()
    held, views, _ = _describe(state, {})
    plan = _plan([held], llama_config(), None, [])
    files = assign_files(plan, "100KB")
    for budget in (16 * 1024, 64 * 1024, 1 << 20):
        gather = _Gather(plan, files, [0] * len(files), Group(), views, budget)
        largest = max(t.nbytes for t in plan.targets)
        assert gather.arena_bytes <= max(budget // 2, largest) + 16 * len(plan.targets)
        written = [t.name for r in gather.rounds for b in r.values() for t in b]
        assert written == [t.name for f in files for t in f.targets]  # every tensor once, in file order


def test_non_tensor_entries_are_skipped_with_a_note(tmp_path):
    from ckpttool.live import save_hf

    state = {**reference_state(), "step": 12}
    result = save_hf(state, tmp_path / "hf", config=llama_config())
    assert "skipped 1 entries that are not tensors" in result.plan.notes


def test_a_piece_that_does_not_fit_its_spec(tmp_path):
    from ckpttool.errors import SourceError
    from ckpttool.live import save_hf
    from ckpttool.io.sidecar import PieceSpec

    state = reference_state()
    specs = {"model.embed_tokens.weight": PieceSpec((1001, 32), (900, 0))}
    with pytest.raises(SourceError, match=r"'model.embed_tokens.weight': the local tensor of shape \[1001, 32\] at "
                                          r"offsets \[900, 0\] does not fit the global shape \[1001, 32\]"):
        save_hf(state, tmp_path / "hf", config=llama_config(), specs=specs)
    assert not (tmp_path / "hf").exists()
    specs = {"model.norm.weight": PieceSpec((1, 32), (0, 0))}  # a 1-D tensor with a 2-D spec
    with pytest.raises(SourceError, match=r"'model.norm.weight': the local tensor of shape \[32\] at offsets \[0, 0\]"):
        save_hf(state, tmp_path / "hf", config=llama_config(), specs=specs)


def test_a_destination_that_is_not_empty(tmp_path):
    from ckpttool.errors import DestinationError
    from ckpttool.live import save_hf

    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "keep.txt").write_text("mine")
    with pytest.raises(DestinationError, match="exists and is not empty; pass force=True to replace it"):
        save_hf(reference_state(), tmp_path / "hf", config=llama_config())
    assert (tmp_path / "hf" / "keep.txt").read_text() == "mine"
    assert [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_a_config_of_the_wrong_model(tmp_path):
    from ckpttool.errors import ConfigError
    from ckpttool.live import save_hf

    config = {**llama_config(), "hidden_size": 64}
    with pytest.raises(ConfigError, match="does not match its llama config"):
        save_hf(reference_state(), tmp_path / "hf", config=config)
    assert not (tmp_path / "hf").exists()


def test_a_config_that_is_not_one(tmp_path):
    from ckpttool.errors import ConfigError
    from ckpttool.live import save_hf

    with pytest.raises(ConfigError, match="config: expected a transformers config or a dict, got int"):
        save_hf(reference_state(), tmp_path / "hf", config=3)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_tensors_on_one_gpu(tmp_path):
    from ckpttool.live import save_hf

    state = {k: v.cuda() for k, v in reference_state().items()}
    save_hf(state, tmp_path / "hf", config=llama_config(), max_shard_size="100KB", bucket_bytes=64 * 1024)
    assert_is_reference(tmp_path / "hf", LLAMA)
