"""The safetensors file format, read and written without loading any tensor.

A file is: 8 bytes little-endian ``N``, then ``N`` bytes of JSON header, then the data buffer. The header maps
each tensor name to ``{"dtype", "shape", "data_offsets": [begin, end]}`` (offsets relative to the buffer) and may
hold ``"__metadata__"``: a string-to-string map. The header is padded with spaces to a multiple of 8 bytes.
As the safetensors library requires, the tensors' byte ranges, in order, cover the buffer exactly (no gap, no
overlap, no byte after the last) and no key appears twice.
"""

from __future__ import annotations

import json
import math
import operator
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import repeat

from ckpttool.io import jsonfile
from ckpttool.io.dtypes import ITEMSIZES, SAFETENSORS_DTYPES, itemsize
from ckpttool.errors import SourceError
from ckpttool.fast.frozen import quick_init
from ckpttool.io.paths import open_source

#: headers larger than this are refused before being read (safetensors itself uses the same bound)
MAX_HEADER_BYTES = 100_000_000


@quick_init  # built 90k times in a plan: see ckpttool.fast.frozen
@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor of a safetensors file: dtype, shape, and absolute byte range in the file."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


@dataclass(frozen=True, slots=True)
class Header:
    entries: dict[str, Entry]
    metadata: dict[str, str]
    data_start: int


