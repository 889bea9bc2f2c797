"""DCP written by older torch releases (``fixtures/make_torch_versions.py``: torch 2.6 and 2.10, each with a
transformers and accelerate of its time, on CPU/gloo) merges bit for bit, loads strictly with the producer's
logits, audits clean, and FSDP2 and TP layouts of one release diff equal. Every class their ``.metadata`` names is
on the allow-list with that release listed; an unknown one is refused by name, with the DCP version recorded."""

from __future__ import annotations

import json
import pickle
import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, fixture_dir, load_output, tree_digest

import ckpttool
from ckpttool.errors import UnsafePickleError
from ckpttool.io.safe_pickle import DCP_RELEASES, allowed_classes, load_metadata_pickle

NAMES = sorted(p.name for p in FIXTURES.glob("torch_v2_*") if (p / "checkpoint").is_dir())
RELEASES = sorted({name.split("_")[2] for name in NAMES}, key=int)
INPUT_IDS = torch.tensor([[1, 5, 17, 999, 1000, 42, 7, 3], [2, 640, 501, 500, 250, 251, 0, 9]])


def _release(name: str) -> str:
    """'torch_v2_6_llama_tp2_dcp' -> '2.6'."""
    return "2." + name.split("_")[2]


def _producer(name: str) -> dict:
    return json.loads((fixture_dir(name) / "producer.json").read_text())


@pytest.fixture(scope="module", params=NAMES)
def merged(request, tmp_path_factory) -> tuple[str, Path]:
    name = request.param
    out = tmp_path_factory.mktemp(name) / "hf"
    before = tree_digest(fixture_dir(name))
    ckpttool.merge(fixture_dir(name) / "checkpoint", out)
    assert tree_digest(fixture_dir(name)) == before, "the source was modified"
    return name, out


def test_the_matrix_holds_two_older_releases():
    assert len(RELEASES) >= 2, NAMES
    for minor in RELEASES:
        assert {f"torch_v2_{minor}_llama_fsdp2_dcp", f"torch_v2_{minor}_llama_tp2_dcp"} <= set(NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_each_fixture_was_written_by_the_torch_it_is_named_after(name):
    found = _producer(name)["versions"]
    assert found["torch"].startswith(_release(name) + "."), found
    assert found["transformers"].startswith("4."), found  # a transformers of that time, not today's 5.x
    assert "accelerate" in found


def test_merge_is_bit_identical_to_the_producers_reference(merged):
    name, out = merged
    got, want = load_output(out), load_output(fixture_dir(name) / "reference")
    assert sorted(got) == sorted(want)
    for key, tensor in want.items():
        assert got[key].dtype == tensor.dtype and torch.equal(got[key], tensor), f"{name}: {key} differs"


def test_output_loads_strictly_with_the_reference_logits(merged):
    from transformers import AutoModelForCausalLM

    name, out = merged
    ours, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir(name) / "reference")
    with torch.no_grad():
        assert torch.equal(ours.eval()(INPUT_IDS).logits, reference.eval()(INPUT_IDS).logits)


@pytest.mark.parametrize("name", NAMES)
def test_audit_passes(name):
    report = ckpttool.audit(fixture_dir(name) / "checkpoint", data=True)
    assert report.ok, [f.message for f in report.findings]


@pytest.mark.parametrize("minor", RELEASES)
def test_fsdp2_and_tp_layouts_of_one_release_diff_equal(cli, minor):
    fsdp2, tp = (fixture_dir(f"torch_v2_{minor}_{case}") / "checkpoint"
                 for case in ("llama_fsdp2_dcp", "llama_tp2_dcp"))
    assert ckpttool.diff(fsdp2, tp, config=fsdp2 / "config.json").equal
    result = cli("diff", fsdp2, tp, "--config", fsdp2 / "config.json")
    assert result.exit_code == 0, result.output


# ------------------------------------------------------------------------------------------- the allow-list


class _Anything:
    """Stands in for every class while the test lists the names a real .metadata asks for."""

    def __init__(self, *args, **kwargs) -> None:
        pass

    def __setstate__(self, state) -> None:
        pass


class _ListingUnpickler(pickle.Unpickler):
    """Lists the globals a pickle asks for; each loads as :class:`_Anything` (the fixtures are this project's own)."""

    asked: set[str]

    def find_class(self, module, name):
        self.asked.add(f"{module}.{name}")
        return _Anything


def _classes_asked_for(path: Path) -> set[str]:
    """The classes a .metadata names; torch dtypes are data (ckpttool reads them as names), not classes."""
    with path.open("rb") as f:
        unpickler = _ListingUnpickler(f)
        unpickler.asked = set()
        unpickler.load()
    return {n for n in unpickler.asked if not isinstance(getattr(torch, n.removeprefix("torch."), None), torch.dtype)}


