"""HuggingFace ``.bin`` weights (``pytorch_model.bin``, or shards named by ``pytorch_model.bin.index.json``), as
transformers 4.57 ``save_pretrained(safe_serialization=False)`` writes them (``fixtures/make_hf_bin.py``): merged bit
for bit, audited and diffed like safetensors, read without running a pickle, with the same checks."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import assert_failed_cleanly, fixture_dir, load_output, tree_digest
from safetensors.torch import load_file

import ckpttool
from ckpttool.errors import SourceError, SourceNotFoundError, UnsafePickleError
from ckpttool.readers import detect_format, hf

WHOLE = ("hf_bin_llama", "hf_bin_mixtral")
SHARDED = ("hf_bin_llama_sharded", "hf_bin_llama_tied_sharded", "hf_bin_mixtral_sharded")
ALL = WHOLE + SHARDED
INPUT_IDS = torch.tensor([[1, 5, 9, 42, 77, 95, 0, 7]])
INDEX = "pytorch_model.bin.index.json"
SHARD2 = "pytorch_model-00002-of-00003.bin"


def checkpoint(name: str) -> Path:
    return fixture_dir(name) / "checkpoint"


def reference(name: str) -> Path:
    return fixture_dir(name) / "reference"


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    outs = {}
    for name in ALL:
        out = tmp_path_factory.mktemp(name) / "out"
        before = tree_digest(checkpoint(name))
        ckpttool.merge(checkpoint(name), out)
        assert tree_digest(checkpoint(name)) == before  # the source is never modified
        outs[name] = out
    return outs


def sharded_copy(tmp_path: Path, name: str = "hf_bin_llama_sharded") -> Path:
    src = tmp_path / name
    shutil.copytree(checkpoint(name), src)
    return src


def torch_save(path: Path, state: object) -> None:
    torch.save(state, path)  # the zip format save_pretrained writes


# ------------------------------------------------------------------------------------------------------------
# The real producer's files
# ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ALL)
def test_fixture_is_what_transformers_4_wrote(name):
    produced = json.loads((fixture_dir(name) / "producer.json").read_text())
    assert produced["versions"]["transformers"].startswith("4.57.")
    assert "safe_serialization=False" in produced["producer"]
    bins = sorted(p.name for p in checkpoint(name).glob("*.bin"))
    if name in WHOLE:
        assert bins == ["pytorch_model.bin"]
    else:
        assert len(bins) in (2, 3) and (checkpoint(name) / INDEX).is_file()
    assert detect_format(checkpoint(name)) == "hf"


@pytest.mark.parametrize("name", ALL)
def test_merge_is_bit_identical_to_transformers_safetensors(merged, name):
    got, want = load_output(merged[name]), load_output(reference(name))
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key
    # one file, the same tensors in the same order: the very bytes save_pretrained writes
    assert (merged[name] / "model.safetensors").read_bytes() == (reference(name) / "model.safetensors").read_bytes()


@pytest.mark.parametrize("name", ALL)
def test_output_loads_strictly_with_the_reference_logits(merged, name):
    from transformers import AutoModelForCausalLM

    ours, info = AutoModelForCausalLM.from_pretrained(merged[name], output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    theirs = AutoModelForCausalLM.from_pretrained(reference(name))
    with torch.no_grad():
        assert torch.equal(ours.eval()(INPUT_IDS).logits, theirs.eval()(INPUT_IDS).logits)  # tolerance 0


def test_pieces_point_at_the_tensor_bytes_inside_the_archive():
    """Each tensor is one raw piece at the byte offset of its storage record in the zip: read, it is the tensor."""
    src = checkpoint("hf_bin_mixtral_sharded")
    layout = ckpttool.read_layout(src)
    want = {}
    for path in src.glob("*.bin"):
        want.update(torch.load(path, weights_only=True))  # the test's own reading, never the tool's
    assert sorted(layout.tensors) == sorted(want)
    for name, tensor in layout.tensors.items():
        piece, = tensor.pieces
        assert piece.encoding == "raw" and piece.dtype == "BF16" and tensor.global_shape == tuple(want[name].shape)
        raw = (src / piece.file).read_bytes()[piece.byte_offset:piece.byte_offset + piece.byte_length]
        assert raw == want[name].contiguous().view(torch.uint8).numpy().tobytes(), name


def test_tied_head_shares_the_embedding_bytes_and_total_size_counts_them_once():
    layout = ckpttool.read_layout(checkpoint("hf_bin_llama_tied_sharded"))
    head, = layout.tensors["lm_head.weight"].pieces
    embed, = layout.tensors["model.embed_tokens.weight"].pieces
    assert (head.file, head.byte_offset, head.byte_length) == (embed.file, embed.byte_offset, embed.byte_length)
    report = ckpttool.audit(checkpoint("hf_bin_llama_tied_sharded"))
    assert [f.code for f in report.findings] == ["tied-copy"]  # and no index-total-size


@pytest.mark.parametrize("name", ALL)
def test_audit_passes_on_the_bin_source(cli, name):
    result = cli("audit", checkpoint(name), "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["summary"]["format"] == "hf" and report["summary"]["verdict"] == "pass"


@pytest.mark.parametrize("name", ALL)
def test_diff_says_bin_and_safetensors_are_equal(cli, name):
    result = cli("diff", checkpoint(name), reference(name), "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["equal"] is True and doc["differences"] == []


def test_whole_and_sharded_bin_diff_equal(cli):
    result = cli("diff", checkpoint("hf_bin_llama"), checkpoint("hf_bin_llama_sharded"))
    assert result.exit_code == 0, result.output


# ------------------------------------------------------------------------------------------------------------
# Both formats in one directory
# ------------------------------------------------------------------------------------------------------------
def test_safetensors_are_preferred_over_bin_as_transformers_does_and_the_note_says_so(cli, tmp_path):
    src = sharded_copy(tmp_path)
    shutil.copy(reference("hf_bin_llama_sharded") / "model.safetensors", src)
    (src / SHARD2).write_bytes(b"not read")  # proves the .bin files are left alone
    layout = ckpttool.read_layout(src)
    assert {p.file for t in layout.tensors.values() for p in t.pieces} == {"model.safetensors"}
    note, = layout.notes
    assert note == ("the directory holds both safetensors and .bin weights; read the safetensors, as transformers' "
                    "from_pretrained does, and left 'pytorch_model-00001-of-00003.bin', "
                    "'pytorch_model-00002-of-00003.bin', 'pytorch_model-00003-of-00003.bin' unread")
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert result.exit_code == 0, result.output
    assert "read the safetensors, as transformers' from_pretrained does" in result.output
    assert (out / "model.safetensors").read_bytes() == (src / "model.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------------------------
# Pickles are never run
# ------------------------------------------------------------------------------------------------------------
class _Touch:
    """What a malicious checkpoint pickles: unpickled, it runs ``os.system("touch MARKER")``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch '{self.marker}'",)


