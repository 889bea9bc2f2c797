"""Malformed framework metadata is the input's fault: a ckpttool error naming the file, never an internal error."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from ckpttool.errors import SourceError
from ckpttool.readers import READERS, guarded
from ckpttool.torch_save import scan
from conftest import assert_failed_cleanly, fixture_dir


def failed(result, out: Path, *needles: str) -> None:
    assert_failed_cleanly(result, out, *needles)
    assert "unexpected" not in result.stderr  # not the CLI's message for an internal error


def test_a_reader_tripping_over_malformed_metadata_gives_a_source_error():
    with pytest.raises(SourceError, match=r"'/ckpt': malformed deepspeed checkpoint metadata \(KeyError: 'group_paddings'\)"):
        guarded("deepspeed", Path("/ckpt"), lambda: {}["group_paddings"])


def test_through_the_cli_the_malformed_checkpoint_is_named(cli, copy_fixture, tmp_path, monkeypatch):
    src = copy_fixture("deepspeed_zero2")

    def trips(root, model, **options):
        return [1, 2][5]  # what an unchecked list index in a reader does on a short list

    monkeypatch.setattr(READERS["deepspeed"], "read", trips)
    failed(cli("merge", src, tmp_path / "out"), tmp_path / "out",
           f"'{src}': malformed deepspeed checkpoint metadata (IndexError: list index out of range)")


def test_an_absurd_size_in_a_pickle(tmp_path):
    class Infinite:
        def __reduce__(self):
            return (torch.Size, ([float("inf")],))

    buffer = io.BytesIO()
    torch.save({"w": torch.ones(2), "junk": Infinite()}, buffer)
    buffer.seek(0)
    with pytest.raises(SourceError, match=r"'rank.pt': cannot read it as a torch.save archive \(OverflowError"):
        scan(buffer, label="rank.pt")


def test_a_deepspeed_tag_leading_outside_the_checkpoint(cli, tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(fixture_dir("deepspeed_zero2") / "checkpoint", src)
    outside = tmp_path / "elsewhere"
    shutil.move(src / "global_step2", outside)
    os.symlink(outside, src / "step")
    (src / "latest").write_text("step")
    failed(cli("merge", src, tmp_path / "out"), tmp_path / "out", "'latest' names 'step', which leads outside the checkpoint directory")


def test_a_megatron_tracker_with_a_number_that_is_not_ascii(cli, tmp_path):
    fixture = Path(__file__).parent.parent / "fixtures" / "megatron_tp2_pp2"
    src = tmp_path / "legacy"
    shutil.copytree(fixture / "legacy", src)
    (src / "latest_checkpointed_iteration.txt").write_text("\u00b2")
    failed(cli("merge", src, tmp_path / "out", "--format", "megatron-legacy",
               "--config", fixture / "config.json"), tmp_path / "out",
           "'latest_checkpointed_iteration.txt': holds '²', expected an iteration number or 'release'")


def test_a_colossalai_ep_rank_numbered_from_zero(cli, copy_fixture, tmp_path):
    src = copy_fixture("colossalai_mixtral_pp2_ep2")
    for path in src.glob("*-00002-shard-*"):
        path.rename(path.with_name(path.name.replace("-00002-shard", "-00000-shard")))
    index = json.loads((src / "pytorch_model.bin.index.json").read_text())
    index["weight_map"] = {k: v.replace("-00002-shard", "-00000-shard") for k, v in index["weight_map"].items()}
    (src / "pytorch_model.bin.index.json").write_text(json.dumps(index))
    failed(cli("merge", src, tmp_path / "out"), tmp_path / "out",
           "EP rank number 0 in the file name; ColossalAI numbers them from 1")
