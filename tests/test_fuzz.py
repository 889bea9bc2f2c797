"""Fuzzing the parsers that read untrusted bytes: safetensors headers, DCP ``.metadata``, sidecars, HF indexes,
transformers' sharding info. Random and mutated inputs may only ever raise ckpttool's own errors (a
:class:`~ckpttool.errors.CkptError`), never anything else, never hang, never run code.

Examples per target: ``CKPTTOOL_HYPOTHESIS_EXAMPLES`` (default 100 in CI; the long run reported in the
closing note used 5000). Structured fuzzing of DCP metadata mutates the real metadata object (sizes, offsets, byte ranges,
paths, dtypes) and then runs a whole generic merge, so the reader, the plan and the executor are all on the path.
"""

from __future__ import annotations

import json
import pickle
import shutil
import struct
import tempfile
import warnings
from pathlib import Path

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckpttool
from ckpttool.errors import CkptError
from ckpttool.io.safe_pickle import load_metadata_pickle
from ckpttool.io.safetensors_format import read_header
from ckpttool.io.sidecar import parse_sidecar
from conftest import HYPOTHESIS_EXAMPLES, fixture_dir

FUZZ = settings(max_examples=HYPOTHESIS_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
SRC = fixture_dir("llama_tp2_dcp") / "checkpoint"


def mutated(valid: bytes) -> st.SearchStrategy[bytes]:
    """``valid`` with random bytes overwritten, a random cut, and random bytes inserted."""

    @st.composite
    def build(draw) -> bytes:
        data = bytearray(valid)
        for _ in range(draw(st.integers(0, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        if draw(st.booleans()):
            at = draw(st.integers(0, len(data)))
            data[at:at] = draw(st.binary(max_size=16))
        if draw(st.booleans()):
            del data[draw(st.integers(0, len(data))):]
        return bytes(data)

    return build()


def only_ckpt_errors(call) -> None:
    """``call()`` succeeds or refuses the input with a :class:`CkptError`; anything else is a crash in ckpttool,
    which the CLI would report as an internal error, and fails the test."""
    try:
        call()
    except CkptError:
        pass
    except Exception as e:
        raise AssertionError(f"an internal error, not a refusal of bad input: {type(e).__name__}: {e}") from e


JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True) | st.text(max_size=12),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)


# -------------------------------------------------------------------------------------- safetensors header


def _safetensors_bytes() -> bytes:
    return (fixture_dir("llama_tp2_dcp") / "reference" / "model.safetensors").read_bytes()[:4096]


@FUZZ
@given(data=st.one_of(st.binary(max_size=256), mutated(_safetensors_bytes())))
def test_safetensors_header_bytes(data):
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        path.write_bytes(data)
        only_ckpt_errors(lambda: read_header(path))


@FUZZ
@given(header=st.dictionaries(st.text(max_size=6), JSON, max_size=4), padding=st.binary(max_size=64))
def test_safetensors_header_json(header, padding):
    text = json.dumps(header).encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        path.write_bytes(struct.pack("<Q", len(text)) + text + padding)
        only_ckpt_errors(lambda: read_header(path))


@FUZZ
@given(entry=st.fixed_dictionaries({}, optional={"dtype": st.sampled_from(["F32", "BF16", "I64", "BOOL", "X"]) | JSON,
                                                 "shape": st.lists(st.integers(-3, 2**40), max_size=3) | JSON,
                                                 "data_offsets": st.lists(st.integers(-8, 2**40), max_size=3) | JSON}))
def test_safetensors_header_entries(entry):
    text = json.dumps({"w": entry}).encode()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "model.safetensors"
        path.write_bytes(struct.pack("<Q", len(text)) + text + bytes(64))
        only_ckpt_errors(lambda: read_header(path))


# --------------------------------------------------------------------------------------------- DCP .metadata


@FUZZ
@given(data=st.one_of(st.binary(max_size=256), mutated((SRC / ".metadata").read_bytes())))
def test_dcp_metadata_bytes(data):
    only_ckpt_errors(lambda: load_metadata_pickle(data, ".metadata"))


def _metadata():
    return pickle.loads((SRC / ".metadata").read_bytes())  # our own fixture: trusted


FIELDS = st.sampled_from(["size", "chunk_offsets", "chunk_sizes", "storage_offset", "storage_length", "path", "dtype", "drop_chunk"])


@FUZZ
@given(edits=st.lists(st.tuples(st.integers(0, 20), FIELDS, st.integers(-2**40, 2**40), st.text(max_size=20)),
                      min_size=1, max_size=4))
def test_dcp_metadata_structure_through_a_whole_merge(edits):
    md = _metadata()
    names = sorted(md.state_dict_metadata)
    for which, field, number, text in edits:
        fqn = names[which % len(names)]
        tmd = md.state_dict_metadata[fqn]
        storage = sorted(((i, s) for i, s in md.storage_data.items() if i.fqn == fqn), key=lambda p: tuple(p[0].offset))
        if field == "size":
            tmd.size = torch.Size([number, *tmd.size[1:]]) if len(tmd.size) else tmd.size
        elif field in ("chunk_offsets", "chunk_sizes") and tmd.chunks:
            chunk = tmd.chunks[number % len(tmd.chunks)]
            dims = list(getattr(chunk, field.split("_")[1]))
            if dims:
                dims[number % len(dims)] = number
            setattr(chunk, field.split("_")[1], torch.Size(dims))
        elif field == "storage_offset" and storage:
            storage[0][1].offset = number
        elif field == "storage_length" and storage:
            storage[0][1].length = number
        elif field == "path" and storage:
            storage[0][1].relative_path = text
        elif field == "dtype":
            tmd.properties.dtype = [torch.float16, torch.int64, torch.bool, torch.complex64, torch.uint16][number % 5]
        elif field == "drop_chunk" and tmd.chunks:
            tmd.chunks.pop(number % len(tmd.chunks))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "ckpt"
        shutil.copytree(SRC, src)
        (src / ".metadata").write_bytes(pickle.dumps(md))
        only_ckpt_errors(lambda: ckpttool.merge(src, Path(tmp) / "out", audit=False))
        assert not (Path(tmp) / "out").exists() or (Path(tmp) / "out" / "model.safetensors").is_file()


# ------------------------------------------------------------------------------------------------- sidecar


def _sidecar_text() -> str:
    return json.dumps({
        "format": "ckpttool-sidecar", "version": 1, "rank": 0, "world_size": 2, "file": "rank-00000-of-00002.safetensors",
        "pieces": [{"fqn": "w", "global_shape": [4, 2], "offsets": [0, 0], "sizes": [2, 2], "dtype": "F32",
                    "padding": [{"dim": 0, "true_size": 3}], "fusion": {"dim": 1, "parts": [["a", 1], ["b", 1]]}, "tp_rank": 0}],
    })


@FUZZ
@given(text=st.one_of(st.text(max_size=200), mutated(_sidecar_text().encode()).map(lambda b: b.decode("utf-8", "replace"))))
def test_sidecar_text(text):
    only_ckpt_errors(lambda: parse_sidecar(text, "rank.ckpttool.json"))


@FUZZ
@given(field=st.sampled_from(["rank", "world_size", "file", "pieces", "step", "version"]), value=JSON,
       piece_field=st.sampled_from(["fqn", "key", "global_shape", "offsets", "sizes", "dtype", "padding", "fusion", "tp_rank"]),
       piece_value=JSON)
def test_sidecar_fields(field, value, piece_field, piece_value):
    doc = json.loads(_sidecar_text())
    doc[field] = value
    pieces = doc.get("pieces")
    if isinstance(pieces, list) and pieces and isinstance(pieces[0], dict):
        pieces[0][piece_field] = piece_value
    only_ckpt_errors(lambda: parse_sidecar(json.dumps(doc), "rank.ckpttool.json"))


# --------------------------------------------------------------------- HF index and transformers sharding info


@FUZZ
@given(index=st.one_of(JSON, st.fixed_dictionaries({"weight_map": st.dictionaries(st.text(max_size=30), JSON | st.text(max_size=30), max_size=4),
                                                    "metadata": JSON})))
def test_hf_index(index):
    with tempfile.TemporaryDirectory() as tmp:
        hf = Path(tmp)
        shutil.copy(fixture_dir("llama_tp2_dcp") / "reference" / "model.safetensors", hf / "model-00001-of-00001.safetensors")
        (hf / "model.safetensors.index.json").write_text(json.dumps(index))
        only_ckpt_errors(lambda: ckpttool.read_layout(hf))
        only_ckpt_errors(lambda: ckpttool.audit(hf, data=False))


@FUZZ
@given(info=JSON, key=st.sampled_from(["model.embed_tokens.weight", "model.norm.weight", "other"]))
def test_transformers_sharding_info(info, key):
    from test_errors import SHARD2, edit_sharding_info

    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "ckpt"
        shutil.copytree(fixture_dir("llama_hf_tp2") / "checkpoint", src)

        def replace(sharding):
            sharding[key] = info
        edit_sharding_info(src / SHARD2, replace)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            only_ckpt_errors(lambda: ckpttool.prepare(src))
