"""FSDP/verl per-rank DTensor files (``model_world_size_W_rank_R.pt``): fixtures written by torch FSDP2 and
DTensor TP on gloo (``fixtures/make_verl.py``) merge to the producer's ``full_tensor()`` weights bit for bit."""

from __future__ import annotations

import io
import json
import shutil
import zipfile
from pathlib import Path

import pytest
import torch
from conftest import (
    HYPOTHESIS_EXAMPLES,
    assert_failed_cleanly,
    fixture_dir,
    load_output,
    tree_digest,
)
from hypothesis import given, settings
from hypothesis import strategies as st

import ckpttool
from ckpttool.readers import detect_format
from ckpttool.readers.verl import reader as verl
from ckpttool.layout.placements import Placement, local_ranges
from ckpttool.readers.verl.entries import _mesh
from ckpttool.io.safe_pickle import Record
from ckpttool.io.torch_save import StoredTensor

MODELS = ("verl_llama_fsdp4", "verl_llama_dp2_tp2")
INPUT_IDS = torch.tensor([[1, 5, 9, 42, 100, 999, 1000, 7]])


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    outs = {}
    for name in (*MODELS, "verl_dtensor_strided"):
        out = tmp_path_factory.mktemp(name) / "out"
        src = fixture_dir(name) / "checkpoint"
        before = tree_digest(src)
        ckpttool.merge(src, out)  # the config is found in huggingface/, where verl writes it
        assert tree_digest(src) == before
        outs[name] = out
    return outs


@pytest.mark.parametrize("name", (*MODELS, "verl_dtensor_strided"))
def test_merge_is_bit_identical_to_full_tensor(merged, name):
    got, want = load_output(merged[name]), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


@pytest.mark.parametrize("name", MODELS)
def test_output_loads_with_the_reference_logits(merged, name):
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(merged[name]).eval()
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir(name) / "reference").eval()
    with torch.no_grad():
        assert torch.equal(ours(INPUT_IDS).logits, reference(INPUT_IDS).logits)  # tolerance 0: identical


def test_detected_and_dry_run_shows_format_parallel_and_mapping(cli, tmp_path):
    src = fixture_dir("verl_llama_dp2_tp2") / "checkpoint"
    assert detect_format(src) == "verl"
    result = cli("merge", src, tmp_path / "out", "--dry-run")
    assert result.exit_code == 0, result.output
    assert "(verl)" in result.stdout
    assert "parallel: dp=2 tp=2" in result.stdout
    assert "model.embed_tokens.weight  F32 [1001x32]  <- model.embed_tokens.weight (4 pieces)" in result.stdout
    assert "skipped 8 optimizer/extra-state files" in result.stdout
    assert not (tmp_path / "out").exists()
    one_d = cli("merge", fixture_dir("verl_llama_fsdp4") / "checkpoint", tmp_path / "o", "--dry-run")
    assert "parallel: fsdp=4" in one_d.stdout


def test_strided_shard_ranks_hold_non_adjacent_ranges_read_as_separate_pieces():
    layout = ckpttool.read_layout(fixture_dir("verl_dtensor_strided") / "checkpoint")
    rows = layout.tensors["strided_rows"]  # [8, 3], (_StridedShard(0, sf=2), Replicate()): dp0 rows 0-1 and 4-5
    assert sorted((p.box.offsets, p.box.sizes, p.file) for p in rows.pieces) == [
        ((0, 0), (2, 3), "model_world_size_4_rank_0.pt"), ((2, 0), (2, 3), "model_world_size_4_rank_2.pt"),
        ((4, 0), (2, 3), "model_world_size_4_rank_0.pt"), ((6, 0), (2, 3), "model_world_size_4_rank_2.pt")]
    second = next(p for p in rows.pieces if p.box.offsets == (4, 0))
    first = next(p for p in rows.pieces if p.box.offsets == (0, 0))
    assert second.byte_offset == first.byte_offset + 2 * 3 * 4  # rows 2..4 of the local tensor, in place
    cols = layout.tensors["strided_cols"]  # column ranges of a [3, 4] local tensor: one piece per row and range
    assert len(cols.pieces) == 12 and all(p.box.sizes == (1, 2) for p in cols.pieces)


