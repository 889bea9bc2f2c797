"""Reading ``torch.save`` files without loading their tensors or running their pickles.

A ``torch.save`` file (or a byte range holding one, as each item of a DCP ``.distcp`` file is) is a zip archive
of stored (uncompressed) entries: ``<name>/data.pkl`` is the pickled object, and ``<name>/data/<key>`` holds
the bytes of each storage its tensors view. :func:`scan` walks the pickle with :mod:`ckpttool.io.torch_pickle`'s unpickler, which knows only
plain containers, tensors, ``torch.Size``, dtypes and the stand-ins a reader allows for its format (an
``argparse.Namespace`` of training args, say); every tensor becomes a :class:`StoredTensor` that says where
its bytes lie, so it can be read with positioned reads like safetensors. Anything else is refused by name
before it is built: nothing in a checkpoint can run code.
"""

from __future__ import annotations

import io
import logging
import math
import pickle
import struct
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckpttool.io.dtypes import itemsize
from ckpttool.layout.layout import c_strides
from ckpttool.errors import PickleBombError, SourceError
from ckpttool.io.pickle_bounds import bound_graph, budget
from ckpttool.io.torch_pickle import Allow, PendingTensor, Unpickler, plain_tensor
from ckpttool.io.torch_zip import read_archive

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredTensor:
    """A tensor of a ``torch.save`` archive, not loaded: its dtype, shape and where its elements lie.

    Attributes:
        dtype: safetensors dtype name.
        shape, stride: as saved (elements).
        storage: the storage's key in the archive; tensors that share it are views of one buffer.
        element_offset: where the view starts in its storage (elements).
        data_offset: where the storage's bytes start, relative to the archive's start; None when the entry is
            compressed or missing, or the data is big-endian (then only ``torch.load`` can read it).
        storage_numel: elements the storage holds.
    """

    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage: str
    element_offset: int
    data_offset: int | None
    storage_numel: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        return self.numel <= 1 or self.stride == c_strides(self.shape)

    def byte_offset(self) -> int | None:
        """Where the elements start (relative to the archive) when they are contiguous, C-order and in place."""
        if self.data_offset is None or not self.contiguous:
            return None
        if self.element_offset < 0 or self.element_offset + self.numel > self.storage_numel:
            return None
        return self.data_offset + self.element_offset * itemsize(self.dtype)

    def required_offset(self, label: str, key: str) -> int:
        """:meth:`byte_offset`, or a :class:`SourceError` naming the file and the tensor when there is none."""
        offset = self.byte_offset()
        if offset is None:
            raise SourceError(f"'{label}': '{key}' is not stored contiguously in place; ckpttool cannot read it")
        return offset


def scan(f: BinaryIO, start: int = 0, length: int | None = None, *, label: str, allow: Allow | None = None) -> Any:
    """The object saved in ``f[start:start+length]`` with every tensor as a :class:`StoredTensor`.

    Args:
        f: an open binary file (or buffer).
        start, length: the archive's byte range in ``f``; by default the whole file.
        label: the file's name for error messages.
        allow: stand-ins for the non-tensor classes the format's pickles name.

    Raises:
        UnsafePickleError: the pickle names a class that is not a tensor, a container or in ``allow``.
        PickleBombError: reading the pickle would take work without bound (:mod:`ckpttool.io.pickle_bounds`).
        SourceError: not a ``torch.save`` archive (truncated, garbage, the legacy non-zip format).
    """
    if length is None:
        f.seek(0, io.SEEK_END)
        length = f.tell() - start
    try:
        archive = zipfile.ZipFile(_Window(f, start, length))
        names = archive.namelist()
        pickles = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pickles) != 1:
            raise SourceError(f"'{label}': not a torch.save archive ({len(pickles)} data.pkl entries)")
        base = pickles[0][: -len("data.pkl")]
        little = base + "byteorder" not in names or archive.read(base + "byteorder") == b"little"
        data = archive.read(pickles[0])
        unpickler = Unpickler(io.BytesIO(data), label, {} if allow is None else allow)
        with budget(label, len(data)):
            obj = unpickler.load()
        bound_graph(obj, label)
        offsets = {key: _data_offset(f, start, length, archive, f"{base}data/{key}", s.numel * itemsize(s.dtype))
                   if little else None for key, s in unpickler.storages.items()}
    except SourceError:
        raise
    except (zipfile.BadZipFile, KeyError, pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError,
            AttributeError, struct.error, OSError, RecursionError, OverflowError, ZeroDivisionError) as e:
        raise SourceError(f"'{label}': cannot read it as a torch.save archive ({type(e).__name__}: {e}); is it truncated?") from None
    return _resolve(obj, offsets, {})


