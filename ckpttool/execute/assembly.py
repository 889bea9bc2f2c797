"""A chunk's values, assembled from its pieces (:func:`build`): what the streaming executor
(:mod:`ckpttool.execute.executor`) writes, and the audit and the LoRA checks read.

For a chunk, every copy of the plan that meets its rows gives a region of its piece; a region is read with one
``pread`` of the smallest byte range that holds it (a dim-0 piece gives whole rows: one run; a dim-1 piece gives the
chunk's rows of that piece: again one run) and laid into the chunk as a strided view, with numpy's copy on the
worker's own thread (:func:`_place`). A chunk covered by one contiguous region is the read buffer itself; rows
that one raw piece of the tensor's very shape holds as they are (:func:`_read_rows`) are one ``pread``.

A computed target (:class:`~ckpttool.plan.plan.Dequantize`: dequantized, or FP8-quantized in whole block rows)
is not copied: the source and scale rows its codec (:mod:`ckpttool.quant.codecs`) names are gathered the same way,
and the codec writes the chunk's values, with its temporaries on the thread's buffers too. A transformed target
(:mod:`ckpttool.plan.transforms`) gathers the pre rows its transform names, as any rows are gathered, and the
transform writes the chunk from them on the thread's buffers. A fused target (:mod:`ckpttool.plan.lora`) adds its
adapters' product to its rows. A target that is one raw piece copied whole in its own dtype needs no assembly: its
bytes lie in its file as the output holds them (:func:`direct_offset`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import itemsize
from ckpttool.errors import SourceError
from ckpttool.quant.codecs import codec
from ckpttool.quant.decode import BadScale
from ckpttool.execute.buffers import Chunk, chunk_rows, row_box, transformed_rows
from ckpttool.layout.layout import RAW, Box, Piece, Shape
from ckpttool.plan.tiling import Copy
from ckpttool.execute.reads import Reader
from ckpttool.layout.regions import dim_map, map_region
from ckpttool.plan.lora import fuse_rows

__all__ = ["build", "direct_offset", "direct_rows"]


def build(chunk: Chunk, reader: Reader, *, check_scales: bool = True) -> torch.Tensor:
    """The chunk's elements in the output dtype, C order (a view of the read buffer when one region fills it).

    Raises:
        SourceError: with ``check_scales`` (what is written: a merge, a split), a dequantized chunk whose scale
            rows hold a NaN or infinite scale, which would make its block NaN or infinite; the audit passes False
            to count such values in its findings instead.
    """
    target = chunk.target
    if target.dequant is not None:
        return _dequantize(chunk, reader, check_scales)
    if target.transform is not None:  # the pre rows it names, gathered as any rows are, then its map
        pre = _gather(target.copies, transformed_rows(chunk), target.source_dtype, reader, "chunk")
        out = target.transform.apply(pre, target.shape, chunk.start, chunk.stop, target.source_dtype, reader.scratch)
    else:
        out = _gather(target.copies, chunk_rows(chunk), target.source_dtype, reader, "chunk", view=not target.lora)
    if target.lora:  # W + scale * B @ A on these rows (the thread's own copy), as PEFT's merge adds it, before any cast
        out = fuse_rows(out, target.lora, chunk.start, chunk.stop, reader.scratch)
    if target.dtype != target.source_dtype:
        out = reader.scratch("cast", tuple(out.shape), target.dtype).copy_(out)
    return out


def _gather(copies: Sequence[Copy], rows: Box, dtype: str, reader: Reader, buffer: str, view: bool = True) -> torch.Tensor:
    """``rows`` of the tensor ``copies`` fill, on the thread's buffer ``buffer`` (or, with ``view``, a view of the
    read buffer when one region fills them)."""
    parts = []
    for copy in copies:
        part = copy.dst.intersect(rows)
        if part is not None and part.numel:
            parts.append((copy, part))
    if len(parts) == 1 and parts[0][1] == rows:
        copy, part = parts[0]
        region = reader.region(copy.piece, map_region(copy.src, copy.dst, part), part.sizes, dim_map(copy.src, copy.dst))
        if view and region.is_contiguous():
            return region
        return _place(reader.scratch(buffer, rows.sizes, dtype), region)
    out = reader.scratch(buffer, rows.sizes, dtype)
    if sum(part.numel for _, part in parts) != rows.numel:  # rows no copy fills are zeros (a split's vocab padding)
        out.zero_()
    for copy, part in parts:
        region = reader.region(copy.piece, map_region(copy.src, copy.dst, part), part.sizes, dim_map(copy.src, copy.dst))
        _place(out[tuple(slice(o - r, o - r + s) for o, r, s in zip(part.offsets, rows.offsets, part.sizes))], region)
    return out


def _place(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """Copy ``src`` into ``dst`` (the same shape) and return ``dst``: as bytes, on this thread, when the dtypes agree.

    torch splits a copy over its intra-op threads; beside the executor's own threads, or on a loaded machine, that
    made the row-run copies of a dim-1 split several times slower than memory (1.2 against 8 GiB/s on 2 CPUs).
    numpy copies on the calling thread, without the GIL. A conversion, or a copy numpy cannot view as bytes, goes
    to torch.
    """
    if dst.dtype != src.dtype:
        return dst.copy_(src)
    try:
        target, source = dst.view(torch.uint8).numpy(), src.view(torch.uint8).numpy()
    except (RuntimeError, TypeError):  # a zero-dim tensor, or a last dim that is not contiguous
        return dst.copy_(src)
    target[...] = source
    return dst


def _dequantize(chunk: Chunk, reader: Reader, check_scales: bool = True) -> torch.Tensor:
    """A computed target's rows: the scale rows a decoder names (copied out of the read buffer first, and with
    ``check_scales`` checked: :func:`_refuse_bad_scale`), the stored rows, and the codec's arithmetic into the
    ``cast`` buffer; an encoder's round trip is recorded."""
    target, dq, scale = chunk.target, chunk.target.dequant, chunk.target.scale
    assert dq is not None
    compute = codec(dq.method, dq.params)
    scales = None
    if scale is not None:  # a decoder's scales
        lo, hi = compute.scale_rows(chunk.start, chunk.stop)  # type: ignore[union-attr]
        rows = row_box(scale.shape, lo, hi)
        scales = _read_rows(scale.copies, rows, scale.source_dtype, reader, "scale")
        if scales is None:
            scales = _gather(scale.copies, rows, scale.source_dtype, reader, "scale", view=False)
        if check_scales:
            _refuse_bad_scale(chunk, rows, compute.bad_scale(scales, chunk.start, dq.stored))  # type: ignore[union-attr]
    a, b = compute.stored_rows(chunk.start, chunk.stop)
    if target.transform is not None:  # quantized after its transform: the pre rows, then the map, then the encoder
        pre = _gather(target.copies, transformed_rows(chunk, (a, b)), target.source_dtype, reader, "chunk")
        stored = target.transform.apply(pre, dq.stored, a, b, target.source_dtype, reader.scratch)
    else:
        rows = row_box(dq.stored, a, b)
        stored = _read_rows(target.copies, rows, target.source_dtype, reader, "chunk")
        if stored is None:
            stored = _gather(target.copies, rows, target.source_dtype, reader, "chunk")
    out = reader.scratch("cast", chunk_rows(chunk).sizes, target.dtype)
    if target.aux:  # a packed weight's small inputs, whole: checked before any value is computed from them
        aux = tuple(_gather(a.copies, row_box(a.shape, 0, a.shape[0] if a.shape else 0), a.source_dtype, reader,
                            f"aux{i}", view=False) for i, a in enumerate(target.aux))
        problem = compute.check_aux(aux, target.shape) if check_scales else None  # type: ignore[union-attr]
        if problem is not None:
            raise SourceError(f"'{target.name}': {problem}")
        compute.decode(stored, scales, chunk.start, out, reader.scratch, aux=aux)  # type: ignore[call-arg]
        return out
    measured = compute.decode(stored, scales, chunk.start, out, reader.scratch)  # type: ignore[arg-type]
    if measured is not None:
        reader.record(target.name, measured)
    return out


