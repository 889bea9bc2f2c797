"""The fast paths of a sidecar dry run (issue 31): the sidecar's pieces checked a column at a time, and the peak
predictor's targets de-duplicated by signature, each giving what the one-at-a-time path gives (speed is measured
only by benchmarks/truescale_readers.py)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from ckpttool.commands.source import plan_source, read_layout
from ckpttool.errors import SourceError
from ckpttool.execute.buffers import chunks, distinct_targets, predict_peak_bytes as stream_peak_bytes
from ckpttool.io import sidecar
from ckpttool.io.sidecar import SUFFIX, parse_sidecar, shard_name
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.layout.layout import RAW, Box, Layout, Piece
from ckpttool.writers.hf import predict_peak_bytes

LABEL = f"rank-00000-of-00002{SUFFIX}"


def piece(fqn: str, shape: list[int], offsets: list[int], sizes: list[int], **extra) -> dict:
    return {"fqn": fqn, "global_shape": shape, "offsets": offsets, "sizes": sizes, "dtype": "BF16", **extra}


def doc(pieces: list[dict]) -> str:
    return json.dumps({"format": "ckpttool-sidecar", "version": 1, "rank": 0, "world_size": 2,
                       "file": "rank-00000-of-00002.safetensors", "pieces": pieces})


PLAIN = [
    piece("a.weight", [8, 4], [0, 0], [4, 4], tp_rank=0, ep_rank=None),
    piece("b.weight", [8, 4], [4, 0], [4, 4], key="local.b", tp_rank=1, expert=3),
    piece("norm.weight", [4], [0], [4], dtype="bfloat16"),
    piece("empty", [0, 4], [0, 0], [0, 4], pp_stage=0, dp_rank=2),
]


def test_plain_pieces_are_what_each_piece_parses_to():
    fast = sidecar._plain_pieces(json.loads(doc(PLAIN))["pieces"])
    assert fast is not None
    assert fast == tuple(sidecar._piece(p, LABEL) for p in PLAIN)
    assert fast[1].key == "local.b" and fast[0].key == "a.weight" and fast[2].dtype == "BF16"
    assert fast[0].coordinates == (("tp_rank", 0),) and fast[1].coordinates == (("tp_rank", 1), ("expert", 3))
    assert fast[3].coordinates == (("pp_stage", 0), ("dp_rank", 2))
    assert sidecar._plain_pieces([]) == ()


def test_a_piece_with_padding_or_fusion_is_read_one_piece_at_a_time():
    padded = [*PLAIN, piece("embed", [10, 4], [0, 0], [5, 4], padding=[{"dim": 0, "true_size": 9}])]
    assert sidecar._plain_pieces(padded) is None
    parsed = parse_sidecar(doc(padded), LABEL).pieces
    assert parsed[:4] == sidecar._plain_pieces(PLAIN) and parsed[4].padding[0].true_size == 9


@pytest.mark.parametrize(("bad", "message"), [
    ({"offsets": [0, True]}, "'b.weight': \"offsets\" must be a list of non-negative integers"),
    ({"sizes": [4, -1]}, "'b.weight': \"sizes\" must be a list of non-negative integers"),
    ({"global_shape": (8, 4.0)}, "'b.weight': \"global_shape\" must be a list of non-negative integers"),
    ({"offsets": [4]}, "'b.weight': global_shape, offsets and sizes have different lengths"),
    ({"dtype": "F128"}, "'b.weight': unknown dtype 'F128'"),
    ({"dtype": ["BF16"]}, "'b.weight': unknown dtype ['BF16']"),
    ({"key": None}, "'b.weight': \"key\" must be a string"),
    ({"tp_rank": False}, "'b.weight': \"tp_rank\" must be an integer"),
    ({"expert": "3"}, "'b.weight': \"expert\" must be an integer"),
    ({"fqn": 7}, "every piece needs an \"fqn\""),
])
def test_a_bad_piece_is_named_as_before(bad, message):
    pieces = [dict(p) for p in PLAIN]
    pieces[1].update(bad)
    assert sidecar._plain_pieces(json.loads(doc(pieces))["pieces"]) is None
    with pytest.raises(SourceError) as excinfo:
        parse_sidecar(doc(pieces), LABEL)
    assert str(excinfo.value) == f"'{LABEL}': {message}"


def test_a_piece_without_dtype_or_not_an_object_is_refused():
    no_dtype = [dict(p) for p in PLAIN]
    del no_dtype[0]["dtype"]
    with pytest.raises(SourceError, match="'a.weight': unknown dtype ''"):
        parse_sidecar(doc(no_dtype), LABEL)
    with pytest.raises(SourceError, match='every piece needs an "fqn"'):
        parse_sidecar(doc([*PLAIN, ["a.weight"]]), LABEL)


def write_rank(root: Path, rank: int, pieces: list[dict]) -> None:
    """A rank's safetensors file (zeros) and its sidecar: ``pieces`` as :func:`piece` gives them, all BF16."""
    header, position = {}, 0
    for p in pieces:
        n = 2 * p["sizes"][0] * (p["sizes"][1] if len(p["sizes"]) > 1 else 1)
        header[p.get("key", p["fqn"])] = {"dtype": "BF16", "shape": p["sizes"], "data_offsets": [position, position + n]}
        position += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    base = shard_name(rank, 2)
    (root / f"{base}.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(position))
    (root / f"{base}{SUFFIX}").write_text(json.dumps({
        "format": "ckpttool-sidecar", "version": 1, "rank": rank, "world_size": 2,
        "file": f"{base}.safetensors", "pieces": pieces}))


def test_the_peak_of_tensors_cut_in_pieces_is_that_of_all_their_chunks(tmp_path: Path):
    # 2-D tensors split in two along dim 0 (rows of several shapes), 1-D ones whole: as benchmarks/truescale_readers
    ranks: list[list[dict]] = [[], []]
    for i, rows in enumerate((8, 8, 6, 4096, 8, 6)):
        for tp in range(2):
            ranks[tp].append(piece(f"layer.{i}.weight", [rows, 4096], [tp * rows // 2, 0], [rows // 2, 4096], tp_rank=tp))
        ranks[0].append(piece(f"layer.{i}.norm", [4096], [0], [4096]))
    for rank, pieces in enumerate(ranks):
        write_rank(tmp_path, rank, pieces)
    plan = plan_source(tmp_path, format="sidecar").plan
    every_chunk = [c for t in plan.targets for c in chunks(t, 0)]
    assert len(plan.targets) == 12
    assert len(distinct_targets(plan.targets)) == 4  # 3 split shapes (8 rows thrice, 6 twice), one norm shape
    assert predict_peak_bytes(plan) == stream_peak_bytes(every_chunk)
    assert predict_peak_bytes(plan, 3) == stream_peak_bytes(every_chunk, 3)


def built(add_each: bool, rows: list[tuple[str, tuple[int, ...], Piece]]) -> Layout | str:
    """The layout of ``rows`` (fqn, global shape, piece) added one at a time or by add_pieces, or its error."""
    builder = LayoutBuilder("root", "sidecar")
    if add_each:
        for fqn, shape, p in rows:
            if builder.declare(fqn, shape, p.dtype, where="'r.json'"):
                builder.add(fqn, p)
    else:
        builder.add_pieces([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows], "'r.json'")
    try:
        return builder.build()
    except SourceError as e:
        return str(e)


def stored(offsets: tuple[int, ...], sizes: tuple[int, ...], dtype: str = "BF16", tp: int = 0) -> Piece:
    return Piece("rank.safetensors", f"k{offsets}", Box(offsets, sizes), dtype, RAW, 8, 2, (("tp_rank", tp),))


GOOD = [("w", (8, 4), stored((4, 0), (4, 4), tp=1)), ("w", (8, 4), stored((0, 0), (4, 4))),
        ("n", (4,), stored((0,), (4,))), ("s", (), stored((), ()))]


@pytest.mark.parametrize("rows", [
    GOOD,
    [*GOOD, ("w", (8, 4), stored((6, 0), (4, 4)))],  # outside its tensor
    [*GOOD, ("w", (8, 5), stored((0, 0), (4, 5)))],  # another global shape
    [*GOOD, ("w", (8, 4), stored((0, 0), (4, 4), "F32"))],  # another dtype
    [*GOOD, ("e", (0, 4), stored((0, 0), (0, 4)))],  # an empty piece: not kept
    [*GOOD, ("x", (2, -1), stored((0, 0), (2, 1)))],  # a negative global shape
    [*GOOD, ("x", [2, 2], stored((0, 0), (2, 2)))],  # a shape given as a list
], ids=["good", "outside", "shape", "dtype", "empty", "negative", "list"])
def test_add_pieces_builds_what_declare_and_add_build(rows):
    each, bulk = built(True, rows), built(False, rows)
    assert bulk == each
    if rows is GOOD:
        assert [p.box.offsets for p in bulk.tensors["w"].pieces] == [(0, 0), (4, 0)]  # in order of offsets


def test_a_rank_file_that_disagrees_with_its_sidecar_is_named(tmp_path: Path):
    write_rank(tmp_path, 0, [piece("a", [8, 4], [0, 0], [4, 4]), piece("b", [4], [0], [4])])
    write_rank(tmp_path, 1, [piece("a", [8, 4], [4, 0], [4, 4])])
    side = tmp_path / f"{shard_name(1, 2)}{SUFFIX}"
    doc_1 = json.loads(side.read_text())
    doc_1["pieces"][0]["sizes"] = [4, 2]
    side.write_text(json.dumps(doc_1))
    before = {p.name: p.read_bytes()[:4096] for p in tmp_path.iterdir()}
    with pytest.raises(SourceError) as excinfo:
        read_layout(tmp_path, format="sidecar")
    assert str(excinfo.value) == (f"'{shard_name(1, 2)}.safetensors': 'a' is BF16 [4, 4] but "
                                  f"'{shard_name(1, 2)}{SUFFIX}' records BF16 [4, 2]")
    assert {p.name: p.read_bytes()[:4096] for p in tmp_path.iterdir()} == before