def _evil_shard(src: Path, marker: Path) -> None:
    """Replace shard 2 with one holding the same tensors and one more entry whose pickle would create ``marker``."""
    state = torch.load(src / SHARD2, weights_only=True)
    state["model.layers.1.mlp.down_proj.weight"] = _Touch(marker)
    torch_save(src / SHARD2, state)


def test_the_malicious_shard_really_runs_code_when_unpickled(tmp_path):
    """The payload is live: ``torch.load(weights_only=False)``, as older loaders called it, creates the marker (so
    the refusals below mean something)."""
    src, marker = sharded_copy(tmp_path), tmp_path / "MARKER"
    _evil_shard(src, marker)
    torch.load(src / SHARD2, weights_only=False)
    assert marker.exists()


def test_malicious_pickle_is_refused_naming_the_file_and_the_class(cli, tmp_path):
    src, marker = sharded_copy(tmp_path), tmp_path / "MARKER"
    _evil_shard(src, marker)
    before = tree_digest(src)
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out,
                          f"'{SHARD2}': refused to unpickle: it asks for 'posix.system', which is not a tensor",
                          "(nothing was executed)")
    assert not marker.exists()
    with pytest.raises(UnsafePickleError, match=r"'pytorch_model-00002-of-00003\.bin': refused to unpickle"):
        ckpttool.read_layout(src)
    result = cli("audit", src, "--json")  # every finding, then exit 3
    assert result.exit_code == 3, result.output
    invalid = [f for f in json.loads(result.stdout)["findings"] if f["code"] == "header-invalid"]
    assert [(f["file"], "'posix.system'" in f["message"]) for f in invalid] == [(SHARD2, True)]
    assert not marker.exists()
    assert tree_digest(src) == before


