"""The per-tensor work of writing keeps its results: the header text is ``json.dumps``'s, the plan identity tells
plans apart, and a checkpoint of raw pieces counts no archive."""

from __future__ import annotations

import json
import math
import random
import struct
from dataclasses import replace

import pytest

import ckpttool
from ckpttool.execute.buffers import chunks, piece_uses
from ckpttool.io.safetensors_format import encode_header
from ckpttool.writers.hf import assign_files
from ckpttool.writers.journal import plan_id
from conftest import fixture_dir

ALPHABET = 'ab.\"\\\x00\x1f\x7f é中😀/ '


def header_by_dicts(entries, metadata) -> bytes:
    """What the safetensors header is by definition: the dicts, encoded by json (compact), padded to 8 bytes."""
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    pos = 0
    for name, (dtype, shape) in entries.items():
        n = math.prod(shape) * {"F32": 4, "BF16": 2, "F8_E4M3": 1, "I64": 8, "BOOL": 1}[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + n]}
        pos += n
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


@pytest.mark.parametrize("seed", range(20))
def test_the_header_text_is_what_json_writes(seed):
    r = random.Random(seed)
    entries = {}
    for i in range(r.randrange(0, 30)):
        name = "".join(r.choice(ALPHABET) for _ in range(r.randrange(0, 8))) + str(i)
        shape = tuple(r.randrange(0, 5) for _ in range(r.randrange(0, 4)))
        entries[name] = (r.choice(["F32", "BF16", "F8_E4M3", "I64", "BOOL"]), shape)
    metadata = {"format": "pt"} if seed % 2 else {'a"': "é", "x": ""}
    assert encode_header(entries, metadata)[0] == header_by_dicts(entries, metadata)


def test_a_tensor_named_like_the_metadata_is_encoded_as_json_does():
    entries = {"w": ("F32", (2,)), "__metadata__": ("F32", (3,))}
    assert encode_header(entries, {"format": "pt"})[0] == header_by_dicts(entries, {"format": "pt"})


def test_the_plan_identity_tells_plans_apart():
    src = fixture_dir("llama_tp2_dcp") / "checkpoint"
    plan = ckpttool.prepare(src).plan
    files = assign_files(plan, "60KB")
    same = plan_id(ckpttool.prepare(src).plan, assign_files(ckpttool.prepare(src).plan, "60KB"))
    assert plan_id(plan, files) == same
    assert plan_id(plan, assign_files(plan, "100KB")) != same  # another split
    cast = ckpttool.prepare(src, dtype="bfloat16").plan
    assert plan_id(cast, assign_files(cast, "60KB")) != same  # another dtype
    target = plan.targets[3]
    copy = target.copies[0]
    for changed in (replace(target, name=target.name + "x"), replace(target, shape=(*target.shape, 1)),
                    replace(target, copies=(replace(copy, piece=replace(copy.piece, key=copy.piece.key + "x")),
                                            *target.copies[1:])),
                    replace(target, copies=(replace(copy, piece=replace(copy.piece, byte_offset=copy.piece.byte_offset + 2)),
                                            *target.copies[1:]))):
        other = replace(plan, targets=(*plan.targets[:3], changed, *plan.targets[4:]))
        assert plan_id(other, assign_files(other, "60KB")) != same, changed


def test_a_checkpoint_of_raw_pieces_counts_no_archive():
    plan = ckpttool.prepare(fixture_dir("llama_tp2_dcp") / "checkpoint").plan
    assert piece_uses([c for t in plan.targets for c in chunks(t, 0, 64)]) == {}


def test_the_progress_total_is_summed_once_not_per_chunk(tmp_path, monkeypatch):
    """The total handed to ``progress`` is a sum over every target: summed per chunk, a 90k-tensor merge with its
    progress bar took half an hour (quadratic) instead of seconds."""
    from ckpttool.plan.plan import Plan

    real, sums, calls = Plan.nbytes, [0], []
    monkeypatch.setattr(Plan, "nbytes", property(lambda plan: sums.__setitem__(0, sums[0] + 1) or real.fget(plan)))
    result = ckpttool.merge(fixture_dir("llama_tp2_dcp") / "checkpoint", tmp_path / "hf", max_shard_size="60KB",
                            progress=lambda n, total: calls.append(total))
    assert len(calls) >= len(result.plan.targets) and set(calls) == {real.fget(result.plan)}
    assert sums[0] <= 3, f"the total was summed {sums[0]} times for {len(calls)} progress calls"
