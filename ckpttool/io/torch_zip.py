"""The zip records of a ``torch.save`` archive, read directly: the fast way to locate a DCP item's bytes.

A DCP ``.distcp`` file holds one ``torch.save`` archive per item, and a 671B-parameter model has ~90k items.
Opening each with :mod:`zipfile` costs ~0.5 ms (its objects, its seeks, its checks of what torch never
writes); what locating a tensor needs is in a few fixed-size records. :func:`read_archive` reads them with two
positioned reads of the item, at its tail (the end of central directory records and the central directory) and
at its head (the local headers of ``data.pkl``, ``byteorder`` and the data records, and the small entries'
bytes), and checks what :mod:`zipfile` would check of them: signatures, stored (uncompressed, unencrypted)
entries, the local header's name equal to the central one, the CRC-32 of every small entry it hands back.

It accepts only what torch's writer makes: one archive folder holding ``data.pkl``, ``byteorder``,
``version``, ``.format_version``, ``.storage_alignment``, ``.data/version``, ``.data/serialization_id`` and
``data/<key>`` records, nothing twice. Anything else (an extra record, a comment, a compressed entry, a
central directory larger than :data:`TAIL`) gives a reason instead, and the caller reads the item through
:mod:`zipfile` (:func:`ckpttool.io.torch_save.locate`); this module decides nothing about the pickle.
"""

from __future__ import annotations

import os
import re
import struct
import zlib
from dataclasses import dataclass
from typing import BinaryIO

#: bytes read at an item's tail: torch's central directory of 7 records and its end records take ~600
TAIL = 4096
#: bytes read at an item's head beyond the last data record's local header (its name and extra field)
HEAD_MARGIN = 512
#: at most this many bytes are read at an item's head (a plain tensor's records take ~1 KiB)
HEAD_LIMIT = 1 << 16
#: the entries torch's writer puts in an archive, after its folder name (besides ``data/<key>``)
KNOWN = frozenset({"data.pkl", "byteorder", "version", ".format_version", ".storage_alignment", ".data/version",
                   ".data/serialization_id"})
#: small entries whose bytes :func:`read_archive` returns (CRC-checked)
SMALL = ("data.pkl", "byteorder")
_DATA = re.compile(r"data/[0-9A-Za-z_]+")
_END = struct.Struct("<IHHHHIIH")  # end of central directory, 22 bytes
_LOCATOR = struct.Struct("<IIQI")  # zip64 end of central directory locator, 20 bytes
_END64 = struct.Struct("<IQHHIIQQQQ")  # zip64 end of central directory record, 56 bytes
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory file header, 46 bytes
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header, 30 bytes
_MAX16, _MAX32 = 0xFFFF, 0xFFFFFFFF


@dataclass(frozen=True, slots=True)
class Entry:
    """One record of the archive: where its data starts (from the archive's start) and how long it is."""

    data_offset: int
    size: int


@dataclass(frozen=True, slots=True)
class Archive:
    """What :func:`read_archive` found: the archive folder's name (with its ``/``), the ``data/<key>`` records
    by key, and the bytes of ``data.pkl`` and ``byteorder`` (absent when the archive has none)."""

    base: str
    data: dict[str, Entry]
    small: dict[str, bytes]


def read_archive(f: BinaryIO, start: int, length: int) -> Archive | str:
    """The records of the ``torch.save`` archive in ``f[start:start+length]``, or why they cannot be read this
    way (a short reason; the caller then reads the item through :mod:`zipfile`). Never raises for the bytes."""
    try:
        return _read(f, start, length)
    except (struct.error, UnicodeDecodeError, OSError, ValueError, IndexError) as e:
        return f"its zip records do not parse ({type(e).__name__})"


def _pread(f: BinaryIO, size: int, offset: int) -> bytes:
    try:
        return os.pread(f.fileno(), size, offset)
    except (AttributeError, OSError, ValueError):  # a buffer, not a file
        f.seek(offset)
        return f.read(size)