def locate(f: BinaryIO, start: int, length: int, *, label: str = "item", item: str = "") -> StoredTensor | None:
    """The one contiguous tensor saved in ``f[start:start+length]`` when its raw bytes can be located, else None
    (the caller falls back to ``torch.load(weights_only=True)``). ``label`` names the file in errors, ``item``
    the item in the log.

    An archive as torch writes it is located from its zip records (:mod:`ckpttool.io.torch_zip`: two positioned
    reads) and its ``data.pkl`` through the same safe unpickler, once per distinct pickle: a checkpoint's
    items of one shape and dtype pickle to the same bytes. Anything else (an extra record, a pickle that is
    not one plain tensor, a data record of the wrong size) is read as before, through :func:`scan`, and logged
    (debug) with the reason.

    Raises:
        PickleBombError: the item's pickle would take work without bound; ``torch.load`` must not read it either.
    """
    fast = _locate_fast(f, start, length)
    if isinstance(fast, StoredTensor):
        return fast
    log.debug("'%s': item %s at bytes %d..%d: %s; reading it through zipfile", label, repr(item) if item else "",
              start, start + length, fast)
    try:
        found = scan(f, start, length, label=label)
    except PickleBombError:
        raise
    except SourceError:
        return None
    if not isinstance(found, StoredTensor) or found.byte_offset() is None:
        return None
    return found


def _locate_fast(f: BinaryIO, start: int, length: int) -> StoredTensor | str:
    """:func:`locate`'s answer from the zip records alone, or why it cannot be given that way."""
    archive = read_archive(f, start, length)
    if isinstance(archive, str):
        return archive
    if archive.small.get("byteorder", b"little") != b"little":
        return "it is not little-endian"
    pending = plain_tensor(archive.small["data.pkl"])
    if pending is None:
        return "its data.pkl is not one plain tensor"
    stored = pending.storage
    entry = archive.data.get(stored.key)
    nbytes = stored.numel * itemsize(stored.dtype)
    if list(archive.data) != [stored.key] or entry is None or entry.size != nbytes:
        return f"its data records {sorted(archive.data)} are not one record 'data/{stored.key}' of {nbytes} bytes"
    found = StoredTensor(stored.dtype, pending.shape, pending.stride, stored.key, pending.offset, entry.data_offset,
                         stored.numel)
    return found if found.byte_offset() is not None else "its tensor is not stored contiguously in place"


def _data_offset(f: BinaryIO, start: int, length: int, archive: zipfile.ZipFile, name: str, nbytes: int) -> int | None:
    try:
        entry = archive.getinfo(name)
    except KeyError:
        return None
    if entry.compress_type != zipfile.ZIP_STORED or entry.file_size != nbytes:
        return None
    f.seek(start + entry.header_offset)
    header = f.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        return None
    name_len, extra_len = struct.unpack("<HH", header[26:30])
    data = entry.header_offset + 30 + name_len + extra_len
    return data if data + entry.file_size <= length else None


def _resolve(obj: Any, offsets: Mapping[str, int | None], done: dict[int, Any]) -> Any:
    """``obj`` with every pending tensor replaced by a :class:`StoredTensor` (containers rebuilt, others kept).

    Each object is resolved once (``done``: ``id`` -> result), so what the pickle shares stays shared and the work
    is linear; :func:`~ckpttool.io.pickle_bounds.bound_graph` has refused cycles and deep nesting before."""
    key = id(obj)
    if key in done:
        return done[key]
    if isinstance(obj, PendingTensor):
        result: Any = StoredTensor(obj.storage.dtype, obj.shape, obj.stride, obj.storage.key, obj.offset,
                                   offsets.get(obj.storage.key), obj.storage.numel)
    elif isinstance(obj, dict):
        result = {k: _resolve(v, offsets, done) for k, v in obj.items()}
    elif isinstance(obj, list):
        result = [_resolve(v, offsets, done) for v in obj]
    elif isinstance(obj, tuple) and type(obj) is tuple:
        result = tuple(_resolve(v, offsets, done) for v in obj)
    else:
        result = obj
        if hasattr(obj, "__dict__") and not isinstance(obj, type):
            for k, v in vars(obj).items():
                setattr(obj, k, _resolve(v, offsets, done))
    done[key] = result
    return result


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