def test_malicious_single_file_is_refused(cli, tmp_path):
    src, marker = tmp_path / "whole", tmp_path / "MARKER"
    shutil.copytree(checkpoint("hf_bin_llama"), src)
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    torch_save(src / "pytorch_model.bin", {**state, "lm_head.weight": _Touch(marker)})
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "'pytorch_model.bin': refused to unpickle", "'posix.system'")
    assert not marker.exists()


# ------------------------------------------------------------------------------------------------------------
# The checks safetensors get
# ------------------------------------------------------------------------------------------------------------
def test_missing_shard_named_in_the_index_names_it(cli, tmp_path):
    src = sharded_copy(tmp_path)
    names = sorted(k for k, v in json.loads((src / INDEX).read_text())["weight_map"].items() if v == SHARD2)
    (src / SHARD2).unlink()
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out,
                          f"'{INDEX}' puts '{names[0]}' (and {len(names) - 1} more tensors) in '{SHARD2}', "
                          "which does not exist")
    with pytest.raises(SourceNotFoundError, match=SHARD2):
        ckpttool.read_layout(src)
    report = ckpttool.audit(src)
    assert [f.file for f in report.findings if f.code == "index-missing-file"] == [SHARD2]


def _edit_index(src: Path, edit) -> None:
    index = json.loads((src / INDEX).read_text())
    edit(index)
    (src / INDEX).write_text(json.dumps(index))


def test_index_entry_naming_a_tensor_the_file_lacks(cli, tmp_path):
    src = sharded_copy(tmp_path)
    _edit_index(src, lambda i: i["weight_map"].update({"model.norm.weight": "pytorch_model-00001-of-00003.bin"}))
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out,
                          f"'{INDEX}' puts 'model.norm.weight' in 'pytorch_model-00001-of-00003.bin', but that file has "
                          "no such tensor; it is in 'pytorch_model-00003-of-00003.bin'")


def test_index_naming_a_file_outside_the_directory(cli, tmp_path):
    src = sharded_copy(tmp_path)
    shutil.copy(src / SHARD2, tmp_path / "outside.bin")
    _edit_index(src, lambda i: i["weight_map"].update(
        {k: "../outside.bin" for k, v in list(i["weight_map"].items()) if v == SHARD2}))
    (src / SHARD2).unlink()
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert_failed_cleanly(result, out, "'../outside.bin'", INDEX)


def test_index_total_size_is_checked(tmp_path):
    src = sharded_copy(tmp_path)
    _edit_index(src, lambda i: i["metadata"].update({"total_size": 12345}))
    report = ckpttool.audit(src)
    assert [(f.code, f.message) for f in report.findings if f.code == "index-total-size"] == [
        ("index-total-size", f"'{INDEX}': metadata.total_size is 12345, but its tensors hold 31040 bytes")]


