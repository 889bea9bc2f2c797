"""``torch.save`` archives laid out before their elements exist (``ckpttool.writers.torch_archive``).

Every byte must be the one ``torch.save`` writes for the same tensor, except the 40 digits of
``.data/serialization_id`` (torch draws them at random) and that entry's CRC-32; zip64 entries (elements of
4 GiB or more, entries past 4 GiB) included. ``torch.load``, Python's ``zipfile`` and ckpttool's own reader
read the result.
"""

from __future__ import annotations

import io
import random
import struct
import zipfile
import zlib

import pytest
import torch

from ckpttool.io.dtypes import dtype_name
from ckpttool.io.torch_save import locate
from ckpttool.writers.torch_archive import TensorArchive, crc32_combine

SERIAL = b"archive/.data/serialization_id"


def masked(archive: bytes) -> bytes:
    """The archive with the serialization id's digits and its two CRC-32 fields zeroed."""
    out = bytearray(archive)
    local = out.index(SERIAL)
    name_len, extra_len = struct.unpack("<HH", out[local - 4:local])
    data = local + name_len + extra_len
    out[data:data + 40] = b"0" * 40
    out[data + 44:data + 48] = bytes(4)  # the data descriptor's CRC
    central = out.rindex(SERIAL) - 46
    out[central + 16:central + 20] = bytes(4)
    return bytes(out)


def written(tensor: torch.Tensor, serial: str = "t") -> bytes:
    archive = TensorArchive(dtype_name(tensor.dtype), tuple(tensor.shape), serial)
    data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b""
    return archive.head() + data + archive.tail(zlib.crc32(data))


def saved(tensor: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return buffer.getvalue()


TENSORS = {
    "f32 matrix": torch.arange(6, dtype=torch.float32).reshape(2, 3),
    "empty": torch.empty(0, 32),
    "bf16 scalar": torch.tensor(3.0, dtype=torch.bfloat16),
    "fp8 (untyped storage, _rebuild_tensor_v3)": torch.arange(5, dtype=torch.float32).to(torch.float8_e4m3fn),
    "bool": torch.tensor([True, False, True]),
    "f16 3-d": torch.randn(7, 3, 5, generator=torch.Generator().manual_seed(0)).half(),
    "i64": torch.arange(300, dtype=torch.int64),
}


@pytest.mark.parametrize("tensor", TENSORS.values(), ids=TENSORS.keys())
def test_the_bytes_are_torch_saves(tensor):
    mine, theirs = written(tensor), saved(tensor)
    assert len(mine) == TensorArchive(dtype_name(tensor.dtype), tuple(tensor.shape), "t").length == len(theirs)
    assert masked(mine) == masked(theirs)
    assert mine != theirs  # only the serialization id (and its CRC) differs
    loaded = torch.load(io.BytesIO(mine), weights_only=True)
    assert loaded.dtype == tensor.dtype and loaded.shape == tensor.shape
    assert torch.equal(loaded.reshape(-1).view(torch.uint8), tensor.reshape(-1).view(torch.uint8))
    assert zipfile.ZipFile(io.BytesIO(mine)).testzip() is None  # every CRC-32 right


def test_ckpttool_reads_the_elements_in_place():
    tensor = TENSORS["f16 3-d"]
    data = written(tensor)
    found = locate(io.BytesIO(b"x" * 100 + data), 100, len(data))
    assert found is not None and found.shape == (7, 3, 5) and found.dtype == "F16"
    start = found.byte_offset()
    assert start == TensorArchive("F16", (7, 3, 5), "t").data_offset and start % 64 == 0
    assert data[start:start + tensor.numel() * 2] == tensor.reshape(-1).view(torch.uint8).numpy().tobytes()


def test_the_serialization_id_follows_the_name_given():
    tensor = TENSORS["i64"]
    assert written(tensor, "a") == written(tensor, "a") != written(tensor, "b")


class _Sink:
    """What ``torch.save`` writes, without the elements: small writes kept, large ones counted."""

    def __init__(self) -> None:
        self.head, self.tail, self.size = bytearray(), bytearray(), 0

    def write(self, data) -> int:
        view = memoryview(data)
        if len(view) > 4096:
            self.size = len(view)
        else:
            (self.tail if self.size else self.head).extend(view)
        return len(view)

    def flush(self) -> None:
        pass


def test_zip64_entries_are_laid_out_as_torch_writes_them():
    """4 GiB + 100 bytes of elements: zip64 sizes in the local header and the central directory, 24-byte data
    descriptors, the entries after it located past 4 GiB (their header offsets in zip64 fields)."""
    tensor = torch.empty(2**32 + 100, dtype=torch.uint8)  # never touched: no memory is used
    sink = _Sink()
    torch.save(tensor, sink)
    archive = TensorArchive("U8", (2**32 + 100,), "t")
    crc = struct.unpack("<I", sink.tail[4:8])[0]  # torch's CRC of the elements, from its data descriptor
    assert sink.size == archive.nbytes and len(archive.head()) == archive.data_offset
    assert archive.length == len(sink.head) + sink.size + len(sink.tail)
    assert masked(archive.head() + archive.tail(crc)) == masked(bytes(sink.head + sink.tail))


def test_crc32_of_chunks_combines_into_the_crc32_of_the_whole():
    rng = random.Random(0)
    data = rng.randbytes(10_000)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(data)), rng.randint(1, 6)))
        crc = 0
        for a, b in zip([0, *cuts], [*cuts, len(data)]):
            crc = crc32_combine(crc, zlib.crc32(data[a:b]), b - a)
        assert crc == zlib.crc32(data)
    assert crc32_combine(zlib.crc32(b"abc"), zlib.crc32(b""), 0) == zlib.crc32(b"abc")
