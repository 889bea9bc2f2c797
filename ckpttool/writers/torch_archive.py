"""One tensor as ``torch.save`` writes it, laid out before its elements exist, so they can be streamed in.

A DCP ``.distcp`` file is a run of ``torch.save`` archives, one per item (torch's ``FileSystemWriter`` calls
``torch.save(tensor, stream)`` for each). An archive is a zip of stored entries, each entry's data aligned to
64 bytes by an ``FB`` extra field of ``Z`` padding: ``archive/data.pkl`` (the pickle), ``.format_version``,
``.storage_alignment``, ``byteorder``, ``data/0`` (the tensor's elements, C order), ``version`` and
``.data/serialization_id``; every entry is followed by a data descriptor (CRC-32 and sizes), and the archive
ends with a central directory and zip64 end records. Entries past 4 GiB, or larger than 4 GiB, carry zip64
extra fields exactly where torch's writer (miniz) puts them.

:class:`TensorArchive` gives the bytes before the elements (:meth:`~TensorArchive.head`) and after them
(:meth:`~TensorArchive.tail`, which needs the elements' CRC-32): everything but the elements is known from the
shape and dtype alone. :func:`crc32_combine` joins the CRC-32 of chunks written by several threads.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import math
import struct
from dataclasses import dataclass, field

from ckpttool.io.dtypes import itemsize, torch_dtype_name
from ckpttool.layout.layout import c_strides
from ckpttool.writers.torch_globals import Call, Global, dumps

ALIGNMENT = 64
_MAX32 = 0xFFFFFFFF
_FLAGS = 0x0808  # a data descriptor follows the data; names are UTF-8 (as torch's writer sets them)
_LOCAL, _DESCRIPTOR, _CENTRAL = 0x04034B50, 0x08074B50, 0x02014B50
_ZIP64_END, _ZIP64_LOCATOR, _END = 0x06064B50, 0x07064B50, 0x06054B50


#: the typed storage class ``torch.save`` names for a dtype (torch's ``_dtype_to_storage_type_map``); a dtype
#: without one (float8) is saved as an ``UntypedStorage`` with ``_rebuild_tensor_v3``
TYPED_STORAGES = {
    "float64": "DoubleStorage", "float32": "FloatStorage", "float16": "HalfStorage", "bfloat16": "BFloat16Storage",
    "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage", "int8": "CharStorage",
    "uint8": "ByteStorage", "bool": "BoolStorage",
}
_REBUILD_V2 = Global("torch._utils", "_rebuild_tensor_v2")
_REBUILD_V3 = Global("torch._utils", "_rebuild_tensor_v3")
_UNTYPED = Global("torch.storage", "UntypedStorage")


class _Storage:
    """Stands for the tensor's storage in the pickle: the pickler writes its persistent id instead."""


@functools.lru_cache(maxsize=4096)  # a model's tensors share a few shapes; a split lays out one archive per chunk
def tensor_pickle(dtype: str, shape: tuple[int, ...]) -> bytes:
    """``archive/data.pkl`` of ``torch.save`` of a contiguous tensor (safetensors ``dtype`` name), byte for byte,
    without importing torch (:mod:`.torch_globals`): a typed storage class and ``_rebuild_tensor_v2`` where torch
    has one (float32, bfloat16, ...), else an ``UntypedStorage`` and ``_rebuild_tensor_v3`` with the dtype
    (float8), as ``Tensor.__reduce_ex__`` records a plain CPU tensor."""
    torch_name = torch_dtype_name(dtype)
    typed = TYPED_STORAGES.get(torch_name)
    numel = math.prod(shape)
    if typed is not None:
        storage_id = ("storage", Global("torch", typed), "0", "cpu", numel)
    else:
        storage_id = ("storage", _UNTYPED, "0", "cpu", numel * itemsize(dtype))
    storage = _Storage()
    args = (storage, 0, tuple(shape), c_strides(tuple(shape)), False, collections.OrderedDict())
    tensor = Call(_REBUILD_V2, args) if typed is not None else Call(_REBUILD_V3, (*args, Global("torch", torch_name)))
    return dumps(tensor, protocol=2, persistent_id=lambda obj: storage_id if obj is storage else None)


