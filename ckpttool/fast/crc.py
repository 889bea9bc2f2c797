"""CRC-32 (zlib's: the zip format's, the one ``torch.save`` records) at memory speed where the machine allows.

Every byte a split writes into a DCP item and every chunk the executor writes for its digest is CRC'd once. zlib
1.2's ``crc32`` (what Python's :mod:`zlib` calls on most Linux distributions) runs at about 1 GB/s: at 2 GiB it
was the largest CPU cost of ``split --to dcp`` after the kernel's copies. libdeflate's ``libdeflate_crc32``
computes the same CRC with the CPU's carry-less multiply, several times faster; it is a system library
(``libdeflate0`` on Debian), called through :mod:`ctypes`, which releases the GIL as zlib does. Where it cannot be
loaded (another system, or ``CKPTTOOL_CRC=zlib``), :func:`crc32` is :func:`zlib.crc32`: the same values, slower.

Example:
    >>> import zlib
    >>> crc32(b"abc") == zlib.crc32(b"abc"), crc32(b"c", crc32(b"ab")) == zlib.crc32(b"abc")
    (True, True)
"""

from __future__ import annotations

import ctypes
import os
import zlib
from collections.abc import Callable

__all__ = ["backend", "crc32"]

#: the system library's names tried, in order
LIBRARIES = ("libdeflate.so.0", "libdeflate.so", "libdeflate.dylib")
#: below this many bytes zlib is as fast as the call through ctypes costs
SMALL = 1 << 14


def _load(names: tuple[str, ...] = LIBRARIES) -> Callable[[int, int, int], int] | None:
    """``libdeflate_crc32(crc, address, length)`` of the first library of ``names`` that loads, or None."""
    if os.environ.get("CKPTTOOL_CRC", "") == "zlib":
        return None
    for name in names:
        try:
            function = ctypes.CDLL(name).libdeflate_crc32
        except (OSError, AttributeError):  # not installed here, or a library of that name without the function
            continue
        function.restype = ctypes.c_uint32
        function.argtypes = (ctypes.c_uint32, ctypes.c_void_p, ctypes.c_size_t)
        return function
    return None


_UNLOADED = object()
_libdeflate: object = _UNLOADED  # loaded at the first large CRC: a dry run never loads it


def _function() -> Callable[[int, int, int], int] | None:
    global _libdeflate
    if _libdeflate is _UNLOADED:
        _libdeflate = _load()
    return _libdeflate  # type: ignore[return-value]


def backend() -> str:
    """Which implementation :func:`crc32` uses for large buffers: ``"libdeflate"`` or ``"zlib"``."""
    return "zlib" if _function() is None else "libdeflate"


def crc32(data: bytes | bytearray | memoryview, value: int = 0) -> int:
    """``zlib.crc32(data, value)``, computed by libdeflate for a large, writable, contiguous buffer (the executor's
    and the digest's own buffers) when it is loaded; by zlib otherwise (a read-only ``bytes``: ctypes takes the
    address of writable buffers only, and numpy, which could take it, is not imported for a CRC)."""
    view = memoryview(data)
    large = view.nbytes >= SMALL and view.c_contiguous and not view.readonly
    function = _function() if large else None
    if function is None:
        return zlib.crc32(data, value)
    flat = view if view.format == "B" and view.ndim == 1 else view.cast("B")
    return function(value, ctypes.addressof(ctypes.c_char.from_buffer(flat)), flat.nbytes)