def _refuse_bad_scale(chunk: Chunk, rows: Box, bad: BadScale | None) -> None:
    """Stop before a chunk is written whose block a NaN or infinite scale (``bad``, found in the scale ``rows``
    the chunk reads) would make NaN or infinite: a whole projection lost, with nothing else to show it (the merge's
    own audit reads headers only). Checked as the scale rows stream by: they are few."""
    scale = chunk.target.scale
    if bad is not None and scale is not None:
        files = [c.piece.file for c in scale.copies  # the piece that holds the bad scale (of a sharded one, too)
                 if all(o <= i < o + n for i, o, n in zip(bad.index, c.dst.offsets, c.dst.sizes))]
        raise SourceError(bad.message(chunk.target.name, scale.name, files[0] if files else None,
                                      (rows.offsets[0], rows.offsets[0] + rows.sizes[0])))


def _read_rows(copies: Sequence[Copy], rows: Box, dtype: str, reader: Reader, buffer: str) -> torch.Tensor | None:
    """``rows`` (whole rows) of the tensor ``copies`` fill, read with one ``pread`` into the thread's buffer
    ``buffer``, when one raw piece of the tensor's very shape holds it as it is (:func:`_whole_piece`; a quantized
    weight and its scales, most often): what :func:`_gather` gives, without its regions. None otherwise."""
    shape = copies[0].dst.sizes if len(copies) == 1 else ()
    piece = _whole_piece(copies, shape, dtype) if rows.sizes and reader.reads_files else None
    if (piece is None or piece.box.sizes != shape or rows.sizes[1:] != shape[1:] or any(rows.offsets[1:])
            or rows.offsets[0] + rows.sizes[0] > shape[0]):
        return None
    row = math.prod(shape[1:]) * itemsize(dtype)
    return reader.read_scratch(buffer, rows.sizes, dtype, piece, piece.byte_offset + rows.offsets[0] * row)