@dataclass(frozen=True, slots=True)
class _Entry:
    """One zip entry: where its local header starts (from the archive's start), its name and size."""

    offset: int
    name: bytes
    size: int

    @property
    def zip64(self) -> bool:
        return self.size >= _MAX32 or self.offset >= _MAX32

    def local_extra(self) -> bytes:
        """The zip64 field torch's writer puts in a local header (sizes for a large entry, the header's offset
        past 4 GiB), then the ``FB`` padding that aligns the data to :data:`ALIGNMENT`."""
        extra = self._zip64_field(local=True)
        start = self.offset + 30 + len(self.name) + len(extra) + 4
        pad = -start % ALIGNMENT
        return extra + b"FB" + struct.pack("<H", pad) + b"Z" * pad

    def _zip64_field(self, local: bool) -> bytes:
        """Sizes of a large entry (uncompressed, then compressed: 0 in the local header, which torch's writer
        fills before it has counted what it stored), the header's offset past 4 GiB."""
        values = [self.size, 0 if local else self.size] if self.size >= _MAX32 else []
        if self.offset >= _MAX32:
            values.append(self.offset)
        if not values:
            return b""
        return struct.pack("<HH", 1, 8 * len(values)) + struct.pack(f"<{len(values)}Q", *values)

    @property
    def data_offset(self) -> int:
        return self.offset + 30 + len(self.name) + len(self.local_extra())

    @property
    def flags(self) -> int:
        """An empty entry has no data descriptor (torch's writer then clears that flag)."""
        return _FLAGS if self.size else _FLAGS & ~0x0008

    @property
    def end(self) -> int:
        """Where the next entry starts: after the data and its descriptor (24 bytes with zip64, else 16)."""
        return self.data_offset + self.size + len(self.descriptor(0))

    def local_header(self) -> bytes:
        extra = self.local_extra()
        return (struct.pack("<IHHHHHIIIHH", _LOCAL, 0, self.flags, 0, 0, 0, 0, 0, 0, len(self.name), len(extra))
                + self.name + extra)

    def descriptor(self, crc: int) -> bytes:
        if not self.size:
            return b""
        if self.zip64:
            return struct.pack("<IIQQ", _DESCRIPTOR, crc, self.size, self.size)
        return struct.pack("<IIII", _DESCRIPTOR, crc, self.size, self.size)

    def central(self, crc: int) -> bytes:
        extra = self._zip64_field(local=False)
        size, offset = min(self.size, _MAX32), min(self.offset, _MAX32)
        return (struct.pack("<IHHHHHHIIIHHHHHII", _CENTRAL, 0, 0, self.flags, 0, 0, 0, crc, size, size, len(self.name),
                            len(extra), 0, 0, 0, 0, offset) + self.name + extra)