def _read(f: BinaryIO, start: int, length: int) -> Archive | str:
    if length < _END.size:
        return "too short to be a zip archive"
    tail_at = max(0, length - TAIL)
    tail = _pread(f, length - tail_at, start + tail_at)
    if len(tail) != length - tail_at:
        return "it ends before its storage entry says"
    sig, disk, cd_disk, _, count, cd_size, cd_offset, comment = _END.unpack_from(tail, len(tail) - _END.size)
    if sig != 0x06054B50 or comment or disk or cd_disk:
        return "no plain end of central directory record at its end"
    if count == _MAX16 or cd_size == _MAX32 or cd_offset == _MAX32:
        at = len(tail) - _END.size - _LOCATOR.size
        if at < 0:
            return "no zip64 locator"
        sig, _, end64, _ = _LOCATOR.unpack_from(tail, at)
        end64 -= tail_at
        if sig != 0x07064B50 or not 0 <= end64 <= len(tail) - _END64.size:
            return "its zip64 end record is not in its tail"
        sig, _, _, _, _, _, _, count, cd_size, cd_offset = _END64.unpack_from(tail, end64)
        if sig != 0x06064B50:
            return "a bad zip64 end record"
    at = cd_offset - tail_at
    if at < 0 or at + cd_size > len(tail):
        return f"its central directory is not in its last {TAIL} bytes"
    headers: dict[str, tuple[int, int, int]] = {}  # name -> (local header offset, size, crc)
    base = None
    for _ in range(count):
        (sig, _, _, flags, method, _, _, crc, csize, size, name_len, extra_len, comment_len, _, _, _,
         offset) = _CENTRAL.unpack_from(tail, at)
        if sig != 0x02014B50:
            return "a bad central directory record"
        name = tail[at + 46: at + 46 + name_len].decode()
        extra = tail[at + 46 + name_len: at + 46 + name_len + extra_len]
        at += 46 + name_len + extra_len + comment_len
        if at > len(tail):
            return "a central directory record past its end"
        if flags & 0x1 or method != 0:
            return f"record '{name}' is compressed or encrypted"
        if _MAX32 in (size, csize, offset):
            size, csize, offset = _zip64_values(extra, size, csize, offset)
        folder, _, rest = name.partition("/")
        if base is None:
            base = folder + "/"
        if not rest or folder + "/" != base or name in headers or not (rest in KNOWN or _DATA.fullmatch(rest)):
            return f"an unexpected record '{name}'"
        if csize != size:
            return f"record '{name}' is compressed"
        headers[name] = (offset, size, crc)
    if base is None or base + "data.pkl" not in headers:
        return "no data.pkl record"
    return _read_head(f, start, length, base, headers)


def _read_head(f: BinaryIO, start: int, length: int, base: str,
               headers: dict[str, tuple[int, int, int]]) -> Archive | str:
    """The local headers of the small entries and the data records, and the small entries' bytes, in one read."""
    wanted = [name for name in headers if name[len(base):] in SMALL or name.startswith(base + "data/")]
    end = max(headers[name][0] + 30 + len(name.encode()) + HEAD_MARGIN for name in wanted)
    small_end = max(headers[n][0] + 30 + len(n.encode()) + HEAD_MARGIN + headers[n][1]
                    for n in wanted if n[len(base):] in SMALL)
    size = min(length, max(end, small_end))
    if size > HEAD_LIMIT:
        return f"its records spread over more than its first {HEAD_LIMIT} bytes"
    head = _pread(f, size, start)
    if len(head) != size:
        return "it ends before its storage entry says"
    data: dict[str, Entry] = {}
    small: dict[str, bytes] = {}
    for name in wanted:
        offset, nbytes, crc = headers[name]
        if offset + _LOCAL.size > len(head):
            return f"the local header of '{name}' is not in its head"
        sig, _, _, _, _, _, _, _, _, name_len, extra_len = _LOCAL.unpack_from(head, offset)
        begin = offset + _LOCAL.size + name_len + extra_len
        if sig != 0x04034B50 or head[offset + 30: offset + 30 + name_len] != name.encode():
            return f"the local header of '{name}' does not match the central directory"
        if begin + nbytes > length:
            return f"record '{name}' runs past the item's end"
        if name.startswith(base + "data/"):
            data[name[len(base) + len("data/"):]] = Entry(begin, nbytes)
            continue
        if begin + nbytes > len(head):
            return f"record '{name}' is not in its head"
        content = head[begin: begin + nbytes]
        if zlib.crc32(content) != crc:
            return f"record '{name}' fails its CRC-32"
        small[name[len(base):]] = content
    return Archive(base, data, small)