#: torch 2.13's own DCP fixtures (fixtures/make_fixtures.py) and Megatron-Core's torch_dist on 2.13
TORCH_2_13 = {"llama_fsdp2_dcp": "checkpoint", "llama_tp2_dcp": "checkpoint", "mixtral_fsdp2_dcp": "checkpoint",
              "accelerate_fsdp2_llama": "checkpoint/optimizer_0", "megatron_tp2_pp2": "torch_dist/iter_0000010"}


def _metadata_files() -> list[tuple[str, Path]]:
    """(torch release, .metadata) for every fixture of the matrix."""
    return ([(_release(n), FIXTURES / n / "checkpoint" / ".metadata") for n in NAMES]
            + [("2.13", FIXTURES / n / folder / ".metadata") for n, folder in TORCH_2_13.items()])


@pytest.mark.parametrize(("release", "path"), _metadata_files())
def test_every_class_a_release_writes_is_listed_with_that_release(release, path):
    table = {cls: releases for cls, releases, _ in allowed_classes()}
    asked = _classes_asked_for(path)
    assert "torch.distributed.checkpoint.metadata.Metadata" in asked, path
    assert {cls for cls in asked if release not in table.get(cls, ())} == set(), path


def test_the_table_lists_a_release_only_for_the_classes_its_fixtures_name():
    seen: dict[str, set[str]] = {}
    for release, path in _metadata_files():
        seen.setdefault(release, set()).update(_classes_asked_for(path))
    assert sorted(seen, key=lambda r: int(r.split(".")[1])) == list(DCP_RELEASES)
    for release, classes in seen.items():
        assert {cls for cls, releases, _ in allowed_classes() if release in releases} == classes, release


def _with_unknown_class(tmp_path: Path, name: str) -> Path:
    """A copy of the fixture whose .metadata names '_StorageInfX' instead of '_StorageInfo' (same length: the
    pickle stays well formed), as a torch release with a class ckpttool has not seen would write it."""
    src = tmp_path / name
    shutil.copytree(fixture_dir(name) / "checkpoint", src)
    data = (src / ".metadata").read_bytes()
    assert data.count(b"_StorageInfo") == 1
    (src / ".metadata").write_bytes(data.replace(b"_StorageInfo", b"_StorageInfX"))
    return src


def test_an_unknown_class_is_refused_by_name_with_the_dcp_version_recorded(cli, tmp_path):
    src = _with_unknown_class(tmp_path, "llama_tp2_dcp")  # torch 2.13 records Metadata.version
    before, out = tree_digest(src), tmp_path / "out"
    assert_failed_cleanly(
        cli("merge", src, out), out,
        "'.metadata': refused to unpickle: it asks for 'torch.distributed.checkpoint.filesystem._StorageInfX', "
        "which is not on ckpttool's allow-list of metadata classes (nothing was executed); the metadata records "
        f"DCP format version '1.0.0'; ckpttool knows the classes that torch {DCP_RELEASES[0]} to "
        f"{DCP_RELEASES[-1]} write: is it from a newer torch?",
    )
    assert tree_digest(src) == before


def test_torch_2_6_records_no_dcp_version_so_the_refusal_names_the_class_alone(tmp_path):
    """torch 2.6's Metadata has no version field (2.13's says '1.0.0'): nothing is guessed about the writer."""
    src = _with_unknown_class(tmp_path, "torch_v2_6_llama_tp2_dcp")
    with pytest.raises(UnsafePickleError) as refused:
        load_metadata_pickle((src / ".metadata").read_bytes(), ".metadata")
    assert str(refused.value) == (
        "'.metadata': refused to unpickle: it asks for 'torch.distributed.checkpoint.filesystem._StorageInfX', which "
        "is not on ckpttool's allow-list of metadata classes (nothing was executed)"
    )


# --------------------------------------------------------------- transformers 4 configs (torch_dtype, rope 'type')

ROPE = "hf_tf4_llama_rope_linear"


def test_dcp_of_an_older_release_verifies_against_its_reference(merged):
    """The config is transformers 4's (4.51 writes torch_dtype, 4.56+ dtype): verify loads both sides and compares
    logits."""
    name, out = merged
    config = json.loads((out / "config.json").read_text())
    old = tuple(int(v) for v in _producer(name)["versions"]["transformers"].split(".")[:2]) < (4, 56)
    assert config["torch_dtype" if old else "dtype"] == "float32" and ("dtype" in config) != old
    result = ckpttool.verify(out, against=fixture_dir(name) / "reference")
    assert result.ok, result.problems


@pytest.fixture(params=["as written", "type only"])
def rope_source(request, tmp_path) -> Path:
    """transformers 4.51's checkpoint, and a copy whose rope_scaling has only 'type', as 4.42 and older wrote it."""
    src = tmp_path / "checkpoint"
    shutil.copytree(fixture_dir(ROPE) / "checkpoint", src)
    if request.param == "type only":
        config = json.loads((src / "config.json").read_text())
        del config["rope_scaling"]["rope_type"]
        (src / "config.json").write_text(json.dumps(config))
    return src


