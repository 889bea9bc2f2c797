"""The reference executor: a whole target tensor assembled in memory from its box copies.

The merge writes with the streaming executor (:mod:`ckpttool.execute.executor`), which never holds a whole tensor;
this one is the simple oracle the tests compare it with, the way the audit and ``diff`` read tensors, and
the loader of pieces stored as ``torch.save`` archives. Peak memory is one target tensor plus a small cache
of pieces that later targets still need.
"""

from __future__ import annotations

import io
import pickle
import re
from collections import Counter, OrderedDict
from dataclasses import replace
from pathlib import Path

from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import dtype_name, torch_dtype
from ckpttool.errors import SourceError, UnsafePickleError
from ckpttool.io.paths import open_inside
from ckpttool.quant.codecs import codec
from ckpttool.layout.layout import RAW, Box, Piece
from ckpttool.plan.plan import Target
from ckpttool.plan.transforms import transform_tensor

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
        with open_inside(self.root, piece.file) as f:  # a regular file inside the source, or a SourceError naming it
            try:
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


def assemble(target: Target, loader: PieceLoader) -> torch.Tensor:
    """The full target tensor, in the output dtype, built from its copies.

    A target that is one whole piece (a HuggingFace file, an unsharded DCP item) is the piece itself, not a copy.
    A computed target is its stored tensor and its scales (if any), whole, through its codec; a transformed target
    its pre tensor, whole, through its transform.
    """
    if target.transform is not None and target.dequant is None:
        pre = assemble(replace(target, shape=target.filled_shape, dtype=target.source_dtype, transform=None), loader)
        out = transform_tensor(target.transform, pre, target.name)
        return out if target.dtype == target.source_dtype else out.to(torch_dtype(target.dtype))
    if target.dequant is not None:  # (quantized after a transform: its stored tensor is the transform's output)
        stored = assemble(replace(target, shape=target.dequant.stored, dtype=target.source_dtype, dequant=None,
                                  scale=None), loader)
        out = torch.empty(target.shape, dtype=torch_dtype(target.dtype))
        scales = assemble(target.scale, loader) if target.scale is not None else None
        extra = {"aux": tuple(assemble(a, loader) for a in target.aux)} if target.aux else {}
        codec(target.dequant.method, target.dequant.params).decode(
            stored, scales, 0, out, lambda name, shape, dtype: torch.empty(shape, dtype=torch_dtype(dtype)), **extra)  # type: ignore[arg-type]
        return out
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


def _index(box: Box) -> tuple[slice, ...]:
    return tuple(slice(o, o + s) for o, s in zip(box.offsets, box.sizes))


def _first_line(e: Exception) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__
