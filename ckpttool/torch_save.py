"""Where the raw bytes of a tensor saved with ``torch.save`` lie, without loading it or running its pickle.

A ``torch.save`` file (or a byte range holding one, as each item of a DCP ``.distcp`` file is) is a zip archive
of stored (uncompressed) entries: ``<name>/data.pkl`` says which storage the tensor views and how, and
``<name>/data/<key>`` holds that storage's bytes. Reading the zip directory and walking the pickle's opcodes
with a recording unpickler that knows only the few names a plain tensor needs tells where the tensor's bytes
are, so it can be read with positioned reads like safetensors. Anything else (another layout, another type, a
compressed entry, big-endian data) gives None, and the caller falls back to ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import io
import math
import pickle
import struct
import zipfile
from dataclasses import dataclass
from typing import Any, BinaryIO

from .dtypes import dtype_name, itemsize
from .layout import c_strides

#: storage classes of torch.save pickles -> safetensors dtype names
_STORAGES = {
    "FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8",
    "BoolStorage": "BOOL",
}


@dataclass(frozen=True, slots=True)
class RawTensor:
    """A tensor's elements, contiguous in C order, at ``offset`` (relative to the archive's start)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int


def locate(f: BinaryIO, start: int, length: int) -> RawTensor | None:
    """The raw bytes of the one tensor saved in ``f[start:start+length]``, or None when they cannot be located."""
    try:
        archive = zipfile.ZipFile(_Window(f, start, length))
        pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            return None
        base = pickles[0][: -len("data.pkl")]
        if base + "byteorder" in archive.namelist() and archive.read(base + "byteorder") != b"little":
            return None
        tensor = _Recorder(io.BytesIO(archive.read(pickles[0]))).load()
        if not isinstance(tensor, _Tensor):
            return None
        entry = archive.getinfo(f"{base}data/{tensor.storage.key}")
        if entry.compress_type != zipfile.ZIP_STORED:
            return None
        size = itemsize(tensor.storage.dtype)
        contiguous = c_strides(tensor.shape)
        numel = math.prod(tensor.shape)
        if (numel > 1 and tensor.stride != contiguous) or entry.file_size != tensor.storage.numel * size:
            return None
        if tensor.offset < 0 or tensor.offset + numel > tensor.storage.numel:
            return None
        f.seek(start + entry.header_offset)
        header = f.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            return None
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        data = entry.header_offset + 30 + name_len + extra_len
        if data + entry.file_size > length:
            return None
        return RawTensor(tensor.storage.dtype, tensor.shape, data + tensor.offset * size)
    except (zipfile.BadZipFile, KeyError, pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
            AttributeError, struct.error, OSError, RecursionError):
        return None


@dataclass(frozen=True, slots=True)
class _Storage:
    dtype: str
    key: str
    numel: int


@dataclass(frozen=True, slots=True)
class _Tensor:
    storage: _Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild(storage: Any, offset: Any, shape: Any, stride: Any, *rest: Any) -> _Tensor:
    if not isinstance(storage, _Storage) or not isinstance(offset, int):
        raise pickle.UnpicklingError("not a plain tensor")
    if not all(isinstance(n, int) for n in (*shape, *stride)):
        raise pickle.UnpicklingError("not a plain tensor")
    return _Tensor(storage, offset, tuple(shape), tuple(stride))


class _Recorder(pickle.Unpickler):
    """Knows only what a plain tensor's pickle names; records instead of building anything."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild
        if (module, name) == ("collections", "OrderedDict"):
            return dict
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise pickle.UnpicklingError("unknown persistent id")
        _, dtype, key, _location, numel = pid
        if isinstance(dtype, str) and dtype in _STORAGES.values() and isinstance(numel, int) and numel >= 0:
            return _Storage(dtype_name(dtype), str(key), numel)
        raise pickle.UnpicklingError("unknown storage")


class _Window(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of ``f`` from ``start`` (what zipfile needs)."""

    def __init__(self, f: BinaryIO, start: int, length: int) -> None:
        self._f, self._start, self._length, self._pos = f, start, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._length}[whence]
        self._pos = max(0, base + offset)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        n = max(0, min(len(buffer), self._length - self._pos))
        self._f.seek(self._start + self._pos)
        got = self._f.readinto(memoryview(buffer)[:n])
        self._pos += got or 0
        return got or 0