def test_uneven_fsdp2_over_tp_matches_what_torch_recorded():
    """The producer checked each rank's local tensor against full_tensor() at these ranges; keep them."""
    described = json.loads((fixture_dir("verl_llama_dp2_tp2") / "producer.json").read_text())
    embed = {r: d["model.embed_tokens.weight"] for r, d in described["ranks"].items()}
    assert embed["0"]["placements"] == ["_S(0, 2)", "S(0)"]
    assert {r: e["ranges"][0] for r, e in embed.items()} == {
        "0": [[0, 251]], "1": [[501, 751]], "2": [[251, 501]], "3": [[751, 1001]]}
    for rank, tensors in described["ranks"].items():
        coord = (int(rank) // 2, int(rank) % 2)
        for key, d in tensors.items():
            placements = [_parse(p) for p in d["placements"]]
            mesh = (2, 2) if len(placements) == 2 else (2,)
            c = coord if len(placements) == 2 else coord[:1]
            got = local_ranges(d["global_shape"], mesh, c, placements)
            assert [[list(r) for r in dim] for dim in got] == d["ranges"], (rank, key)


def _parse(text: str) -> Placement:
    if text == "R":
        return Placement("replicate")
    if text.startswith("_S("):
        d, sf = text[3:-1].split(", ")
        return Placement("strided", int(d), int(sf))
    return Placement("shard", int(text[2:-1]))


@settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None)
@given(n=st.integers(0, 40), dp=st.integers(1, 4), tp=st.integers(1, 4), strided=st.booleans())
def test_every_rank_region_tiles_the_tensor_exactly_once(n, dp, tp, strided):
    first = Placement("strided", 0, tp) if strided else Placement("shard", 0)
    seen = []
    for i in range(dp):
        for j in range(tp):
            for a, b in local_ranges([n, 3], [dp, tp], [i, j], [first, Placement("shard", 0)])[0]:
                seen.extend(range(a, b))
    assert sorted(seen) == list(range(n))


def test_torch_chunk_semantics_last_chunk_smaller_trailing_empty():
    assert [local_ranges([3], [4], [c], [Placement("shard", 0)])[0] for c in range(4)] == [
        [(0, 1)], [(1, 2)], [(2, 3)], [(0, 0)]]
    assert [local_ranges([1001], [4], [c], [Placement("shard", 0)])[0] for c in range(4)] == [
        [(0, 251)], [(251, 502)], [(502, 753)], [(753, 1001)]]


# ------------------------------------------------------------------------------------------------------------
# Bad inputs
# ------------------------------------------------------------------------------------------------------------
def test_missing_rank_file_names_the_file_and_region(cli, copy_fixture, tmp_path):
    src = copy_fixture("verl_llama_fsdp4")
    (src / "model_world_size_4_rank_2.pt").unlink()
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'model.embed_tokens.weight': rows 502..753 covered by no piece",
                          "'model_world_size_4_rank_2.pt', which is missing")


def test_files_of_two_world_sizes(cli, copy_fixture, tmp_path):
    src = copy_fixture("verl_llama_fsdp4")
    shutil.copy(src / "model_world_size_4_rank_0.pt", src / "model_world_size_2_rank_0.pt")
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "rank files of different world sizes: 2 (1 files",
                          "4 (4 files", "expected one world size")


def test_world_size_in_names_disagrees_with_the_mesh(cli, copy_fixture, tmp_path):
    src = copy_fixture("verl_llama_fsdp4")
    (src / "fsdp_config.json").unlink()  # only the device mesh in the files can tell then
    for r in range(4):
        (src / f"model_world_size_4_rank_{r}.pt").rename(src / f"model_world_size_8_rank_{r}.pt")
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "the file names give a world of 8 ranks",
                          "hold 4 ranks ([0, 1, 2, 3]); expected 8")


def test_renamed_rank_file_is_caught_by_the_mesh_coordinate(cli, copy_fixture, tmp_path):
    src = copy_fixture("verl_llama_fsdp4")
    a, b = src / "model_world_size_4_rank_1.pt", src / "model_world_size_4_rank_2.pt"
    a.rename(src / "tmp.pt")
    b.rename(a)
    (src / "tmp.pt").rename(b)
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "'model_world_size_4_rank_1.pt'", "rank 1 sits at [1]",
                          "records coordinate [2]")