def _zip64_values(extra: bytes, size: int, csize: int, offset: int) -> tuple[int, int, int]:
    """The sizes and offset a central record keeps in its zip64 extra field (those at 0xFFFFFFFF, in order)."""
    at = 0
    while at + 4 <= len(extra):
        kind, n = struct.unpack_from("<HH", extra, at)
        if kind == 1:
            values = list(struct.unpack_from(f"<{n // 8}Q", extra, at + 4))
            if size == _MAX32:
                size = values.pop(0)
            if csize == _MAX32:
                csize = values.pop(0)
            if offset == _MAX32:
                offset = values.pop(0)
            return size, csize, offset
        at += 4 + n
    raise ValueError("no zip64 extra field")


#: bytes :func:`read_first_pickle` reads at an item's head: torch's first record, ``data.pkl``, starts at byte 64 and
#: a plain tensor's pickle takes ~250 bytes, its data descriptor 16 or 24
FIRST = 1024
_DESCRIPTOR = b"PK\x07\x08"


def read_first_pickle(f: BinaryIO, start: int, length: int) -> bytes | str:
    """The bytes of the ``data.pkl`` record that opens the archive in ``f[start:start+length]``, from one positioned
    read of its first :data:`FIRST` bytes (no look at its central directory), or why they cannot be had that way.

    torch's writer puts ``data.pkl`` first; its local header may leave the sizes to a data descriptor after the
    bytes (flag bit 3: torch's does), which is then found and checked (its sizes and CRC-32). What this does not
    check, :func:`read_archive` does: that the central directory names this record and only records torch writes.
    A screen for a dry run, which reads no tensor byte; never raises for the bytes."""
    try:
        return _first_pickle(_pread(f, min(length, FIRST), start))
    except (struct.error, OSError, ValueError) as e:
        return f"its first record does not parse ({type(e).__name__})"


def _first_pickle(head: bytes) -> bytes | str:
    if len(head) < _LOCAL.size:
        return "too short to be a zip archive"
    sig, _, flags, method, _, _, crc, csize, size, name_len, extra_len = _LOCAL.unpack_from(head)
    name = head[_LOCAL.size: _LOCAL.size + name_len]
    begin = _LOCAL.size + name_len + extra_len
    if sig != 0x04034B50 or not (name == b"data.pkl" or name.endswith(b"/data.pkl")) or name.count(b"/") > 1:
        return "its first record is not data.pkl"
    if flags & 0x1 or method != 0:
        return "its data.pkl is compressed or encrypted"
    if not flags & 0x8:  # the sizes are in the local header
        if csize != size or begin + size > len(head):
            return f"its data.pkl is not within its first {len(head)} bytes"
        content = head[begin: begin + size]
        return content if zlib.crc32(content) == crc else "its data.pkl fails its CRC-32"
    at = head.find(_DESCRIPTOR, begin)
    while at >= 0:  # the first descriptor whose sizes and CRC fit the bytes before it
        content = head[begin:at]
        for fmt in ("<III", "<IQQ"):
            if at + 4 + struct.calcsize(fmt) <= len(head):
                crc, csize, size = struct.unpack_from(fmt, head, at + 4)
                if csize == size == len(content) and zlib.crc32(content) == crc:
                    return content
        at = head.find(_DESCRIPTOR, at + 1)
    return f"no data descriptor of its data.pkl within its first {len(head)} bytes"
