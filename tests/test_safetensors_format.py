"""The safetensors format: headers are read and validated without loading tensors, and written loadably.

Every malformed file is refused with a message that names the file (its label) and what is wrong.
"""

from __future__ import annotations

import json
import re
import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from ckpttool.io.dtypes import dtype_name
from ckpttool.errors import SourceError
from ckpttool.io.safetensors_format import MAX_HEADER_BYTES, encode_header, read_header

LABEL = "rank-00001-of-00004.safetensors"


def write_raw(path: Path, header: object, data: bytes = b"") -> Path:
    """A file with ``header`` (a JSON-able object, or raw bytes) as its header, followed by ``data``."""
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)
    return path


def refused(path: Path) -> str:
    with pytest.raises(SourceError) as excinfo:
        read_header(path, LABEL)
    message = str(excinfo.value)
    assert message.startswith(f"'{LABEL}': "), message
    return message


# --------------------------------------------------------------------------------------------- valid files


def test_entries_of_a_file_written_by_safetensors_match_its_tensors(tmp_path):
    tensors = {
        "embed": torch.arange(15, dtype=torch.float32).reshape(5, 3),
        "norm": torch.arange(3, dtype=torch.bfloat16),
        "step": torch.arange(2, dtype=torch.int64),
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 4, dtype=torch.float16),
    }
    path = tmp_path / "shard.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    assert {k: (e.dtype, e.shape) for k, e in header.entries.items()} == {
        "embed": ("F32", (5, 3)),
        "norm": ("BF16", (3,)),
        "step": ("I64", (2,)),
        "mask": ("BOOL", (3,)),
        "empty": ("F16", (0, 4)),
    }
    (n,) = struct.unpack("<Q", path.read_bytes()[:8])
    assert header.data_start == 8 + n


def test_entry_offsets_are_absolute_positions_of_the_tensor_bytes(tmp_path):
    tensors = {"a": torch.arange(12, dtype=torch.float32).reshape(3, 4), "b": torch.arange(5, dtype=torch.int64) * 7}
    path = tmp_path / "shard.safetensors"
    save_file(tensors, str(path))
    raw = path.read_bytes()
    header = read_header(path)
    for name, tensor in tensors.items():
        entry = header.entries[name]
        assert entry.end - entry.begin == tensor.numel() * tensor.element_size()
        found = torch.frombuffer(bytearray(raw[entry.begin:entry.end]), dtype=tensor.dtype).reshape(tensor.shape)
        assert torch.equal(found, tensor)
    assert max(e.end for e in header.entries.values()) == len(raw)


def test_label_defaults_to_the_path(tmp_path):
    path = tmp_path / "tiny.safetensors"
    path.write_bytes(b"\x01\x02")
    with pytest.raises(SourceError, match=re.escape(f"'{path}': truncated safetensors file (2 bytes, no header)")):
        read_header(path)


def test_empty_file_entries_are_not_overlaps(tmp_path):
    path = write_raw(tmp_path / "f", {
        "a": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]},
        "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "c": {"dtype": "F32", "shape": [0, 5], "data_offsets": [8, 8]},
    }, bytes(8))
    assert sorted(read_header(path).entries) == ["a", "b", "c"]


# --------------------------------------------------------------------------------------------- encode_header


@pytest.mark.parametrize("names", [("w",), ("ab", "c"), ("abc", "defg", "h"), ("layer.0.weight", "ü-norm", "x" * 13)])
def test_encoded_header_round_trips_through_safetensors(tmp_path, names):
    dtypes = [torch.float32, torch.bfloat16, torch.int64, torch.float16]
    tensors = {name: torch.arange(6 * (i + 1)).reshape(i + 1, 6).to(dtypes[i]) for i, name in enumerate(names)}
    tensors["mask"] = torch.arange(5) % 2 == 1
    prefix, offsets = encode_header(
        {name: (dtype_name(t.dtype), tuple(t.shape)) for name, t in tensors.items()}, {"format": "pt"}
    )
    (n,) = struct.unpack("<Q", prefix[:8])
    assert n == len(prefix) - 8
    assert n % 8 == 0
    buffer = bytearray()
    for name, t in tensors.items():
        begin, end = offsets[name]
        assert begin == len(buffer)
        buffer += t.reshape(-1).view(torch.uint8).numpy().tobytes()
        assert end == len(buffer)
    path = tmp_path / "out.safetensors"
    path.write_bytes(prefix + bytes(buffer))

    loaded = load_file(str(path))
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype
        assert torch.equal(loaded[name], t)
    header = read_header(path)
    assert header.data_start == len(prefix)
    assert header.metadata == {"format": "pt"}
    assert {k: (e.begin - len(prefix), e.end - len(prefix)) for k, e in header.entries.items()} == offsets


def test_encoded_header_without_tensors_is_a_valid_empty_file(tmp_path):
    prefix, offsets = encode_header({}, {})
    assert offsets == {}
    path = tmp_path / "empty.safetensors"
    path.write_bytes(prefix)
    assert load_file(str(path)) == {}
    assert read_header(path).entries == {}


# --------------------------------------------------------------------------------------------- refused files


