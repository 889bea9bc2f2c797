"""``split --dp``: data-parallel replicas, as FSDP2's HSDP holds them (``Replicate()`` on an outer mesh dim).

The proof is torch on 4 gloo ranks (``tests/hsdp_worker.py``): for HSDP dp=2 x fsdp=2 and for HSDP over tensor
parallel (dp=2 x fsdp=1 x tp=2, a 3-D mesh), torch's own ``dcp.save`` of the parallelized reference model and
ckpttool's split of the reference give the same ``.metadata`` (every chunk, file, offset, length: which rank
writes each replicated chunk, as ``dedup_save_plans`` picks it) and the same bytes but for ``torch.save``'s
random serialization id; and the split, loaded with ``dcp.load`` into the HSDP model, gives the HuggingFace logits.
Then the round trip, the dry run, and the errors with their messages.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from test_split import LLAMA, MIXTRAL, chunks, storage
from test_split_archive import masked
from test_split_torch import ROUNDING, launch, results
from torch.distributed.checkpoint import FileSystemReader

import ckpttool
from ckpttool.errors import ArgumentError
from conftest import assert_failed_cleanly, load_output

HSDP_WORKER = Path(__file__).resolve().parent / "hsdp_worker.py"
MESHES = {"hsdp": dict(dp=2, fsdp=2), "hsdp_tp": dict(dp=2, fsdp=1, tp=2)}


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    splits = tmp_path_factory.mktemp("hsdp")
    for name, mesh in MESHES.items():
        ckpttool.split(LLAMA, splits / name, **mesh)
    return splits, results(launch(4, splits, worker=HSDP_WORKER)[0])


@pytest.mark.parametrize("name", MESHES)
def test_split_writes_what_torch_saved_for_the_same_hsdp_mesh(four, name):
    ours_dir, torch_dir = four[0] / name, four[0] / f"torch_{name}"
    ours, theirs = FileSystemReader(ours_dir).read_metadata(), FileSystemReader(torch_dir).read_metadata()
    assert list(ours.state_dict_metadata) == list(theirs.state_dict_metadata)
    assert chunks(ours) == chunks(theirs)  # every chunk once, though dp=2 replicas hold it
    for key, md in theirs.state_dict_metadata.items():
        assert (ours.state_dict_metadata[key].size, ours.state_dict_metadata[key].properties) == (md.size, md.properties)
    assert storage(ours) == storage(theirs)  # the same rank writes each replicated chunk, at the same offset
    assert ours.planner_data == theirs.planner_data
    assert sorted(p.name for p in ours_dir.glob("*.distcp")) == sorted(p.name for p in torch_dir.glob("*.distcp"))
    for (key, _), (file, offset, length, _) in storage(theirs).items():
        assert (ours_dir / file).stat().st_size == (torch_dir / file).stat().st_size
        with open(ours_dir / file, "rb") as a, open(torch_dir / file, "rb") as b:
            a.seek(offset), b.seek(offset)
            assert masked(a.read(length)) == masked(b.read(length)), key


def test_hsdp_loads_the_split_and_computes_the_reference_logits(four):
    assert four[1]["hsdp"] == 0.0  # FSDP2 computes exactly the reference's logits
    assert four[1]["hsdp_tp"] < ROUNDING  # tensor parallel: float32 rounding


def test_dp_replicas_change_only_which_rank_writes(tmp_path):
    one = ckpttool.split(LLAMA, tmp_path / "one", fsdp=2, tp=2)
    two = ckpttool.split(LLAMA, tmp_path / "two", dp=2, fsdp=2, tp=2)
    assert len(two.files) == 8 and two.mesh.world == 8
    held = [{k: sorted(v) for k, v in chunks(FileSystemReader(tmp_path / d).read_metadata()).items()} for d in ("one", "two")]
    assert held[0] == held[1]  # the same chunks, each once
    assert two.nbytes == one.nbytes  # each chunk written once
    ckpttool.merge(tmp_path / "two", tmp_path / "hf")
    got, want = load_output(tmp_path / "hf"), load_output(LLAMA)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())


def test_dry_run_shows_the_hsdp_mesh(cli):
    result = cli("split", LLAMA, "--to", "dcp", "--dp", "2", "--fsdp", "2", "--tp", "2", "--dry-run")
    assert result.exit_code == 0, result.output
    out = result.stdout
    assert "mesh:     dp=2 fsdp=2 tp=2 (8 ranks; HSDP: Replicate() over dp, each chunk saved once)" in out
    assert ("  model.embed_tokens.weight  [1001x32]  (Replicate(), _StridedShard(0, sf=2), Shard(0)) over dp=2 x fsdp=2 "
            "x tp=2  local 251x32, 250x32 x3, 251x32, 250x32 x3") in out
    assert "__7_0.distcp" in out
    doc = json.loads(cli("split", LLAMA, "--to", "dcp", "--dp", "2", "--dry-run", "--json").stdout)
    assert doc["mesh"] == {"dp": 2, "fsdp": 1, "tp": 1, "ep": 1, "world": 2}
    assert [f["name"] for f in doc["files"]] == ["__0_0.distcp", "__1_0.distcp"]


def test_dp_for_megatron_is_refused(cli, tmp_path):
    result = cli("split", LLAMA, tmp_path / "out", "--to", "megatron", "--tp", "2", "--dp", "2")
    # a usage error (exit 2), as README's split section has it, refused before the source is read
    assert result.exit_code == 2 and "Traceback" not in result.output and not (tmp_path / "out").exists()
    for needle in ("Error: dp=2: a Megatron-Core torch_dist checkpoint does not depend on the data-parallel size",
                   "a Megatron load at any dp reads it; split without dp"):
        assert needle in result.stderr


def test_dp_errors(cli, tmp_path):
    with pytest.raises(ArgumentError, match=r"^dp=0: a mesh dim is a whole number of ranks, 1 or more$"):
        ckpttool.split(LLAMA, tmp_path / "out", dp=0)
    assert cli("split", LLAMA, tmp_path / "out", "--to", "dcp", "--dp", "0").exit_code == 2
    # experts are split within one replica of fsdp x tp ranks, not over the dp replicas
    result = cli("split", MIXTRAL, tmp_path / "out", "--to", "dcp", "--dp", "2", "--ep", "2")
    assert_failed_cleanly(result, tmp_path / "out", "Error: ep=2 does not divide the 1 rank of fsdp=1 x tp=1")


def test_experts_over_ep_in_each_replica_round_trip(tmp_path):
    result = ckpttool.split(MIXTRAL, tmp_path / "dcp", dp=2, fsdp=2, ep=2)
    experts = next(s for s in result.tensors if s.name.endswith("mlp.experts.gate_up_proj"))
    assert experts.describe() == "(Replicate(), Shard(0)) over dp=2 x ep=2"
    ckpttool.merge(tmp_path / "dcp", tmp_path / "hf")
    got, want = load_output(tmp_path / "hf"), load_output(MIXTRAL)
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