def read_header(path: str | os.PathLike[str], name: str | None = None) -> Header:
    """Parse and validate the header of a safetensors file.

    Args:
        path: the file.
        name: how to call the file in messages (default: the path).

    Raises:
        SourceError: truncated file, header length past the end, bad JSON, a key twice in the header, unknown
            dtype, offsets outside the file, overlapping tensors, bytes between or after the tensors, or a byte
            count that disagrees with the shape.
    """
    label = name or str(path)
    try:
        with open_source(path, label) as f:  # a regular file, or a SourceError naming it
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise SourceError(f"'{label}': truncated safetensors file ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                raise SourceError(f"'{label}': safetensors header of {n} bytes exceeds the {MAX_HEADER_BYTES} limit")
            if 8 + n > size:
                raise SourceError(
                    f"'{label}': safetensors header length {n} runs past the end of the file ({size} bytes); "
                    "the file is truncated or not safetensors"
                )
            raw = f.read(n)
    except OSError as e:
        raise SourceError(f"'{label}': cannot read: {e.strerror or e}") from None
    try:
        header = jsonfile.loads(raw, unique_keys=True)
    except jsonfile.JSONRefused as e:
        raise SourceError(f"'{label}': safetensors header refused: {e}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"'{label}': safetensors header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise SourceError(f"'{label}': safetensors header is not a JSON object")
    metadata = header.pop("__metadata__", None)
    metadata = {} if metadata is None else metadata
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise SourceError(f"'{label}': safetensors __metadata__ must map strings to strings")
    data_start = 8 + n
    buffer = size - data_start
    entries = _well_formed(header, data_start, buffer, size)
    if entries is None:  # something is wrong: the checks one tensor at a time name it
        entries = {key: _entry(label, key, info, data_start, buffer) for key, info in header.items()}
        _check_contiguous(label, entries, data_start, size)
    return Header(entries, metadata, data_start)


def _well_formed(header: dict[str, object], data_start: int, buffer: int, size: int) -> dict[str, Entry] | None:
    """The entries of a header that passes every check of :func:`_entry` and :func:`_check_contiguous`, checked
    a whole header at a time (a file of DeepSeek-V3 holds ~550 tensors, a checkpoint 90k); None when any check
    fails, for those functions to find which and say so. Accepts only what they accept."""
    try:
        records = [(info["dtype"], info["shape"], info["data_offsets"]) for info in header.values()]
        dtypes, shapes, offsets = zip(*records) if records else ((), (), ())
        if not set(dtypes) <= SAFETENSORS_DTYPES or not set(map(type, shapes)) <= {list}:
            return None
        if not set(map(type, offsets)) <= {list} or not set(map(len, offsets)) <= {2}:
            return None
    except (TypeError, KeyError):  # a record that is no dict, lacks a field, or holds an unhashable dtype
        return None
    dims = [d for shape in shapes for d in shape]
    bounds = [o for pair in offsets for o in pair]
    if not set(map(type, dims)) <= {int} or not set(map(type, bounds)) <= {int} or min(dims, default=0) < 0:
        return None
    begins, ends = bounds[0::2], bounds[1::2]  # each tensor's offsets and byte count checked a list at a time
    if min(begins, default=0) < 0 or max(ends, default=0) > buffer:
        return None
    needed = map(operator.mul, map(math.prod, shapes), map(ITEMSIZES.__getitem__, dtypes))
    if list(map(operator.sub, ends, begins)) != list(needed):
        return None
    start = repeat(data_start)
    entries = dict(zip(header, map(Entry, dtypes, map(tuple, shapes), map(operator.add, begins, start),
                                   map(operator.add, ends, start))))
    spans = sorted(zip(begins, ends))
    position = 0
    for begin, end in spans:  # the tensors tile the data buffer: no gap, no overlap, nothing after
        if begin != position:
            return None
        position = end
    return entries if position == size - data_start else None


def _entry(label: str, key: str, info: object, data_start: int, buffer: int) -> Entry:
    if not isinstance(info, dict):
        raise SourceError(f"'{label}': tensor '{key}' has no dtype/shape/data_offsets record")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if not isinstance(dtype, str) or dtype not in SAFETENSORS_DTYPES:
        raise SourceError(f"'{label}': tensor '{key}' has unsupported dtype {dtype!r}")
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise SourceError(f"'{label}': tensor '{key}' has an invalid shape {shape!r}")
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise SourceError(f"'{label}': tensor '{key}' has invalid data_offsets {offsets!r}")
    expected = math.prod(shape) * itemsize(dtype)
    if offsets[1] - offsets[0] != expected:
        raise SourceError(
            f"'{label}': tensor '{key}' holds {offsets[1] - offsets[0]} bytes but shape {shape} of {dtype} "
            f"needs {expected}"
        )
    if offsets[1] > buffer:
        raise SourceError(
            f"'{label}': tensor '{key}' data_offsets {offsets} run past the end of the data ({buffer} bytes); "
            "the file is truncated"
        )
    return Entry(dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _check_contiguous(label: str, entries: Mapping[str, Entry], data_start: int, size: int) -> None:
    """In the order of their offsets, the tensors must tile the data buffer: no overlap, no gap, no byte after
    the last. The safetensors library refuses any other file ("invalid offset", "incomplete metadata, file not
    fully covered"), so a file that passes here is one ``from_pretrained`` loads."""
    position, last = data_start, ""
    for key, e in sorted(entries.items(), key=lambda kv: (kv[1].begin, kv[1].end)):
        if e.begin < position:
            raise SourceError(f"'{label}': tensors '{last}' and '{key}' overlap in the data buffer")
        if e.begin > position:
            where = f"after tensor '{last}'" if last else "at the start of the data buffer"
            raise SourceError(
                f"'{label}': {e.begin - position} bytes {where} belong to no tensor (data offsets "
                f"{position - data_start}..{e.begin - data_start}, before tensor '{key}'); {_NOT_COVERED}"
            )
        position, last = e.end, key
    if position < size:
        where = f"after the last tensor '{last}'" if last else "after a header that lists no tensor"
        raise SourceError(
            f"'{label}': {size - position} bytes {where} belong to no tensor (data offsets "
            f"{position - data_start}..{size - data_start}); {_NOT_COVERED}"
        )


_NOT_COVERED = "the safetensors library refuses a file whose tensors do not cover its data exactly"


def encode_header(entries: Mapping[str, tuple[str, tuple[int, ...]]], metadata: Mapping[str, str]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Build the header bytes for tensors laid out in the given order.

    The text is ``json.dumps(header, separators=(",", ":"))`` of ``{"__metadata__": ..., name: {"dtype", "shape",
    "data_offsets"}, ...}``, written entry by entry (a 90k-tensor header: a fifth of the time of building the
    dicts and encoding them; tests/test_file_copies.py compares the two).

    Args:
        entries: name -> (dtype, shape), in the order the data will be written.
        metadata: the ``__metadata__`` map.

    Returns:
        The full prefix (8-byte length + padded JSON) and each tensor's ``(begin, end)`` relative to the buffer.
    """
    if "__metadata__" in entries:  # a tensor of that name would replace the metadata: the dicts say how
        return _encode_header_dicts(entries, metadata)
    offsets: dict[str, tuple[int, int]] = {}
    parts = ['{"__metadata__":', json.dumps(dict(metadata), separators=(",", ":"))]
    quote, shapes = json.encoder.encode_basestring_ascii, {}
    pos = 0
    for name, (dtype, shape) in entries.items():
        nbytes = math.prod(shape) * itemsize(dtype)
        offsets[name] = (pos, pos + nbytes)
        key = (dtype, shape)
        head = shapes.get(key)
        if head is None:  # the entry's text up to its offsets, once per dtype and shape
            head = shapes[key] = f':{{"dtype":{quote(dtype)},"shape":[{",".join(map(str, shape))}],"data_offsets":['
        parts.append(f",{quote(name)}{head}{pos},{pos + nbytes}]}}")
        pos += nbytes
    parts.append("}")
    text = "".join(parts).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def _encode_header_dicts(entries: Mapping[str, tuple[str, tuple[int, ...]]], metadata: Mapping[str, str]) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """:func:`encode_header` by building the header's dicts and encoding them."""
    offsets: dict[str, tuple[int, int]] = {}
    header: dict[str, object] = {"__metadata__": dict(metadata)}
    pos = 0
    for name, (dtype, shape) in entries.items():
        nbytes = math.prod(shape) * itemsize(dtype)
        offsets[name] = (pos, pos + nbytes)
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, offsets
