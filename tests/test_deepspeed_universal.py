"""DeepSpeed universal checkpoints beside the step a merge resolves to: the universal checkpoint of that step is what
the merge reads (a note says so, in the dry run too); one of another step, several, or a stale 'latest_universal'
leave the step read as it is and are named, and an error names both when the save folder's 'latest' and
'latest_universal' disagree. Built in tmp dirs from the deepspeed_zero2 checkpoint and its ds_to_universal output
(deepspeed_universal), whose model states file is the step's, byte for byte."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, assert_failed_cleanly, load_output
from test_deepspeed import STEP, _patch_pickle

import ckpttool

UNIVERSAL = f"{STEP}_universal"


def save_folder(tmp_path: Path, *universals: str, latest_universal: str | None = None,
                other_step: tuple[str, ...] = ()) -> Path:
    """The zero2 save folder with copies of its universal checkpoint beside the step under the given names; those in
    ``other_step`` get model states of another step (global_steps 1, as a later save would differ)."""
    src = tmp_path / "ds"
    shutil.copytree(FIXTURES / "deepspeed_zero2" / "checkpoint", src)
    for name in universals:
        shutil.copytree(FIXTURES / "deepspeed_universal" / "checkpoint" / UNIVERSAL, src / name)
        if name in other_step:
            _patch_pickle(src / name / "mp_rank_00_model_states.pt", b"global_steps", b"K\x02", b"K\x01")
    if latest_universal is not None:
        (src / "latest_universal").write_text(latest_universal)
    return src


def files_read(layout) -> set[str]:
    """The folders the pieces lie in: the step's or a universal checkpoint's."""
    return {p.file.split("/")[0] if "/" in p.file else Path(layout.root).name
            for t in layout.tensors.values() for p in t.pieces}


def assert_equals_the_reference(out: Path) -> None:
    got, want = load_output(out), load_output(FIXTURES / "deepspeed_zero2" / "reference")
    assert sorted(got) == sorted(want) and all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.parametrize("tag_file", [True, False])
@pytest.mark.parametrize("given", ["save folder", "step folder"])
def test_the_universal_checkpoint_of_the_step_is_what_a_merge_reads(tag_file, given, tmp_path):
    src = save_folder(tmp_path, UNIVERSAL, latest_universal=UNIVERSAL if tag_file else None)
    layout = ckpttool.read_layout(src if given == "save folder" else src / STEP)
    assert files_read(layout) == {UNIVERSAL} and layout.root == str(src)  # the folder holding both
    assert (f"read the universal checkpoint '{src / UNIVERSAL}' (ds_to_universal's output of '{STEP}', whose model "
            "states it holds unchanged) instead of the step's own files") in layout.notes
    ckpttool.merge(src if given == "save folder" else src / STEP, tmp_path / "hf")
    assert_equals_the_reference(tmp_path / "hf")


def test_the_dry_run_says_which_checkpoint_is_read(cli, tmp_path):
    src = save_folder(tmp_path, UNIVERSAL, latest_universal=UNIVERSAL)
    result = cli("merge", src, "--dry-run")
    assert result.exit_code == 0, result.output
    assert f"note: read the universal checkpoint '{src / UNIVERSAL}'" in result.stdout
    assert "model.norm.weight  F32 [32]  <- model.norm.weight (1 piece)" in result.stdout  # whole, one fp32.pt


def test_module_weights_are_read_from_the_step_itself(tmp_path):
    src = save_folder(tmp_path, UNIVERSAL, latest_universal=UNIVERSAL)
    layout = ckpttool.read_layout(src, weights="module")  # a universal checkpoint holds only fp32 master weights
    assert files_read(layout) == {STEP} and not any("universal" in n for n in layout.notes)


def test_latest_and_latest_universal_naming_different_steps_is_an_error_naming_both(cli, tmp_path):
    src = save_folder(tmp_path, "global_step1_universal", latest_universal="global_step1_universal",
                      other_step=("global_step1_universal",))
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", (
        f"'{src}': 'latest' names '{STEP}' but 'latest_universal' names 'global_step1_universal' (converted from "
        f"another step: its model states differ from this step's); give the folder to merge: '{src / STEP}' or "
        f"'{src / 'global_step1_universal'}'"))
    assert cli("merge", src / "global_step1_universal", "--dry-run").exit_code == 0  # the advice works


@pytest.mark.parametrize("tag_file", [True, False])
def test_a_universal_checkpoint_of_another_step_is_named_and_the_step_read(tag_file, tmp_path):
    src = save_folder(tmp_path, "global_step1_universal", other_step=("global_step1_universal",),
                      latest_universal="global_step1_universal" if tag_file else None)
    layout = ckpttool.read_layout(src / STEP if tag_file else src)  # given the step, nothing is ambiguous
    assert files_read(layout) == {STEP}
    assert (f"'{src / STEP}' read as it is; beside it, not read: '{src / 'global_step1_universal'}' (converted from "
            "another step: its model states differ from this step's"
            + ("; named by latest_universal)" if tag_file else ")")) in layout.notes


def test_a_stale_latest_universal_naming_nothing_is_noted_and_ignored(tmp_path):
    src = save_folder(tmp_path, latest_universal="global_step9_universal")
    layout = ckpttool.read_layout(src)
    assert files_read(layout) == {STEP}
    assert (f"'{src / 'latest_universal'}' names 'global_step9_universal', which is not a folder beside '{STEP}': "
            "ignored") in layout.notes
    ckpttool.merge(src, tmp_path / "hf")
    assert_equals_the_reference(tmp_path / "hf")


def test_several_universal_checkpoints_of_other_steps_are_all_named(tmp_path):
    src = save_folder(tmp_path, "global_step1_universal", "global_step3_universal",
                      other_step=("global_step1_universal", "global_step3_universal"))
    notes = ckpttool.read_layout(src).notes
    for name in ("global_step1_universal", "global_step3_universal"):
        assert (f"'{src / STEP}' read as it is; beside it, not read: '{src / name}' (converted from another step: its "
                "model states differ from this step's)") in notes


def test_among_several_the_one_of_the_step_is_read_and_the_others_named(tmp_path):
    src = save_folder(tmp_path, "global_step1_universal", UNIVERSAL, other_step=("global_step1_universal",))
    layout = ckpttool.read_layout(src)
    assert files_read(layout) == {UNIVERSAL}
    assert (f"not read: '{src / 'global_step1_universal'}' (converted from another step: its model states differ "
            "from this step's)") in layout.notes


def test_two_universal_checkpoints_of_the_same_step_ask_which(cli, tmp_path):
    src = save_folder(tmp_path, UNIVERSAL, "copy_universal")
    result = cli("merge", src, tmp_path / "hf")
    assert_failed_cleanly(result, tmp_path / "hf", f"'{src / STEP}': several universal checkpoints beside it were "
                          f"converted from it: '{src / 'copy_universal'}', '{src / UNIVERSAL}'; give the one to merge")


def test_a_universal_checkpoint_without_model_states_cannot_be_tied_to_the_step(tmp_path):
    src = save_folder(tmp_path, UNIVERSAL)
    (src / UNIVERSAL / "mp_rank_00_model_states.pt").unlink()
    layout = ckpttool.read_layout(src)
    assert files_read(layout) == {STEP}
    assert (f"'{src / STEP}' read as it is; beside it, not read: '{src / UNIVERSAL}' (no model states in it to tell "
            "which step it was converted from)") in layout.notes