@dataclass(frozen=True)
class TensorArchive:
    """The ``torch.save`` archive of one tensor of ``shape`` and safetensors ``dtype``, its elements to come.

    ``serial`` becomes ``archive/.data/serialization_id`` (torch draws it at random; here it derives from what
    the caller names the item, so a split writes the same bytes every time).

    Example:
        >>> archive = TensorArchive("F32", (2, 3), "item")
        >>> archive.data_offset % 64, archive.nbytes, archive.length - len(archive.head()) - archive.nbytes > 0
        (0, 24, True)
    """

    dtype: str
    shape: tuple[int, ...]
    serial: str
    _entries: tuple[_Entry, ...] = field(init=False, repr=False, compare=False)
    #: where the elements start and the archive's length
    _where: tuple[int, int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        # where every entry lies depends on the dtype and shape alone (the serialization id is always 40 digits):
        # a split lays out one archive per chunk (92k for DeepSeek-V3), of a few shapes
        entries, where = _geometry(self.dtype, self.shape)
        object.__setattr__(self, "_entries", entries)
        object.__setattr__(self, "_where", where)

    @property
    def _small(self) -> dict[bytes, bytes]:
        """Every entry's bytes but the elements', by name."""
        return _small_entries(self.dtype, self.shape, _serial_id(self.serial))

    @property
    def nbytes(self) -> int:
        """The tensor's elements, in bytes."""
        return math.prod(self.shape) * itemsize(self.dtype)

    @property
    def _data(self) -> _Entry:
        return self._entries[4]

    @property
    def data_offset(self) -> int:
        """Where the elements start, from the archive's start (a multiple of 64)."""
        return self._where[0]

    @property
    def length(self) -> int:
        """The archive's size in bytes (what DCP's ``_StorageInfo.length`` records)."""
        return self._where[1]

    def head(self) -> bytes:
        """Every byte before the elements."""
        out, small = bytearray(), self._small
        for entry in self._entries[:4]:
            data = small[entry.name]
            out += entry.local_header() + data + entry.descriptor(_crc(data))
        return bytes(out + self._data.local_header())

    def tail(self, crc: int) -> bytes:
        """Every byte after the elements, given their CRC-32 (see :func:`crc32_combine` for chunks)."""
        small = self._small
        crcs = [crc if e is self._data else _crc(small[e.name]) for e in self._entries]
        out = bytearray(self._data.descriptor(crc))
        for entry in self._entries[5:]:
            data = small[entry.name]
            out += entry.local_header() + data + entry.descriptor(_crc(data))
        start = self._entries[-1].end
        directory = b"".join(e.central(c) for e, c in zip(self._entries, crcs))
        count = len(self._entries)
        end64 = start + len(directory)
        out += directory
        out += struct.pack("<IQHHIIQQQQ", _ZIP64_END, 44, 0x031E, 45, 0, 0, count, count, len(directory), start)
        out += struct.pack("<IIQI", _ZIP64_LOCATOR, 0, end64, 1)
        out += struct.pack("<IHHHHIIH", _END, 0, 0, count, count, min(len(directory), _MAX32), min(start, _MAX32), 0)
        return bytes(out)


def _serial_id(serial: str) -> bytes:
    """The 40-digit ``.data/serialization_id`` an archive of ``serial`` records (the same for the same name)."""
    number = int.from_bytes(hashlib.sha256(serial.encode()).digest(), "big") % 10**40
    return f"{number:040d}".encode()


def _small_entries(dtype: str, shape: tuple[int, ...], serial_id: bytes) -> dict[bytes, bytes]:
    """The bytes of a tensor archive's entries by name, in order (``archive/data/0``'s elements to come: empty)."""
    return {
        b"archive/data.pkl": tensor_pickle(dtype, shape), b"archive/.format_version": b"1",
        b"archive/.storage_alignment": str(ALIGNMENT).encode(), b"archive/byteorder": b"little",
        b"archive/data/0": b"", b"archive/version": b"3\n", b"archive/.data/serialization_id": serial_id,
    }


@functools.lru_cache(maxsize=4096)
def _geometry(dtype: str, shape: tuple[int, ...]) -> tuple[tuple[_Entry, ...], tuple[int, int]]:
    """Where each entry of a tensor archive lies (any 40-digit serialization id: they all have that length), where
    its elements start, and its length: the entries, the central directory, the zip64 end record and locator and
    the end record."""
    nbytes = math.prod(shape) * itemsize(dtype)
    entries, offset = [], 0
    for name, data in _small_entries(dtype, shape, b"0" * 40).items():
        entry = _Entry(offset, name, nbytes if name == b"archive/data/0" else len(data))
        entries.append(entry)
        offset = entry.end
    length = offset + sum(46 + len(e.name) + len(e._zip64_field(local=False)) for e in entries) + 56 + 20 + 22
    return tuple(entries), (entries[4].data_offset, length)


def _crc(data: bytes) -> int:
    import zlib

    return zlib.crc32(data)


# CRC-32 of a concatenation from the CRC-32 of its parts, as zlib's crc32_combine computes it: multiply the
# first CRC by x^(8 * len(second)) modulo the CRC polynomial (reflected), then add the second.
_POLY = 0xEDB88320


def _multiply(a: int, b: int) -> int:
    """``a * b`` modulo the CRC-32 polynomial, both in reflected bit order."""
    m, product = 1 << 31, 0
    while True:
        if a & m:
            product ^= b
            if a & (m - 1) == 0:
                return product
        m >>= 1
        b = (b >> 1) ^ _POLY if b & 1 else b >> 1


_POWERS = [1 << 30]  # x^(2^k) modulo the polynomial, k = 0..31
for _ in range(31):
    _POWERS.append(_multiply(_POWERS[-1], _POWERS[-1]))


def crc32_combine(first: int, second: int, second_length: int) -> int:
    """The CRC-32 of ``A + B`` from ``crc32(A)``, ``crc32(B)`` and ``len(B)``.

    Example:
        >>> import zlib
        >>> crc32_combine(zlib.crc32(b"ab"), zlib.crc32(b"cde"), 3) == zlib.crc32(b"abcde")
        True
    """
    power, k, n = 1 << 31, 3, second_length
    while n:
        if n & 1:
            power = _multiply(_POWERS[k & 31], power)
        n >>= 1
        k += 1
    return _multiply(power, first) ^ second


def object_archive(pickled: bytes, serial: str) -> bytes:
    """The whole ``torch.save`` archive of an object holding no tensor, given its pickle (``archive/data.pkl``):
    what torch's ``FileSystemWriter`` writes for a bytes item (Megatron's ``ShardedObject``, e.g. ``[None]`` for an
    empty ``_extra_state``). ``serial`` derives the serialization id, as for :class:`TensorArchive`.

    Example:
        >>> import io, pickle, torch
        >>> torch.load(io.BytesIO(object_archive(pickle.dumps([None], protocol=2), "x")), weights_only=True)
        [None]
    """
    serial_id = _serial_id(serial)
    before, entry, directory, end = _object_frame(pickled)  # all but the id and its CRC: 30k objects in a split
    crc = _crc(serial_id)
    return before + serial_id + entry.descriptor(crc) + directory + entry.central(crc) + end


@functools.lru_cache(maxsize=64)
def _object_frame(pickled: bytes) -> tuple[bytes, _Entry, bytes, bytes]:
    """An object archive's bytes up to its serialization id's data, that id's entry (last), the central directory
    before that entry's record, and the end records (any 40-digit serialization id: they all have that length)."""
    small = {b"archive/data.pkl": pickled, b"archive/.format_version": b"1",
             b"archive/.storage_alignment": str(ALIGNMENT).encode(), b"archive/byteorder": b"little",
             b"archive/version": b"3\n", b"archive/.data/serialization_id": b"0" * 40}
    out, entries = bytearray(), []
    for name, data in small.items():
        entry = _Entry(len(out), name, len(data))
        entries.append((entry, _crc(data)))
        out += entry.local_header() + data + entry.descriptor(_crc(data))
    last = entries[-1][0]
    before = bytes(out[:last.offset]) + last.local_header()
    start = len(out)
    directory = b"".join(e.central(crc) for e, crc in entries)
    count = len(entries)
    end = struct.pack("<IQHHIIQQQQ", _ZIP64_END, 44, 0x031E, 45, 0, 0, count, count, len(directory), start)
    end += struct.pack("<IIQI", _ZIP64_LOCATOR, 0, start + len(directory), 1)
    end += struct.pack("<IHHHHIIH", _END, 0, 0, count, count, len(directory), start, 0)
    return before, last, b"".join(e.central(crc) for e, crc in entries[:-1]), end