def test_stray_shard_is_flagged_but_not_the_trainer_files(tmp_path):
    src = sharded_copy(tmp_path)
    shutil.copy(src / SHARD2, src / "pytorch_model-00004-of-00003.bin")
    (src / "training_args.bin").write_bytes(b"a pickle of TrainingArguments, never read")
    report = ckpttool.audit(src)
    assert [f.file for f in report.findings if f.code == "file-unreferenced"] == ["pytorch_model-00004-of-00003.bin"]
    assert [f.file for f in report.findings if f.code == "tensor-duplicated"] == []  # the stray file is not read


def test_tensor_in_two_shards(tmp_path):
    src = sharded_copy(tmp_path)
    first = torch.load(src / "pytorch_model-00001-of-00003.bin", weights_only=True)
    second = torch.load(src / SHARD2, weights_only=True)
    torch_save(src / SHARD2, {**second, "model.embed_tokens.weight": first["model.embed_tokens.weight"]})
    report = ckpttool.audit(src, data=False)
    dup, = [f for f in report.findings if f.code == "tensor-duplicated"]
    assert dup.message == (f"'model.embed_tokens.weight' is stored in 'pytorch_model-00001-of-00003.bin' and '{SHARD2}'")


def test_wrong_shape_is_named_against_the_config(cli, tmp_path):
    src = tmp_path / "whole"
    shutil.copytree(checkpoint("hf_bin_llama"), src)
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    state["model.layers.0.self_attn.k_proj.weight"] = state["model.layers.0.self_attn.k_proj.weight"].t().contiguous()
    torch_save(src / "pytorch_model.bin", state)
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "'model.layers.0.self_attn.k_proj.weight'", "[16, 8]")


def test_other_dtype_is_found_by_the_audit(tmp_path):
    src = tmp_path / "whole"
    shutil.copytree(checkpoint("hf_bin_llama"), src)
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    state["model.norm.weight"] = state["model.norm.weight"].to(torch.float16)
    torch_save(src / "pytorch_model.bin", state)
    report = ckpttool.audit(src, data=False)
    assert ("dtype-mix", "model.norm.weight") in [(f.code, f.tensor) for f in report.findings]


@pytest.mark.parametrize(("state", "needle"), [
    (lambda s: {**s, "model.norm.weight": 3}, "'pytorch_model.bin': 'model.norm.weight' is a int, not a tensor"),
    (lambda s: list(s.values()), "'pytorch_model.bin': holds a list, not a state dict"),
    (lambda s: {**s, "model.norm.weight": torch.arange(64.0)[::4]},
     "'pytorch_model.bin': 'model.norm.weight' is not stored contiguously in place"),
])
def test_what_is_not_a_state_dict_of_tensors_is_refused(cli, tmp_path, state, needle):
    src = tmp_path / "whole"
    shutil.copytree(checkpoint("hf_bin_llama"), src)
    torch_save(src / "pytorch_model.bin", state(torch.load(src / "pytorch_model.bin", weights_only=True)))
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, needle)


def test_truncated_bin_is_refused(cli, tmp_path):
    src = tmp_path / "whole"
    shutil.copytree(checkpoint("hf_bin_llama"), src)
    data = (src / "pytorch_model.bin").read_bytes()
    (src / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out, "'pytorch_model.bin': cannot read it as a torch.save archive")
    with pytest.raises(SourceError):
        hf.read(src, None)


def test_detection_message_names_the_bin_files(cli, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", empty, out, "--format", "hf"), out,
                          "neither model.safetensors.index.json nor model.safetensors found "
                          "(nor pytorch_model.bin.index.json or pytorch_model.bin)")


def test_read_bin_gives_absolute_byte_ranges():
    from ckpttool.readers.hf_bin import read_bin

    path = checkpoint("hf_bin_llama") / "pytorch_model.bin"
    header = read_bin(path, "pytorch_model.bin")
    want = torch.load(path, weights_only=True)
    assert list(header.entries) == list(want)
    data = path.read_bytes()
    for key, entry in header.entries.items():
        assert entry.dtype == "F32" and entry.shape == tuple(want[key].shape)
        assert data[entry.begin:entry.end] == want[key].numpy().tobytes(), key
    assert load_file(reference("hf_bin_llama") / "model.safetensors").keys() == header.entries.keys()


