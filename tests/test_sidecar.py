"""ckpttool's sidecar: ``save_shard`` on every rank, then a merge that needs no guessing.

The seed case at tiny scale: a vocab of 1001 padded to 1004 so it splits 4 ways (251 rows per rank, the last
rank holding 248 real rows and 3 rows of padding), a replicated norm, and a column-split projection.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ckpttool
from ckpttool.errors import CoverageError, SourceError, SourceNotFoundError
from ckpttool.layout.layout import Fusion, Padding
from ckpttool.io.sidecar import FORMAT, SUFFIX, VERSION, PieceSpec, parse_sidecar, save_shard, shard_name

WORLD = 4
EMBED, NORM, PROJ = "model.embed_tokens.weight", "model.norm.weight", "model.layers.0.self_attn.o_proj.weight"
VOCAB, PADDED, HIDDEN = 1001, 1004, 8
STEP = PADDED // WORLD  # 251
PROJ_SHAPE = (6, 12)  # split along dim 1: 3 columns per rank

EMBED_TRUE = torch.arange(VOCAB * HIDDEN, dtype=torch.float32).reshape(VOCAB, HIDDEN)
EMBED_PADDED = torch.cat([EMBED_TRUE, torch.full((PADDED - VOCAB, HIDDEN), -1.0)])
NORM_W = torch.arange(HIDDEN, dtype=torch.float32) + 0.5
PROJ_W = -torch.arange(PROJ_SHAPE[0] * PROJ_SHAPE[1], dtype=torch.float32).reshape(PROJ_SHAPE)


def save_seed_checkpoint(directory: Path, ranks: range = range(WORLD)) -> None:
    """What each of 4 TP ranks would call at the end of training (here: all in one process)."""
    cols = PROJ_SHAPE[1] // WORLD
    for r in ranks:
        save_shard(
            {
                EMBED: EMBED_PADDED[r * STEP:(r + 1) * STEP],
                NORM: NORM_W.clone(),
                PROJ: PROJ_W[:, r * cols:(r + 1) * cols],
            },
            {
                EMBED: PieceSpec.split((PADDED, HIDDEN), dim=0, index=r, count=WORLD, true_size=VOCAB, tp_rank=r),
                NORM: PieceSpec.replicated((HIDDEN,)),
                PROJ: PieceSpec.split(PROJ_SHAPE, dim=1, index=r, count=WORLD, tp_rank=r),
            },
            directory,
            rank=r,
            world_size=WORLD,
        )


def name(rank: int, world: int = WORLD) -> str:
    return shard_name(rank, world)


def edit_sidecar(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


# --------------------------------------------------------------------------------------------- save_shard


def test_save_shard_writes_the_data_file_and_the_sidecar(tmp_path):
    save_seed_checkpoint(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{name(r)}{ext}" for r in range(WORLD) for ext in (".safetensors", SUFFIX)
    )
    side = json.loads((tmp_path / f"{name(3)}{SUFFIX}").read_text())
    assert {k: side[k] for k in ("format", "version", "rank", "world_size", "file")} == {
        "format": "ckpttool-sidecar", "version": 1, "rank": 3, "world_size": 4,
        "file": "rank-00003-of-00004.safetensors",
    }
    pieces = {p["fqn"]: p for p in side["pieces"]}
    assert pieces[EMBED] == {
        "fqn": EMBED, "key": EMBED, "global_shape": [1004, 8], "offsets": [753, 0], "sizes": [251, 8],
        "dtype": "F32", "padding": [{"dim": 0, "true_size": 1001}], "tp_rank": 3,
    }
    assert pieces[NORM] == {
        "fqn": NORM, "key": NORM, "global_shape": [8], "offsets": [0], "sizes": [8], "dtype": "F32",
    }
    assert pieces[PROJ]["offsets"] == [0, 9] and pieces[PROJ]["sizes"] == [6, 3]
    data = load_file(str(tmp_path / f"{name(3)}.safetensors"))
    assert torch.equal(data[EMBED], EMBED_PADDED[753:1004])
    assert not list(tmp_path.glob(".*.tmp"))  # written atomically, nothing left over


def test_save_shard_returns_the_sidecar_path_and_copies_views(tmp_path):
    whole = torch.arange(8, dtype=torch.float32).reshape(4, 2)
    path = save_shard({"w": whole[:, 1]}, {"w": PieceSpec.split((8,), dim=0, index=1, count=2)}, tmp_path / "new",
                      rank=1, world_size=2)
    assert path == tmp_path / "new" / f"rank-00001-of-00002{SUFFIX}"
    assert torch.equal(load_file(str(tmp_path / "new" / "rank-00001-of-00002.safetensors"))["w"], whole[:, 1])


def test_split_records_padding_only_when_the_true_size_differs():
    spec = PieceSpec.split((1004, 8), dim=0, index=3, count=4, true_size=1001, tp_rank=3)
    assert spec == PieceSpec((1004, 8), (753, 0), (Padding(0, 1001),), None, (("tp_rank", 3),))
    assert PieceSpec.split((1004, 8), dim=0, index=1, count=4, true_size=1004).padding == ()


def test_split_refuses_a_dim_that_does_not_divide():
    with pytest.raises(ValueError, match=re.escape("dim 0 of [1001, 8] is not divisible into 4 equal pieces")):
        PieceSpec.split((1001, 8), dim=0, index=0, count=4)


def test_save_shard_refuses_a_tensor_without_a_spec(tmp_path):
    with pytest.raises(ValueError, match=re.escape("'w': no PieceSpec given")):
        save_shard({"w": torch.zeros(2)}, {}, tmp_path, rank=0, world_size=1)


def test_save_shard_refuses_a_tensor_that_does_not_fit_its_spec(tmp_path):
    spec = PieceSpec.split((1004, 8), dim=0, index=3, count=4)
    with pytest.raises(ValueError, match=re.escape(
        "'w': local shape [252, 8] at offsets [753, 0] does not fit the global shape [1004, 8]"
    )):
        save_shard({"w": torch.zeros(252, 8)}, {"w": spec}, tmp_path, rank=3, world_size=4)
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------------------------- merge


def test_merge_restores_the_true_embedding_the_norm_once_and_the_column_split(tmp_path):
    save_seed_checkpoint(tmp_path / "ckpt")
    result = ckpttool.merge(tmp_path / "ckpt", tmp_path / "out")
    assert result.format == "sidecar"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["ckpttool-audit.json", "model.safetensors"]
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(merged) == sorted([EMBED, NORM, PROJ])
    assert torch.equal(merged[EMBED], EMBED_TRUE)  # exactly the 1001 real rows, padding stripped
    assert torch.equal(merged[NORM], NORM_W)
    assert torch.equal(merged[PROJ], PROJ_W)
    copies = {t.name: len(t.copies) for t in result.plan.targets}
    assert copies == {EMBED: 4, NORM: 1, PROJ: 4}


def test_merge_with_a_missing_rank_names_its_rows_and_its_sidecar_and_writes_nothing(tmp_path):
    save_seed_checkpoint(tmp_path / "ckpt")
    (tmp_path / "ckpt" / f"{name(2)}.safetensors").unlink()
    (tmp_path / "ckpt" / f"{name(2)}{SUFFIX}").unlink()
    with pytest.raises(CoverageError) as excinfo:
        ckpttool.merge(tmp_path / "ckpt", tmp_path / "out")
    found = ("found 3 pieces in 'rank-00000-of-00004.safetensors', 'rank-00001-of-00004.safetensors', "
             "'rank-00003-of-00004.safetensors')")
    cause = "These files of the checkpoint are missing: 'rank-00002-of-00004.ckpttool.json'. Restore them."
    assert excinfo.value.problems == (
        f"'{EMBED}': rows 502..753 covered by no piece (shape [1001, 8]; {found}. {cause}",
        f"'{PROJ}': columns 6..9 covered by no piece (shape [6, 12]; {found}. {cause}",
    )
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no staging directory left behind


def test_missing_last_rank_leaves_only_its_real_rows_uncovered(tmp_path):
    save_seed_checkpoint(tmp_path, ranks=range(3))
    layout = ckpttool.read_layout(tmp_path)
    assert layout.notes == ("3 of 4 rank sidecars present",)
    with pytest.raises(CoverageError) as excinfo:
        ckpttool.plan_merge(layout)
    assert excinfo.value.problems[0].startswith(f"'{EMBED}': rows 753..1001 covered by no piece (shape [1001, 8]; ")
    assert "'rank-00003-of-00004.ckpttool.json'" in excinfo.value.problems[0]


def test_missing_data_file_beside_its_sidecar_is_named(tmp_path):
    save_seed_checkpoint(tmp_path)
    (tmp_path / f"{name(2)}.safetensors").unlink()
    with pytest.raises(SourceNotFoundError, match=re.escape(
        "'rank-00002-of-00004.ckpttool.json' describes 'rank-00002-of-00004.safetensors', which does not exist"
    )):
        ckpttool.read_layout(tmp_path)


def test_fused_tensor_split_across_ranks_merges_into_its_parts(tmp_path):
    # gate (2 rows) and up (4 rows) fused along dim 0, then split by columns over 2 ranks
    fused = torch.arange(6 * 4, dtype=torch.float32).reshape(6, 4)
    fusion = Fusion(0, (("mlp.gate_proj.weight", 2), ("mlp.up_proj.weight", 4)))
    for r in range(2):
        save_shard({"mlp.gate_up_proj.weight": fused[:, 2 * r:2 * r + 2]},
                   {"mlp.gate_up_proj.weight": PieceSpec.split((6, 4), dim=1, index=r, count=2, fusion=fusion)},
                   tmp_path / "ckpt", rank=r, world_size=2)
    ckpttool.merge(tmp_path / "ckpt", tmp_path / "out")
    merged = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert sorted(merged) == ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
    assert torch.equal(merged["mlp.gate_proj.weight"], fused[:2])
    assert torch.equal(merged["mlp.up_proj.weight"], fused[2:])


# --------------------------------------------------------------------------------------------- reader checks


def test_sidecars_disagreeing_on_world_size_are_refused(tmp_path):
    save_seed_checkpoint(tmp_path, ranks=range(2))
    save_shard({"x": torch.zeros(2)}, {"x": PieceSpec.replicated((2,))}, tmp_path, rank=0, world_size=2)
    with pytest.raises(SourceError, match=re.escape(
        f"'{tmp_path}': sidecars disagree on world_size ([2, 4]); are two checkpoints mixed in one directory?"
    )):
        ckpttool.read_layout(tmp_path)


def test_two_sidecars_claiming_the_same_rank_are_refused(tmp_path):
    save_seed_checkpoint(tmp_path)
    (tmp_path / f"copy{SUFFIX}").write_text((tmp_path / f"{name(1)}{SUFFIX}").read_text())
    with pytest.raises(SourceError, match=re.escape(
        f"'rank-00001-of-00004{SUFFIX}' and 'copy{SUFFIX}' both claim rank 1"
    )):
        ckpttool.read_layout(tmp_path)


def test_sizes_disagreeing_with_the_data_file_are_refused(tmp_path):
    save_seed_checkpoint(tmp_path)

    def shrink(doc):
        doc["pieces"][0]["sizes"] = [250, 8]

    edit_sidecar(tmp_path / f"{name(1)}{SUFFIX}", shrink)
    with pytest.raises(SourceError, match=re.escape(
        f"'rank-00001-of-00004.safetensors': '{EMBED}' is F32 [251, 8] but 'rank-00001-of-00004{SUFFIX}' "
        "records F32 [250, 8]"
    )):
        ckpttool.read_layout(tmp_path)


def test_dtype_disagreeing_with_the_data_file_is_refused(tmp_path):
    save_seed_checkpoint(tmp_path)

    def to_bf16(doc):
        doc["pieces"][1]["dtype"] = "BF16"

    edit_sidecar(tmp_path / f"{name(0)}{SUFFIX}", to_bf16)
    with pytest.raises(SourceError, match=re.escape(
        f"'rank-00000-of-00004.safetensors': '{NORM}' is F32 [8] but 'rank-00000-of-00004{SUFFIX}' records BF16 [8]"
    )):
        ckpttool.read_layout(tmp_path)


def test_a_key_the_data_file_lacks_is_named(tmp_path):
    save_seed_checkpoint(tmp_path)

    def rename(doc):
        doc["pieces"][1]["key"] = "norm"

    edit_sidecar(tmp_path / f"{name(0)}{SUFFIX}", rename)
    with pytest.raises(SourceError, match=re.escape(
        f"'rank-00000-of-00004.safetensors': has no tensor 'norm' (for '{NORM}', named by "
        f"'rank-00000-of-00004{SUFFIX}')"
    )):
        ckpttool.read_layout(tmp_path)


def test_ranks_disagreeing_on_the_global_shape_name_both_sidecars(tmp_path):
    save_seed_checkpoint(tmp_path)

    def grow(doc):
        doc["pieces"][0]["global_shape"] = [1008, 8]

    edit_sidecar(tmp_path / f"{name(3)}{SUFFIX}", grow)
    with pytest.raises(SourceError, match=re.escape(
        f"'{EMBED}': pieces disagree on the global shape: [1004, 8] in 'rank-00000-of-00004{SUFFIX}' "
        f"but [1008, 8] in 'rank-00003-of-00004{SUFFIX}'"
    )):
        ckpttool.read_layout(tmp_path)


def test_a_data_file_outside_the_checkpoint_is_refused(tmp_path):
    save_seed_checkpoint(tmp_path / "ckpt", ranks=range(1))
    save_file({"x": torch.zeros(1)}, str(tmp_path / "elsewhere.safetensors"))

    def escape(doc):
        doc["file"] = "../elsewhere.safetensors"

    edit_sidecar(tmp_path / "ckpt" / f"{name(0)}{SUFFIX}", escape)
    with pytest.raises(SourceError, match=re.escape(
        f"'rank-00000-of-00004{SUFFIX}' names '../elsewhere.safetensors', which leads outside the checkpoint directory"
    )):
        ckpttool.read_layout(tmp_path / "ckpt")


# --------------------------------------------------------------------------------------------- parse_sidecar

LABEL = f"rank-00000-of-00002{SUFFIX}"


def valid_doc() -> dict:
    return {
        "format": FORMAT,
        "version": VERSION,
        "rank": 0,
        "world_size": 2,
        "file": "rank-00000-of-00002.safetensors",
        "pieces": [
            {
                "fqn": "w", "key": "local.w", "global_shape": [1004, 8], "offsets": [0, 0], "sizes": [502, 8],
                "dtype": "bfloat16", "padding": [{"dim": 0, "true_size": 1001}],
                "fusion": {"dim": 1, "parts": [["a", 3], ["b", 5]]},
                "tp_rank": 0, "pp_stage": 1, "expert": None,
            }
        ],
    }


def parse_refused(doc: object) -> str:
    text = doc if isinstance(doc, str) else json.dumps(doc)
    with pytest.raises(SourceError) as excinfo:
        parse_sidecar(text, LABEL)
    return str(excinfo.value)


def test_parse_reads_every_field():
    side = parse_sidecar(json.dumps(valid_doc()), LABEL)
    assert (side.rank, side.world_size, side.file) == (0, 2, "rank-00000-of-00002.safetensors")
    (p,) = side.pieces
    assert (p.fqn, p.key, p.global_shape, p.offsets, p.sizes, p.dtype) == (
        "w", "local.w", (1004, 8), (0, 0), (502, 8), "BF16",
    )
    assert p.padding == (Padding(0, 1001),)
    assert p.fusion == Fusion(1, (("a", 3), ("b", 5)))
    assert p.coordinates == (("tp_rank", 0), ("pp_stage", 1))  # null coordinates are left out


def test_parse_defaults_the_key_to_the_fqn():
    doc = valid_doc()
    del doc["pieces"][0]["key"]
    assert parse_sidecar(json.dumps(doc), LABEL).pieces[0].key == "w"


def test_parse_refuses_invalid_json():
    assert parse_refused("{not json").startswith(f"'{LABEL}': not valid JSON (")


@pytest.mark.parametrize("fmt", ["ckpttool", None, 1])
def test_parse_refuses_another_format(fmt):
    doc = valid_doc()
    doc["format"] = fmt
    assert parse_refused(doc) == f"'{LABEL}': not a ckpttool sidecar (\"format\" must be \"ckpttool-sidecar\")"


def test_parse_refuses_a_json_document_that_is_not_an_object():
    assert parse_refused("[1, 2]") == f"'{LABEL}': not a ckpttool sidecar (\"format\" must be \"ckpttool-sidecar\")"


def test_parse_refuses_an_unknown_version_and_says_to_upgrade():
    doc = valid_doc()
    doc["version"] = 2
    assert parse_refused(doc) == (
        f"'{LABEL}': sidecar version 2 is not supported by this ckpttool (it reads version 1); upgrade ckpttool"
    )


def test_parse_refuses_a_missing_version():
    doc = valid_doc()
    del doc["version"]
    assert parse_refused(doc).startswith(f"'{LABEL}': sidecar version None is not supported")


@pytest.mark.parametrize(("field", "value"), [("rank", "0"), ("world_size", None), ("rank", True)])
def test_parse_refuses_non_integer_rank_fields(field, value):
    doc = valid_doc()
    doc[field] = value
    assert parse_refused(doc) == f"'{LABEL}': \"{field}\" must be an integer"


@pytest.mark.parametrize("rank", [2, -1])
def test_parse_refuses_a_rank_outside_the_world(rank):
    doc = valid_doc()
    doc["rank"] = rank
    assert parse_refused(doc) == f"'{LABEL}': rank {rank} is outside world_size 2"


def test_parse_refuses_a_missing_file_name():
    doc = valid_doc()
    doc["file"] = 3
    assert parse_refused(doc) == f"'{LABEL}': \"file\" must name the rank's data file"


def test_parse_refuses_pieces_that_are_not_a_list():
    doc = valid_doc()
    doc["pieces"] = {"w": {}}
    assert parse_refused(doc) == f"'{LABEL}': \"pieces\" must be a list"


def test_parse_refuses_a_piece_without_fqn():
    doc = valid_doc()
    del doc["pieces"][0]["fqn"]
    assert parse_refused(doc) == f"'{LABEL}': every piece needs an \"fqn\""


def assert_names_piece(message: str, words: str) -> None:
    """Piece errors name the sidecar, the tensor, and what is wrong."""
    assert LABEL in message and "'w'" in message and message.endswith(words), message


@pytest.mark.parametrize("offsets", [[0, -8], [0.0, 0], "0,0", None, [0, False]])
def test_parse_refuses_malformed_offsets(offsets):
    doc = valid_doc()
    doc["pieces"][0]["offsets"] = offsets
    assert_names_piece(parse_refused(doc), "\"offsets\" must be a list of non-negative integers")


@pytest.mark.parametrize("field", ["global_shape", "sizes"])
def test_parse_refuses_malformed_shapes(field):
    doc = valid_doc()
    doc["pieces"][0][field] = [-1, 8]
    assert_names_piece(parse_refused(doc), f"\"{field}\" must be a list of non-negative integers")


def test_parse_refuses_offsets_of_another_rank():
    doc = valid_doc()
    doc["pieces"][0]["offsets"] = [0]
    assert_names_piece(parse_refused(doc), "global_shape, offsets and sizes have different lengths")


def test_parse_refuses_an_unknown_dtype():
    doc = valid_doc()
    doc["pieces"][0]["dtype"] = "F128"
    assert_names_piece(parse_refused(doc), "unknown dtype 'F128'")


def test_parse_refuses_a_key_that_is_not_a_string():
    doc = valid_doc()
    doc["pieces"][0]["key"] = 7
    assert_names_piece(parse_refused(doc), "\"key\" must be a string")


def test_parse_refuses_malformed_padding():
    doc = valid_doc()
    doc["pieces"][0]["padding"] = [{"dim": 0, "true_size": "1001"}]
    assert_names_piece(parse_refused(doc), "\"true_size\" must be an integer")


def test_parse_refuses_padding_that_is_not_a_list():  # found by tests/test_fuzz.py: an int is not iterable
    doc = valid_doc()
    doc["pieces"][0]["padding"] = 1
    assert_names_piece(parse_refused(doc), "\"padding\" must be a list of {\"dim\", \"true_size\"}")


def test_parse_refuses_a_non_integer_coordinate():
    doc = valid_doc()
    doc["pieces"][0]["tp_rank"] = "0"
    assert_names_piece(parse_refused(doc), "\"tp_rank\" must be an integer")


@pytest.mark.parametrize("fusion", [{"dim": 1}, {"dim": 1, "parts": [["a"]]}, {"dim": "x", "parts": []}, [1],
                                    {"dim": 1, "parts": [["a", float("inf")]]}])
def test_parse_refuses_malformed_fusion(fusion):  # the last two were found by tests/test_fuzz.py
    doc = valid_doc()
    doc["pieces"][0]["fusion"] = fusion
    assert_names_piece(parse_refused(doc), "fusion must be {\"dim\": int, \"parts\": [[name, size], ...]}")


@pytest.mark.parametrize(
    "fusion",
    [Fusion(1, (("a", 2), ("b", 1))), Fusion(2, (("a", 4),)), Fusion(-1, (("a", 2), ("b", 2))), Fusion(0, (("a", 3), ("b", 0)))],
)
def test_fusion_records_that_do_not_fit_the_global_shape_are_refused(tmp_path, fusion):
    """A negative dim once slipped through and made every part the whole tensor: now refused, with the file."""
    fused = torch.arange(3 * 4, dtype=torch.float32).reshape(3, 4)
    save_shard({"ab": fused}, {"ab": PieceSpec((3, 4), (0, 0), fusion=fusion)}, tmp_path / "ckpt", rank=0, world_size=1)
    with pytest.raises(SourceError) as excinfo:
        ckpttool.merge(tmp_path / "ckpt", tmp_path / "out")
    message = str(excinfo.value)
    assert f"'ab': fusion parts {[list(p) for p in fusion.parts]} along dim {fusion.dim} do not add up to the global shape [3, 4]" in message
    assert f"'rank-00000-of-00001{SUFFIX}'" in message
    assert not (tmp_path / "out").exists()