def test_file_shorter_than_the_length_prefix_is_truncated(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"\x10\x00\x00")
    assert refused(path) == f"'{LABEL}': truncated safetensors file (3 bytes, no header)"


def test_missing_file_cannot_be_read(tmp_path):
    assert refused(tmp_path / "absent") == f"'{LABEL}': cannot read: No such file or directory"


def test_header_length_past_the_end_of_the_file(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(struct.pack("<Q", 100) + b"{}")
    assert refused(path) == (
        f"'{LABEL}': safetensors header length 100 runs past the end of the file (10 bytes); "
        "the file is truncated or not safetensors"
    )


def test_header_larger_than_the_limit_is_refused_before_reading(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    assert refused(path) == (
        f"'{LABEL}': safetensors header of {MAX_HEADER_BYTES + 1} bytes exceeds the {MAX_HEADER_BYTES} limit"
    )


def test_garbage_header_is_not_valid_json(tmp_path):
    path = write_raw(tmp_path / "f", b"\xff\xfenot json")
    assert refused(path).startswith(f"'{LABEL}': safetensors header is not valid JSON (")
    path = write_raw(tmp_path / "g", b'{"w": ')
    assert refused(path).startswith(f"'{LABEL}': safetensors header is not valid JSON (")


def test_header_that_is_not_an_object(tmp_path):
    assert refused(write_raw(tmp_path / "f", [1, 2])) == f"'{LABEL}': safetensors header is not a JSON object"


def test_metadata_must_map_strings_to_strings(tmp_path):
    path = write_raw(tmp_path / "f", {"__metadata__": {"step": 5}})
    assert refused(path) == f"'{LABEL}': safetensors __metadata__ must map strings to strings"


def test_tensor_record_that_is_not_an_object(tmp_path):
    path = write_raw(tmp_path / "f", {"w": [0, 4]})
    assert refused(path) == f"'{LABEL}': tensor 'w' has no dtype/shape/data_offsets record"


@pytest.mark.parametrize("dtype", ["F128", "float32", None])
def test_unknown_dtype(tmp_path, dtype):
    path = write_raw(tmp_path / "f", {"w": {"dtype": dtype, "shape": [1], "data_offsets": [0, 4]}}, bytes(4))
    assert refused(path) == f"'{LABEL}': tensor 'w' has unsupported dtype {dtype!r}"


@pytest.mark.parametrize("shape", [[-1, 2], [2.0], "4", [True], None])
def test_invalid_shape(tmp_path, shape):
    path = write_raw(tmp_path / "f", {"w": {"dtype": "F32", "shape": shape, "data_offsets": [0, 8]}}, bytes(8))
    assert refused(path) == f"'{LABEL}': tensor 'w' has an invalid shape {shape!r}"


@pytest.mark.parametrize("offsets", [[8, 0], [-8, 0], [0], [0, 8, 16], [0, 8.0], "0-8", None])
def test_invalid_data_offsets(tmp_path, offsets):
    path = write_raw(tmp_path / "f", {"w": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}, bytes(8))
    assert refused(path) == f"'{LABEL}': tensor 'w' has invalid data_offsets {offsets!r}"


def test_data_offsets_past_the_end_of_the_file_mean_truncation(tmp_path):
    path = write_raw(tmp_path / "f", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, bytes(8))
    assert refused(path) == (
        f"'{LABEL}': tensor 'w' data_offsets [0, 16] run past the end of the data (8 bytes); the file is truncated"
    )


def test_a_real_file_cut_short_is_truncated(tmp_path):
    path = tmp_path / "f"
    save_file({"a": torch.arange(4, dtype=torch.float32), "b": torch.arange(4, dtype=torch.float32)}, str(path))
    path.write_bytes(path.read_bytes()[:-4])
    message = refused(path)
    assert re.fullmatch(
        rf"'{re.escape(LABEL)}': tensor 'b' data_offsets \[16, 32\] run past the end of the data \(28 bytes\); "
        r"the file is truncated",
        message,
    ), message


def test_byte_count_disagreeing_with_the_shape(tmp_path):
    path = write_raw(tmp_path / "f", {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, bytes(16))
    assert refused(path) == f"'{LABEL}': tensor 'w' holds 8 bytes but shape [4] of F32 needs 16"


def test_overlapping_tensors(tmp_path):
    path = write_raw(tmp_path / "f", {
        "a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]},
        "b": {"dtype": "F32", "shape": [4], "data_offsets": [8, 24]},
    }, bytes(24))
    assert refused(path) == f"'{LABEL}': tensors 'a' and 'b' overlap in the data buffer"


def test_two_tensors_on_the_same_bytes_overlap(tmp_path):
    path = write_raw(tmp_path / "f", {
        "a": {"dtype": "I64", "shape": [2], "data_offsets": [0, 16]},
        "b": {"dtype": "F64", "shape": [2], "data_offsets": [0, 16]},
    }, bytes(16))
    assert refused(path) == f"'{LABEL}': tensors 'a' and 'b' overlap in the data buffer"


def test_dtype_that_is_not_a_string(tmp_path):  # found by tests/test_fuzz.py: a list is unhashable
    path = write_raw(tmp_path / "f.safetensors", {"w": {"dtype": [], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4)
    assert refused(path) == f"'{LABEL}': tensor 'w' has unsupported dtype []"


# --------------------------------------------------------------------------------------------- what safetensors refuses


def _safetensors_refuses(path: Path) -> None:
    """The library ckpttool writes for refuses the file too: ckpttool is no laxer than the consumer."""
    from safetensors import SafetensorError, safe_open

    with pytest.raises(SafetensorError):
        with safe_open(str(path), framework="pt") as f:
            list(f.keys())


def test_a_key_twice_in_the_header_is_refused(tmp_path):
    header = (b'{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]},'
              b'"w":{"dtype":"U8","shape":[2],"data_offsets":[0,2]}}')
    path = write_raw(tmp_path / "f", header, bytes(4))
    assert refused(path) == f"'{LABEL}': safetensors header refused: the key 'w' appears twice in one object"
    _safetensors_refuses(path)


def test_a_key_twice_in_a_tensor_record_is_refused(tmp_path):
    path = write_raw(tmp_path / "f", b'{"w":{"dtype":"U8","dtype":"F32","shape":[4],"data_offsets":[0,4]}}', bytes(4))
    assert refused(path) == f"'{LABEL}': safetensors header refused: the key 'dtype' appears twice in one object"


def test_bytes_between_two_tensors_are_refused(tmp_path):
    path = write_raw(tmp_path / "f", {
        "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
        "b": {"dtype": "U8", "shape": [4], "data_offsets": [8, 12]},
    }, bytes(12))
    assert refused(path) == (
        f"'{LABEL}': 4 bytes after tensor 'a' belong to no tensor (data offsets 4..8, before tensor 'b'); "
        "the safetensors library refuses a file whose tensors do not cover its data exactly"
    )
    _safetensors_refuses(path)


def test_bytes_before_the_first_tensor_are_refused(tmp_path):
    path = write_raw(tmp_path / "f", {"a": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]}}, bytes(6))
    assert refused(path) == (
        f"'{LABEL}': 2 bytes at the start of the data buffer belong to no tensor (data offsets 0..2, before tensor "
        "'a'); the safetensors library refuses a file whose tensors do not cover its data exactly"
    )
    _safetensors_refuses(path)


def test_bytes_after_the_last_tensor_are_refused(tmp_path):
    path = tmp_path / "f"
    save_file({"a": torch.arange(4, dtype=torch.float32)}, str(path))
    path.write_bytes(path.read_bytes() + b"\0\0\0")
    assert refused(path) == (
        f"'{LABEL}': 3 bytes after the last tensor 'a' belong to no tensor (data offsets 16..19); "
        "the safetensors library refuses a file whose tensors do not cover its data exactly"
    )
    _safetensors_refuses(path)


def test_bytes_after_a_header_without_tensors_are_refused(tmp_path):
    path = write_raw(tmp_path / "f", {"__metadata__": {"format": "pt"}}, b"xx")
    assert refused(path) == (
        f"'{LABEL}': 2 bytes after a header that lists no tensor belong to no tensor (data offsets 0..2); "
        "the safetensors library refuses a file whose tensors do not cover its data exactly"
    )
    _safetensors_refuses(path)


def test_an_empty_tensor_inside_another_overlaps_it(tmp_path):
    path = write_raw(tmp_path / "f", {
        "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
        "b": {"dtype": "U8", "shape": [0], "data_offsets": [4, 4]},
    }, bytes(8))
    assert refused(path) == f"'{LABEL}': tensors 'a' and 'b' overlap in the data buffer"
    _safetensors_refuses(path)


def test_a_deeply_nested_header_is_refused_cleanly(tmp_path):
    path = write_raw(tmp_path / "f", b'{"__metadata__":' + b"[" * 100_000 + b"]" * 100_000 + b"}")
    assert refused(path) == (
        f"'{LABEL}': safetensors header refused: nested too deeply (more levels of arrays and objects than "
        "ckpttool parses)"
    )


def test_the_audit_names_a_file_the_safetensors_library_refuses(cli, tmp_path):
    """``audit`` reports what ``from_pretrained`` would refuse as ``header-invalid`` on that file, exit 3."""
    from test_audit import reference, write_hf

    tensors, config = reference("llama_fsdp2_dcp")
    hf = write_hf(tmp_path / "hf", tensors, config, shards=2)
    shard = "model-00002-of-00002.safetensors"
    (hf / shard).write_bytes((hf / shard).read_bytes() + b"\0" * 4)
    result = cli("audit", hf, "--json")
    assert result.exit_code == 3, result.output
    invalid = [f for f in json.loads(result.stdout)["findings"] if f["code"] == "header-invalid"]
    assert len(invalid) == 1 and invalid[0]["file"] == shard and invalid[0]["severity"] == "error"
    assert re.fullmatch(
        rf"'{shard}': 4 bytes after the last tensor '[^']+' belong to no tensor \(data offsets \d+\.\.\d+\); "
        "the safetensors library refuses a file whose tensors do not cover its data exactly",
        invalid[0]["message"],
    ), invalid[0]["message"]