def test_verify_against_a_bin_reference_merges_it_without_unpickling(merged, monkeypatch):
    """verify's reference may be .bin weights: ckpttool reads them (no pickle runs), transformers gets safetensors."""
    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called on the .bin reference")

    monkeypatch.setattr(torch, "load", refuse)
    result = ckpttool.verify(merged["hf_bin_mixtral_sharded"], against=checkpoint("hf_bin_mixtral_sharded"), tokens=8)
    assert result.ok, result.problems
    assert result.comparison is not None and result.comparison.max_abs == 0.0


def test_the_legacy_torch_save_format_is_named(cli, tmp_path):
    """torch < 1.6 wrote a pickle stream, not a zip (old hub models' pytorch_model.bin): refused with what it is."""
    src = tmp_path / "whole"
    shutil.copytree(checkpoint("hf_bin_llama"), src)
    state = torch.load(src / "pytorch_model.bin", weights_only=True)
    torch.save(state, src / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    out = tmp_path / "out"
    assert_failed_cleanly(cli("merge", src, out), out,
                          "'pytorch_model.bin': written in torch.save's legacy format (torch < 1.6, not a zip archive)")


# ------------------------------------------------------------------------------------------------------------
# Fuzzing what the pickles hold
# ------------------------------------------------------------------------------------------------------------
def _fuzz_values():
    from hypothesis import strategies as st

    from ckpttool.io.torch_save import StoredTensor

    ints = st.one_of(st.integers(-2, 70), st.sampled_from([2**31, 2**62, 2**63]))
    tensors = st.builds(StoredTensor, st.sampled_from(["F32", "BF16", "I64", "BOOL"]),
                        st.lists(ints, max_size=3).map(tuple), st.lists(ints, max_size=3).map(tuple),
                        st.sampled_from(["0", "1"]), ints, st.one_of(st.none(), st.integers(-8, 2**20)), ints)
    return st.one_of(st.none(), st.booleans(), st.integers(-3, 3), st.text(max_size=4), st.just({}),
                     st.lists(st.integers(), max_size=2), tensors)


def test_any_values_in_a_bin_state_dict_are_refused_or_read_never_a_crash():
    """A .bin pickle read with the allow-list can still hold any plain value where a tensor belongs, any key, any
    tensor shape, stride or offset: only a CkptError may come out of reading and planning."""
    from unittest import mock

    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    from conftest import HYPOTHESIS_EXAMPLES
    from ckpttool.readers import hf_bin
    from test_fuzz import only_ckpt_errors

    src = checkpoint("hf_bin_llama_sharded")
    real = hf_bin.scan
    mutation = st.tuples(st.integers(0, 2**16), st.one_of(st.none(), st.integers(-1, 2), st.text(max_size=3)),
                         _fuzz_values())

    @settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
    @given(st.lists(mutation, min_size=1, max_size=3))
    def run(mutations):
        def scan(f, *args, label, **kwargs):
            state = dict(real(f, *args, label=label, **kwargs))
            for where, key, value in mutations:
                names = list(state)
                old = names[where % len(names)] if names else None
                if key is not None and old is not None:
                    state[key] = state.pop(old)  # a key of another type, or another tensor's name
                elif old is not None:
                    state[old] = value
            return state

        with mock.patch.object(hf_bin, "scan", scan):
            only_ckpt_errors(lambda: ckpttool.prepare(src))

    run()


def test_verify_of_a_bin_directory_says_to_merge_it_first(cli):
    result = cli("verify", checkpoint("hf_bin_llama"))
    assert result.exit_code == 1, result.output
    assert "no safetensors weights" in result.stderr and "it holds .bin weights: merge it (ckpttool merge)" in result.stderr