def _edit_pickle(path: Path, old: bytes, new: bytes) -> None:
    """Rewrite a torch.save archive with ``old`` replaced by ``new`` in its pickle (same zip entries)."""
    with zipfile.ZipFile(path) as z:
        entries = [(i, z.read(i)) for i in z.infolist()]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        for info, data in entries:
            if info.filename.endswith("data.pkl"):
                assert old in data
                data = data.replace(old, new)
            z.writestr(info, data)
    path.write_bytes(buf.getvalue())


def test_ranks_disagreeing_on_the_global_shape(cli, copy_fixture, tmp_path):
    src = copy_fixture("verl_llama_fsdp4")
    # the global (1001, 32) of embed_tokens and lm_head in rank 1's pickle (wrapper size and tensor_meta)
    _edit_pickle(src / "model_world_size_4_rank_1.pt", b"M\xe9\x03K \x86", b"M\xea\x03K \x86")
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "'model.embed_tokens.weight': pieces disagree on the global shape: "
                          "[1001, 32] in 'model_world_size_4_rank_0.pt' but [1002, 32] in 'model_world_size_4_rank_1.pt'")


def test_unknown_classes_in_a_rank_file_are_refused_unrun(cli, copy_fixture, tmp_path):
    src = copy_fixture("verl_llama_fsdp4")
    _edit_pickle(src / "model_world_size_4_rank_0.pt", b"torch.distributed.device_mesh\nDeviceMesh",
                 b"os\nsystem" + b" " * (len("torch.distributed.device_mesh\nDeviceMesh") - len("os\nsystem")))
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert result.exit_code == 1 and "refused to unpickle" in result.stderr and "Traceback" not in result.output
    assert not out.exists()


def test_not_detected_on_other_formats():
    assert not verl.matches(fixture_dir("llama_fsdp2_dcp") / "checkpoint")
    assert not verl.matches(fixture_dir("colossalai_llama_pp2_bin") / "checkpoint")


def _ints(values: list[int]) -> tuple[io.BytesIO, StoredTensor]:
    data = b"".join(v.to_bytes(4, "little", signed=True) for v in values)
    return io.BytesIO(data), StoredTensor("I32", (len(values),), (1,), "0", 0, 0, len(values))


def test_sub_mesh_is_the_cell_of_the_root_rank_map_holding_the_rank():
    f, rank_map = _ints([0, 1, 2, 3])
    axis = Record(shape=(2,), stride=(2,))  # mesh["dp"] of a (dp=2, tp=2) mesh
    raw = Record(_rank_map=rank_map, _layout=Record(axes=(axis,)), _mesh_dim_names=("dp",))
    mesh = _mesh(raw, 3, f, "x.pt")
    assert (mesh.shape, mesh.ranks, mesh.names, mesh.coordinate(3)) == ((2,), (1, 3), ("dp",), (1,))
    assert _mesh(raw, 2, f, "x.pt").ranks == (0, 2)


def test_mesh_pickled_as_its_rank_tensor_by_older_torch():
    f, ranks = _ints([0, 1, 2, 3])
    ranks = StoredTensor("I32", (2, 2), (2, 1), "0", 0, 0, 4)
    mesh = _mesh(Record(mesh=ranks, mesh_dim_names=("dp", "tp")), 2, f, "x.pt")
    assert (mesh.shape, mesh.coordinate(2), mesh.coordinate(1)) == ((2, 2), (1, 0), (0, 1))


def test_fsdp_config_world_size_disagreeing_with_the_file_names(cli, copy_fixture, tmp_path):
    src = copy_fixture("verl_llama_fsdp4")
    (src / "fsdp_config.json").write_text(json.dumps({"FSDP_version": 2, "world_size": 8}))
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "'fsdp_config.json' records world_size 8",
                          "expected 8, found 4")


def test_tensor_missing_from_one_rank_file(cli, copy_fixture, tmp_path):
    src = copy_fixture("verl_llama_fsdp4")
    _edit_pickle(src / "model_world_size_4_rank_2.pt", b"model.norm.weight", b"model.norx.weight")
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "'model.norm.weight' is in 3 of 4 rank files but not in "
                          "'model_world_size_4_rank_2.pt' (rank 2, expected to hold elements 16..24)")
