"""Carrying a plan out: each target assembled from its box copies, one tensor at a time.

Peak memory is one target tensor (plus its cast, when ``--dtype`` changes it) plus a small cache of recently
read pieces, never the model. Output headers are known from the plan before any data is written, and each
tensor lands at its precomputed offset with a positioned write, so a byte-level or parallel executor can
replace :func:`assemble` without changing the file layout.
"""

from __future__ import annotations

import hashlib
import io
import math
import os
import pickle
import re
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from .dtypes import dtype_name, itemsize, torch_dtype
from .errors import SourceError, UnsafePickleError
from .layout import RAW, Box, Piece
from .plan import Plan, Target

#: most bytes of pieces kept for later targets (a stacked expert piece feeds 2E targets)
CACHE_BYTES = 256 * 2**20


class PieceLoader:
    """Reads pieces from their files, keeping a piece in memory only while later targets still need it.

    A stacked expert piece feeds many per-expert targets: with ``uses`` (how many copies of the plan read
    each piece) it is read once and dropped after its last use. At most ``cache_bytes`` are kept; beyond
    that the oldest piece is dropped and read again when needed.
    """

    def __init__(self, root: str | Path, uses: Counter[Piece] | None = None, cache_bytes: int = CACHE_BYTES) -> None:
        self.root = Path(root)
        self.cache_bytes = cache_bytes
        self._uses = Counter(uses or {})
        self._cache: OrderedDict[Piece, torch.Tensor] = OrderedDict()
        self._cached = 0

    @classmethod
    def for_plan(cls, plan: Plan, cache_bytes: int = CACHE_BYTES) -> PieceLoader:
        return cls(plan.root, Counter(c.piece for t in plan.targets for c in t.copies), cache_bytes)

    def load(self, piece: Piece) -> torch.Tensor:
        self._uses[piece] -= 1
        tensor = self._cache.get(piece)
        if tensor is None:
            tensor = self._read(piece)
            if self._uses[piece] > 0:
                self._keep(piece, tensor)
        elif self._uses[piece] <= 0:
            self._drop(piece)
        return tensor

    def skip(self, pieces: Iterable[Piece]) -> None:
        """Count uses that will not happen (targets of a file kept from an earlier run)."""
        for piece in pieces:
            self._uses[piece] -= 1
            if self._uses[piece] <= 0 and piece in self._cache:
                self._drop(piece)

    def _keep(self, piece: Piece, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if nbytes > self.cache_bytes:
            return
        self._cache[piece] = tensor
        self._cached += nbytes
        while self._cached > self.cache_bytes:
            self._drop(next(iter(self._cache)))

    def _drop(self, piece: Piece) -> None:
        tensor = self._cache.pop(piece)
        self._cached -= tensor.numel() * tensor.element_size()

    def _read(self, piece: Piece) -> torch.Tensor:
        data = self._bytes(piece)
        dtype = torch_dtype(piece.dtype)
        if piece.encoding == RAW:
            if not data:
                return torch.empty(piece.box.sizes, dtype=dtype)
            return torch.frombuffer(data, dtype=dtype).reshape(piece.box.sizes)
        try:
            tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            refused = re.search(r"GLOBAL ([\w.]+)", str(e))
            if refused is None:
                raise SourceError(f"'{piece.file}': cannot load '{piece.key}': {_first_line(e)}") from None
            raise UnsafePickleError(
                f"'{piece.file}': '{piece.key}' was refused unread: its pickle asks for {refused.group(1)}, which is "
                "not a tensor or plain data; loading it could run code (torch.load weights_only=True)"
            ) from None
        except Exception as e:  # torch raises many types for truncated archives
            raise SourceError(f"'{piece.file}': cannot load '{piece.key}': {_first_line(e)}") from None
        if not isinstance(tensor, torch.Tensor) or tuple(tensor.shape) != piece.box.sizes or tensor.dtype != dtype:
            found = (
                f"{dtype_name(tensor.dtype)} {list(tensor.shape)}" if isinstance(tensor, torch.Tensor) else type(tensor).__name__
            )
            raise SourceError(
                f"'{piece.file}': '{piece.key}' holds {found} but the metadata records "
                f"{piece.dtype} {list(piece.box.sizes)}"
            )
        return tensor

    def _bytes(self, piece: Piece) -> bytearray:
        path = self.root / piece.file
        try:
            with open(path, "rb") as f:
                f.seek(piece.byte_offset)
                data = bytearray(piece.byte_length)
                got = f.readinto(data)
        except OSError as e:
            raise SourceError(f"'{piece.file}': cannot read '{piece.key}': {e.strerror or e}") from None
        if got != piece.byte_length:
            raise SourceError(
                f"'{piece.file}': '{piece.key}' needs {piece.byte_length} bytes at offset {piece.byte_offset} but "
                f"only {got} are there; the file is truncated"
            )
        return data


def predict_peak_bytes(plan: Plan, cache_bytes: int = CACHE_BYTES) -> int:
    """Upper bound of the memory the executor holds at once: the largest target in its source dtype, its
    cast copy when the dtype changes, the largest piece it reads, and pieces kept for later targets."""
    peak = 0
    uses = Counter(c.piece for t in plan.targets for c in t.copies)
    reused = sum(_nbytes(p) for p, n in uses.items() if n > 1)
    for t in plan.targets:
        source = math.prod(t.shape) * itemsize(t.source_dtype)
        cast = t.nbytes if t.dtype != t.source_dtype else 0
        piece = max((_nbytes(c.piece) for c in t.copies), default=0)
        peak = max(peak, source + cast + piece)
    return peak + min(cache_bytes, reused)


def _nbytes(piece: Piece) -> int:
    return math.prod(piece.box.sizes) * itemsize(piece.dtype)


def assemble(target: Target, loader: PieceLoader) -> torch.Tensor:
    """The full target tensor, in the output dtype, built from its copies.

    A target that is one whole piece (a HuggingFace file, an unsharded DCP item) is the piece itself, not a copy.
    """
    if len(target.copies) == 1 and target.copies[0].src == Box.whole(target.copies[0].piece.box.sizes):
        whole = loader.load(target.copies[0].piece).reshape(target.shape)
        return whole if target.dtype == target.source_dtype else whole.to(torch_dtype(target.dtype))
    out = torch.empty(target.shape, dtype=torch_dtype(target.source_dtype))
    for copy in target.copies:
        piece = loader.load(copy.piece)
        out[_index(copy.dst)] = piece[_index(copy.src)].reshape(copy.dst.sizes)
    if target.dtype != target.source_dtype:
        out = out.to(torch_dtype(target.dtype))
    return out


def write_file(
    path: Path,
    prefix: bytes,
    targets: list[tuple[Target, int]],
    loader: PieceLoader,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> str:
    """Write one safetensors file: the header ``prefix``, then each target at its buffer offset.

    Targets come in buffer order with no gaps (as :func:`~ckpttool.safetensors_format.encode_header` lays
    them out), so the sha256 of the bytes as they are written is the sha256 of the file, which is returned.
    """
    digest = hashlib.sha256(prefix)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        _write_all(fd, prefix, 0)
        position = 0
        for target, offset in targets:
            if offset != position:
                raise ValueError(f"'{target.name}' at buffer offset {offset}, expected {position}: targets out of order")
            tensor = assemble(target, loader)
            data = tensor.reshape(-1).view(torch.uint8).numpy()
            _write_all(fd, memoryview(data), len(prefix) + offset)
            digest.update(data)
            position += target.nbytes
            del tensor, data  # before the next target is assembled: one tensor alive at a time
            on_bytes(target.nbytes)
        os.fsync(fd)
    finally:
        os.close(fd)
    return digest.hexdigest()


def _write_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