def test_the_rope_fixture_is_transformers_4s_own():
    assert _producer(ROPE)["versions"]["transformers"].startswith("4.5")
    config = json.loads((fixture_dir(ROPE) / "checkpoint" / "config.json").read_text())
    assert config["torch_dtype"] == "float32" and "dtype" not in config
    assert config["rope_scaling"] == {"type": "linear", "rope_type": "linear", "factor": 2.0}


def test_a_transformers_4_config_merges_audits_and_verifies(rope_source, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "out"
    before = tree_digest(rope_source)
    ckpttool.merge(rope_source, out)
    assert tree_digest(rope_source) == before
    got, want = load_output(out), load_output(fixture_dir(ROPE) / "reference")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert json.loads((out / "config.json").read_text())["rope_scaling"]["type"] == "linear"
    assert ckpttool.audit(rope_source, data=True).ok
    assert ckpttool.audit(out, data=True).ok
    result = ckpttool.verify(out, against=fixture_dir(ROPE) / "reference")
    assert result.ok, result.problems
    # the scaling is read, not dropped: without it the same weights give other logits
    ours = AutoModelForCausalLM.from_pretrained(out).eval()
    unscaled = json.loads((out / "config.json").read_text())
    del unscaled["rope_scaling"]
    (out / "config.json").write_text(json.dumps(unscaled))
    plain = AutoModelForCausalLM.from_pretrained(out).eval()
    ids = torch.arange(1, 33).reshape(1, 32) % 96
    with torch.no_grad():
        assert not torch.equal(ours(ids).logits, plain(ids).logits)


# ------------------------------------------------ accelerate save_state with FULL_STATE_DICT: the model whole

FULL = "hf_accelerate_fsdp2_full"


def test_a_full_state_dict_save_state_merges_the_whole_model_file_alone(cli, tmp_path):
    """accelerate 1.15's save_state with FSDP2 FULL_STATE_DICT: pytorch_model_fsdp.bin beside optimizer.bin and
    the RNG pickles, both made unreadable in a copy: merged bit for bit with a note, neither is opened."""
    from transformers import AutoModelForCausalLM

    assert "FULL_STATE_DICT" in _producer(FULL)["producer"]
    src = tmp_path / "checkpoint"
    shutil.copytree(fixture_dir(FULL) / "checkpoint", src)
    assert ckpttool.detect_format(src) == "hf"
    for path in [src / "optimizer.bin", *src.glob("random_states_*.pkl")]:
        path.write_bytes(b"\x80\x04 not a pickle: reading this fails")
        path.chmod(0)
    out = tmp_path / "out"
    result = cli("merge", src, out)
    assert result.exit_code == 0, result.output
    assert (f"note: merged 'pytorch_model_fsdp.bin', the whole model (FULL_STATE_DICT) of accelerate's save_state "
            f"folder '{src}' (optimizer.bin and the RNG/scheduler pickles are not read)") in result.output
    got, want = load_output(out), load_output(fixture_dir(FULL) / "reference")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    ours, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info.values()), info
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir(FULL) / "reference")
    with torch.no_grad():
        assert torch.equal(ours.eval()(INPUT_IDS).logits, reference.eval()(INPUT_IDS).logits)
    assert ckpttool.audit(src, data=True).ok


def test_two_whole_models_are_refused_naming_both(cli, tmp_path):
    src = tmp_path / "checkpoint"
    shutil.copytree(fixture_dir(FULL) / "checkpoint", src)
    shutil.copy(src / "pytorch_model_fsdp.bin", src / "pytorch_model_fsdp_1.bin")
    before, out = tree_digest(src), tmp_path / "out"
    assert_failed_cleanly(
        cli("merge", src, out), out,
        f"'{src}': accelerate's save_state folder holds 2 whole models; move the one to merge into a folder of its "
        "own (with config.json) as pytorch_model.bin:",
        f"  - '{src / 'pytorch_model_fsdp.bin'}'", f"  - '{src / 'pytorch_model_fsdp_1.bin'}'",
    )
    assert tree_digest(src) == before


def test_a_save_state_without_fsdp_merges_its_model_safetensors_alone(tmp_path):
    """accelerate 1.15's save_state without FSDP writes model.safetensors beside optimizer.bin and the RNG pickles;
    both made unreadable in a copy, the merge reads the model alone, bit for bit."""
    plain = "hf_accelerate_plain"
    assert "no FSDP" in _producer(plain)["producer"]
    src = tmp_path / "checkpoint"
    shutil.copytree(fixture_dir(plain) / "checkpoint", src)
    for path in [src / "optimizer.bin", *src.glob("random_states_*.pkl")]:
        path.write_bytes(b"\x80\x04 not a pickle: reading this fails")
        path.chmod(0)
    ckpttool.merge(src, tmp_path / "out")
    got, want = load_output(tmp_path / "out"), load_output(fixture_dir(plain) / "reference")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert ckpttool.audit(src, data=True).ok
