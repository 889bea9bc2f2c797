"""accelerate 1.15 itself, run on this CPU (``fixtures/make_accelerate.py``): ``Accelerator.save_state`` with FSDP2
and ``SHARDED_STATE_DICT`` writes a folder holding ``pytorch_model_fsdp_0/`` (the model, DCP), ``optimizer_0/``
(DCP too) and RNG pickles. Given that folder, ckpttool merges the model folder bit for bit, says so in a note, never
reads the optimizer folder nor opens a pickle, and refuses a folder of several models naming each."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_failed_cleanly, fixture_dir, load_output, tree_digest

import ckpttool

NAME = "accelerate_fsdp2_llama"
INPUT_IDS = torch.tensor([[1, 5, 9, 42, 100, 999, 1000, 7]])

#: paths opened while a test listens (an audit hook cannot be removed: it records only while ``_OPENED`` is a list)
_OPENED: list[str] | None = None


def _record_open(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and isinstance(args[0], (str, Path)):
        _OPENED.append(str(args[0]))


sys.addaudithook(_record_open)


@pytest.fixture(scope="module")
def merged(tmp_path_factory):
    out = tmp_path_factory.mktemp("accelerate") / "out"
    src = fixture_dir(NAME) / "checkpoint"
    before = tree_digest(src)
    result = ckpttool.merge(src, out)
    assert tree_digest(src) == before
    return result, out


def test_the_producer_was_accelerate_itself():
    producer = json.loads((fixture_dir(NAME) / "producer.json").read_text())
    assert producer["versions"]["accelerate"] == "1.15.0"
    src = fixture_dir(NAME) / "checkpoint"
    assert (src / "pytorch_model_fsdp_0" / ".metadata").is_file() and (src / "optimizer_0" / ".metadata").is_file()
    assert list(src.glob("random_states_*.pkl"))


def test_merge_is_bit_identical_to_the_full_model(merged):
    got, want = load_output(merged[1]), load_output(fixture_dir(NAME) / "reference")
    assert sorted(got) == sorted(want)
    for key in want:
        assert got[key].dtype == want[key].dtype and torch.equal(got[key], want[key]), key


def test_output_loads_strictly_with_the_reference_logits(merged):
    from transformers import AutoModelForCausalLM

    ours, info = AutoModelForCausalLM.from_pretrained(merged[1], output_loading_info=True)
    assert not any(info.values()), info
    reference = AutoModelForCausalLM.from_pretrained(fixture_dir(NAME) / "reference")
    with torch.no_grad():
        assert torch.equal(ours.eval()(INPUT_IDS).logits, reference.eval()(INPUT_IDS).logits)


def test_the_note_names_the_model_folder(merged, cli, tmp_path):
    src = fixture_dir(NAME) / "checkpoint"
    note = (f"merged 'pytorch_model_fsdp_0/', the model of accelerate's save_state folder '{src}' (the optimizer "
            "folder and the RNG/scheduler pickles are not read)")
    assert note in merged[0].plan.notes
    result = cli("merge", src, tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert f"note: {note}" in result.output


def test_the_folder_is_dcp_and_the_audit_passes():
    src = fixture_dir(NAME) / "checkpoint"
    assert ckpttool.detect_format(src) == "dcp"
    report = ckpttool.audit(src, data=False)
    assert report.ok, [f.message for f in report.findings]


def test_the_optimizer_folder_and_the_pickles_are_never_read(tmp_path):
    """Both are made garbage in a copy, and every file opened during the merge is recorded: none of theirs."""
    global _OPENED
    src = tmp_path / "checkpoint"
    shutil.copytree(fixture_dir(NAME) / "checkpoint", src)
    for path in [*(src / "optimizer_0").iterdir(), *src.glob("random_states_*.pkl")]:
        path.write_bytes(b"\x80\x04 not a pickle, not DCP: reading this fails")
        path.chmod(0)
    _OPENED = []
    try:
        ckpttool.merge(src, tmp_path / "out")
        opened = _OPENED
    finally:
        _OPENED = None
    assert any("pytorch_model_fsdp_0" in p for p in opened)
    assert not [p for p in opened if "optimizer_0" in p or p.endswith(".pkl")]
    assert len(load_output(tmp_path / "out")) == 21


def test_two_model_folders_are_refused_naming_both(cli, tmp_path):
    src = tmp_path / "checkpoint"
    shutil.copytree(fixture_dir(NAME) / "checkpoint", src)
    shutil.copytree(src / "pytorch_model_fsdp_0", src / "pytorch_model_fsdp_1")
    before = tree_digest(src)
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(
        result, tmp_path / "out",
        f"'{src}': accelerate's save_state folder holds 2 models; give the one to merge as the source:",
        f"  - '{src / 'pytorch_model_fsdp_0'}'", f"  - '{src / 'pytorch_model_fsdp_1'}'",
    )
    assert "optimizer_0" not in result.output
    assert tree_digest(src) == before


def test_the_optimizer_folder_is_never_offered_as_a_model(cli, tmp_path):
    """Without its model folder, the save_state folder's optimizer is not suggested as the checkpoint below."""
    src = tmp_path / "checkpoint"
    shutil.copytree(fixture_dir(NAME) / "checkpoint", src, ignore=shutil.ignore_patterns("pytorch_model_fsdp_0"))
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"'{src}': no checkpoint format recognised")
    assert "optimizer_0" not in result.output


def test_the_run_folder_above_offers_the_save_state_folder_not_the_optimizer(cli, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(fixture_dir(NAME) / "checkpoint", run / "step_1")
    result = cli("merge", run, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"'{run}': no checkpoint here, but this subfolder holds one",
                          f"  - '{run / 'step_1'}' (dcp)")
    assert "optimizer_0" not in result.output


def test_a_model_folder_linked_out_of_the_source_is_refused(cli, tmp_path):
    src = tmp_path / "checkpoint"
    shutil.copytree(fixture_dir(NAME) / "checkpoint", src, ignore=shutil.ignore_patterns("pytorch_model_fsdp_0"))
    shutil.copytree(fixture_dir(NAME) / "checkpoint" / "pytorch_model_fsdp_0", tmp_path / "elsewhere")
    (src / "pytorch_model_fsdp_0").symlink_to(tmp_path / "elsewhere")
    result = cli("merge", src, tmp_path / "out")
    assert_failed_cleanly(result, tmp_path / "out", f"'pytorch_model_fsdp_0' is a symlink to '{tmp_path / 'elsewhere'}', "
                          f"outside the checkpoint '{src}'; ckpttool follows no link out of the checkpoint")