def direct_offset(chunk: Chunk) -> int | None:
    """Where a chunk's bytes start in its piece's file when they lie there as the output holds them (the
    target is one raw piece copied whole, in its own dtype); None when the chunk must be built."""
    target = chunk.target
    whole = (target.dequant is None and target.transform is None and target.dtype == target.source_dtype
             and not target.lora)
    piece = _whole_piece(target.copies, target.shape, target.dtype) if whole else None
    first = 0
    if piece is None and whole:
        piece, first = _row_range(target.copies, target.shape, target.dtype)
    if piece is None:
        return None
    rows = chunk.stop - chunk.start
    return piece.byte_offset + ((first + chunk.start) * (chunk.nbytes // rows) if rows else 0)


def direct_rows(chunk: Chunk) -> tuple[Piece, int, int, int] | None:
    """Where a chunk's rows lie in its piece's file when each is one run of bytes there, a fixed stride apart, as
    the output holds them (a column shard: dim 1 of the piece cut, the dims after it whole, in its own dtype):
    ``(piece, offset of the first run, bytes per run, stride)``, for :meth:`Reader.read_rows`. None when the chunk
    must be built, or is one run (:func:`direct_offset`)."""
    target = chunk.target
    if (target.dequant is not None or target.transform is not None or target.dtype != target.source_dtype
            or target.lora or len(target.copies) != 1 or len(target.shape) < 2 or chunk.stop == chunk.start):
        return None
    shape = target.shape
    copy = _raw_copy(target.copies, shape, target.dtype)
    if copy is None or not _whole_after(copy, shape, 1):
        return None
    piece = copy.piece
    inner = math.prod(shape[2:]) * itemsize(target.dtype)
    run, stride = shape[1] * inner, piece.box.sizes[1] * inner
    if not run:
        return None
    return piece, piece.byte_offset + (copy.src.offsets[0] + chunk.start) * stride + copy.src.offsets[1] * inner, run, stride


def _row_range(copies: Sequence[Copy], shape: Shape, dtype: str) -> tuple[Piece | None, int]:
    """The raw piece in ``dtype`` of which ``copies`` copy whole rows (a run of dim 0, every other dim whole) into
    all of a tensor of ``shape``, and the first of those rows: bytes that lie in the file as the output holds
    them (a split's row shard of a tensor, a padded vocab's real rows). ``(None, 0)`` for anything else."""
    copy = _raw_copy(copies, shape, dtype) if shape else None
    if copy is None or not _whole_after(copy, shape, 0):
        return None, 0
    return copy.piece, copy.src.offsets[0]


def _whole_piece(copies: Sequence[Copy], shape: Shape, dtype: str) -> Piece | None:
    """The piece of raw bytes in ``dtype`` that ``copies`` copy whole, as it lies in its file, into all of a
    tensor of ``shape`` (one copy, from and to offset 0; its box may differ from ``shape`` by dims of size 1);
    None for anything else."""
    copy = _raw_copy(copies, shape, dtype)
    if copy is None or copy.src.sizes != copy.piece.box.sizes or any(copy.src.offsets):
        return None
    return copy.piece


def _raw_copy(copies: Sequence[Copy], shape: Shape, dtype: str) -> Copy | None:
    """The one copy of raw bytes in ``dtype`` that fills all of a tensor of ``shape``; None for anything else."""
    if len(copies) != 1:
        return None
    copy = copies[0]
    piece = copy.piece
    if piece.encoding != RAW or piece.dtype != dtype or copy.dst.sizes != shape or any(copy.dst.offsets):
        return None
    return copy


def _whole_after(copy: Copy, shape: Shape, dim: int) -> bool:
    """Whether ``copy`` reads a box of ``shape`` that takes its piece whole along every dim after ``dim``: the box's
    runs along ``dim`` then lie in the file one run of bytes each, a fixed stride apart."""
    box = copy.piece.box
    return (copy.src.sizes == shape and len(box.sizes) == len(shape) and not any(copy.src.offsets[dim + 1:])
            and copy.src.sizes[dim + 1:] == box.sizes[dim + 1:])

