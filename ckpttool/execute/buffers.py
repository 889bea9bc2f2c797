"""Chunks and the per-thread buffers they need: the chunk geometry the executor reads by (:func:`chunks`: a target
of shape ``(R, ...)`` cut into chunks of whole rows of at most :data:`CHUNK_BYTES`; :func:`piece_uses`), and the
memory prediction (:func:`buffer_sizes`, :func:`predict_peak_bytes`) made from it without reading any tensor.

Most targets of a large checkpoint are alike (an expert's weights: the same shape, dtypes and copy structure in
another file), so :func:`buffer_sizes` computes each distinct chunk signature once.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ckpttool.io.dtypes import itemsize
from ckpttool.quant.codecs import codec
from ckpttool.layout.layout import RAW, Box, Piece, c_strides
from ckpttool.plan.lora import ROW_ALIGN
from ckpttool.plan.tiling import Copy
from ckpttool.plan.plan import Target
from ckpttool.execute.reference import CACHE_BYTES
from ckpttool.layout.regions import map_region

#: the most output bytes one chunk holds (a chunk is at least one row)
CHUNK_BYTES = 32 * 2**20
#: what the plan's bookkeeping and the interpreter take besides the buffers (chunk lists, file handles)
OVERHEAD_BYTES = 8 * 2**20


@dataclass(frozen=True, slots=True)
class Chunk:
    """Rows ``start..stop`` of ``target``, written at byte ``offset`` of its output file."""

    target: Target
    start: int
    stop: int
    offset: int
    nbytes: int


def chunks(target: Target, offset: int, chunk_bytes: int = CHUNK_BYTES, rows: int | None = None) -> list[Chunk]:
    """The chunks of ``target`` (written at ``offset``), in file order: ``rows`` rows each, or as many as
    ``chunk_bytes`` holds."""
    shape = target.shape or (1,)
    row = math.prod(shape[1:]) * itemsize(target.dtype)
    if rows is None and target.dequant is None and not target.lora and 0 < shape[0] * row <= chunk_bytes:  # most tensors: one chunk
        return [Chunk(target, 0, shape[0], offset, shape[0] * row)]
    per = rows or (max(1, chunk_bytes // _compute_row_bytes(target, row)) if row else max(1, shape[0]))
    if target.dequant is not None:  # a computed target: chunks of whole rows of blocks where it needs them
        per = codec(target.dequant.method, target.dequant.params).align(per)
    if target.transform is not None and target.dequant is not None:  # quantized after it (rows of its encoder's)
        per = target.shape[0] if target.transform.moves_rows() else -(-per // (g := _granule(target))) * g
    elif target.transform is not None:  # whole blocks of a row permutation; everything when dim 0 is transposed
        per = max(1, target.transform.align(target.shape, per))  # (0 for a target of no rows: a step of 1)
    if target.lora and not all(d.stacked for d in target.lora):  # whole blocks of ROW_ALIGN rows: the matrix
        per = -(-per // ROW_ALIGN) * ROW_ALIGN  # kernel's row blocks, as in PEFT's whole product (experts stacked on
        # disk are rows of their own: each expert's product is one batch of PEFT's einsum)
    return [
        Chunk(target, a, min(a + per, shape[0]), offset + a * row, (min(a + per, shape[0]) - a) * row)
        for a in range(0, shape[0], per)
    ]


def _granule(target: Target) -> int:
    """The fewest rows of a target quantized after its transform that a chunk may hold: whole rows of its encoder
    (FP8 block rows) whose stored rows are whole blocks of the transform (a permutation's period)."""
    assert target.dequant is not None and target.transform is not None
    compute = codec(target.dequant.method, target.dequant.params)
    period, step = max(1, target.transform.align(target.dequant.stored, 1)), max(1, compute.align(1))
    rows = step
    while rows < target.shape[0]:
        first, last = compute.stored_rows(0, rows)
        if (last - first) % period == 0:
            break
        rows += step
    return rows


def _compute_row_bytes(target: Target, row: int) -> int:
    """Bytes one row of ``target`` takes at its largest: an encoder's float32 copy of its source rows, or a fused
    target's float32 product, delta and sum (:mod:`ckpttool.plan.lora`)."""
    if target.lora:
        return max(row, 8 * math.prod(target.shape[1:]))
    if target.dequant is None or not target.dequant.stored:
        return row
    a, b = codec(target.dequant.method, target.dequant.params).stored_rows(0, 1)
    return max(row, (b - a) * math.prod(target.dequant.stored[1:]) * 4)


def chunk_rows(chunk: Chunk) -> Box:
    """The box of its target that ``chunk`` writes: rows ``start..stop``, every other dim whole."""
    return row_box(chunk.target.shape, chunk.start, chunk.stop)


def row_box(shape: tuple[int, ...], start: int, stop: int) -> Box:
    """Rows ``start..stop`` of a tensor of ``shape`` as a box (the empty box of a scalar)."""
    if not shape:
        return Box((), ())
    return Box((start, *(0 for _ in shape[1:])), (stop - start, *shape[1:]))


def chunk_inputs(chunk: Chunk) -> list[tuple[tuple[Copy, ...], Box]]:
    """The copies a chunk reads and the box of their tensor it needs: the target's rows, for a transformed
    target the rows of its pre tensor the transform names, or for a dequantized target the stored rows and the
    scale rows."""
    target, dq, scale = chunk.target, chunk.target.dequant, chunk.target.scale
    if target.transform is not None and dq is None:
        return [(target.copies, transformed_rows(chunk))]
    if dq is None:
        return [(target.copies, chunk_rows(chunk))]
    compute = codec(dq.method, dq.params)
    a, b = compute.stored_rows(chunk.start, chunk.stop)
    stored = [(target.copies, row_box(dq.stored, a, b) if target.transform is None else transformed_rows(chunk, (a, b)))]
    if scale is None:
        return stored
    lo, hi = compute.scale_rows(chunk.start, chunk.stop)  # type: ignore[union-attr]
    aux = [(a.copies, row_box(a.shape, 0, a.shape[0] if a.shape else 0)) for a in target.aux]
    return [*stored, (scale.copies, row_box(scale.shape, lo, hi)), *aux]


def transformed_rows(chunk: Chunk, stored: tuple[int, int] | None = None) -> Box:
    """The rows of a transformed target's pre tensor its chunk is made of (see
    :meth:`~ckpttool.plan.transforms.Permute.pre_rows`); of a target quantized after its transform, those of the
    ``stored`` rows its encoder reads."""
    target = chunk.target
    transform = target.transform
    assert transform is not None
    shape, (a, b) = transformed_shape(target), stored or (chunk.start, chunk.stop)
    return row_box(target.filled_shape, *transform.pre_rows(shape, a, b))


def transformed_shape(target: Target) -> tuple[int, ...]:
    """What a transformed target's transform makes: the target, or the elements its encoder reads."""
    return target.dequant.stored if target.dequant is not None else target.shape


def buffer_sizes(chunk_list: Sequence[Chunk], cache: bool = True) -> dict[str, int]:
    """The largest each per-thread buffer gets over ``chunk_list``: ``read`` (one region of a piece),
    ``chunk`` (a chunk in the source dtype) and ``cast`` (a chunk in the output dtype); for a dequantized
    target also ``scale`` (its scale rows) and the decoder's own (:meth:`scratch_bytes`); for a transformed
    target ``chunk`` holds the pre rows, and the transform's own buffers (``transform``...) the chunk computed. With ``cache``,
    chunks of the same signature (:func:`_signature`) are sized once; the result is the same."""
    sizes = {"read": 0, "chunk": 0, "cast": 0}
    seen: dict[tuple, dict[str, int]] = {}
    last: tuple[Target | None, tuple | None] = (None, None)
    for chunk in chunk_list:
        if not cache:
            found = _chunk_sizes(chunk)
        else:
            if last[0] is not chunk.target:  # a target's chunks come one after another: one signature each
                last = (chunk.target, _signature(chunk.target))
            key = (chunk.start, chunk.stop, chunk.nbytes, last[1])
            try:
                if key in seen:  # sized before, and already counted: the maxima cannot change
                    continue
                found = seen[key] = _chunk_sizes(chunk)
            except TypeError:  # a codec parameter that cannot be hashed: this chunk is sized alone
                found = _chunk_sizes(chunk)
        for name, n in found.items():
            if n > sizes.get(name, 0) or name not in sizes:
                sizes[name] = n
    return sizes


def _signature(target: Target) -> tuple:
    """What :func:`_chunk_sizes` reads of a target: shapes, dtypes, the codec, and each copy's boxes and piece
    shape, dtype and encoding (not its file or key)."""
    dq, scale = target.dequant, target.scale
    return (target.shape, target.dtype, target.source_dtype, tuple(map(_copy_signature, target.copies)),
            None if dq is None else (dq.method, dq.params, dq.stored),
            None if scale is None else _signature(scale), target.transform,
            tuple((d.a.shape, d.a.dtype, d.b.shape, d.fan_in_fan_out) for d in target.lora), tuple(map(_signature, target.aux)))


def _copy_signature(c: Copy) -> tuple:
    """A copy's boxes (as tuples: hashed at C speed) and its piece's shape, dtype and encoding."""
    return (c.src.offsets, c.src.sizes, c.dst.offsets, c.dst.sizes, c.piece.box.sizes, c.piece.dtype, c.piece.encoding)


def _chunk_sizes(chunk: Chunk) -> dict[str, int]:
    """What one chunk needs of each buffer (see :func:`buffer_sizes`)."""
    target = chunk.target
    sizes: dict[str, int] = {}
    if target.dtype != target.source_dtype:
        sizes["cast"] = chunk.nbytes
    inputs = chunk_inputs(chunk)
    for (copies, rows), buffer in zip(inputs, ("chunk", "scale")):
        dtype = target.source_dtype if buffer == "chunk" else target.scale.source_dtype  # type: ignore[union-attr]
        sizes[buffer] = max(sizes.get(buffer, 0), rows.numel * itemsize(dtype))
        for copy in copies:
            part = copy.dst.intersect(rows)
            if part is None or copy.piece.encoding != RAW:
                continue
            box = map_region(copy.src, copy.dst, part)
            assert box is not None
            strides = c_strides(copy.piece.box.sizes)
            span = sum((s - 1) * st for s, st in zip(box.sizes, strides)) + 1
            sizes["read"] = max(sizes.get("read", 0), span * itemsize(copy.piece.dtype))
    if target.transform is not None:  # (quantized after it: the rows its encoder reads, as chunk_inputs)
        a, b = (chunk.start, chunk.stop) if target.dequant is None else codec(
            target.dequant.method, target.dequant.params).stored_rows(chunk.start, chunk.stop)
        extra = target.transform.scratch_bytes(transformed_shape(target), a, b, itemsize(target.source_dtype))
        for name, n in extra.items():
            sizes[name] = max(sizes.get(name, 0), n)
    if target.lora:  # the adapter's A, B's rows and the float32 temporaries of the fuse (ckpttool.plan.lora)
        cols = math.prod(target.shape[1:])
        rows = chunk.stop - chunk.start
        sizes["lora"] = max(d.product_bytes(rows, cols) for d in target.lora)
        sizes["lora-add"] = sizes["lora"]
        sizes["lora-inputs"] = max(d.temporary_bytes(rows) for d in target.lora)
        sizes["chunk"] = max(sizes.get("chunk", 0), (chunk.stop - chunk.start) * cols * itemsize(target.source_dtype))
    if target.dequant is not None:
        extra = codec(target.dequant.method, target.dequant.params).scratch_bytes(
            inputs[0][1].sizes, inputs[1][1].sizes if len(inputs) > 1 else None, target.dtype)  # type: ignore[arg-type]
        for name, n in extra.items():
            sizes[name] = max(sizes.get(name, 0), n)
    return sizes


def chunk_targets(chunk_list: Sequence[Chunk]) -> list[Target]:
    """The targets of ``chunk_list``, each once (a target's chunks come one after another)."""
    found: list[Target] = []
    for chunk in chunk_list:
        if not found or found[-1] is not chunk.target:
            found.append(chunk.target)
    return found


def piece_uses(chunk_list: Sequence[Chunk]) -> Counter[Piece]:
    """How many chunks read each piece of ``torch.save`` bytes (kept loaded until its last one); pieces of raw
    bytes, read in place, are not counted."""
    uses: Counter[Piece] = Counter()
    if all(c.piece.encoding == RAW for t in chunk_targets(chunk_list) for c in _every_copy(t)):
        return uses  # the common case, told in one pass over the targets: every piece is raw bytes
    archived: dict[int, bool] = {}  # by the target's id: hashing a target hashes all its copies
    for chunk in chunk_list:
        target = chunk.target
        found = archived.get(id(target))
        if found is None:
            every = _every_copy(target)
            found = archived[id(target)] = any(c.piece.encoding != RAW for c in every)
        if found:
            for copies, rows in chunk_inputs(chunk):
                uses.update(c.piece for c in copies if c.piece.encoding != RAW and c.dst.intersect(rows) is not None)
    return uses


def _every_copy(target: Target) -> tuple[Copy, ...]:
    if target.scale is None and not target.aux:
        return target.copies
    return (*target.copies, *(target.scale.copies if target.scale is not None else ()),
            *(c for aux in target.aux for c in aux.copies))


def _read_copies(target: Target) -> tuple[tuple[Copy, ...], ...]:
    """The copies the chunks of ``target`` read, whatever their rows (see :func:`chunk_inputs`)."""
    if target.dequant is None or target.scale is None:
        return (target.copies,)
    return (target.copies, target.scale.copies, *(aux.copies for aux in target.aux))


def distinct_targets(targets: Iterable[Target]) -> list[Target]:
    """``targets`` less those that change no prediction: of the targets that are plain copies of raw pieces (no
    codec, scale, transform or LoRA: most of a checkpoint's), one per signature (:func:`_signature`); every other
    target. Their chunks give :func:`predict_peak_bytes` the same figure as all the targets' chunks: a chunk's sizes
    depend only on its rows and its target's signature, and the chunks of such a target on its shape and dtype."""
    seen: set[tuple] = set()
    found: list[Target] = []
    for target in targets:
        copies = target.copies
        if target.dequant is None and target.scale is None and target.transform is None and not target.lora:
            key = None
            if len(copies) == 1:
                copy = copies[0]
                box, piece = copy.src, copy.piece
                if box is copy.dst and box is piece.box and piece.encoding == RAW:  # the boxes of a whole copy are one
                    key = (target.shape, target.dtype, target.source_dtype, box.offsets, box.sizes, piece.dtype)
            elif all(c.piece.encoding == RAW for c in copies):  # a tensor cut in pieces (TP shards): by its copies
                key = (target.shape, target.dtype, target.source_dtype, tuple(map(_copy_signature, copies)))
            if key is not None:
                if key in seen:
                    continue
                seen.add(key)
        found.append(target)
    return found


def predict_peak_bytes(chunk_list: Sequence[Chunk], workers: int = 1) -> int:
    """Upper bound of the memory the streaming executor holds: per thread, its buffers at their largest
    (allocated once, at that size); plus whole ``torch.save`` pieces kept for later chunks (at most the
    loader's cache and one piece per thread)."""
    archives = {c.piece: math.prod(c.piece.box.sizes) * itemsize(c.piece.dtype)
                for target in chunk_targets(chunk_list) for copies in _read_copies(target) for c in copies
                if c.piece.encoding != RAW}
    kept = min(sum(archives.values()), CACHE_BYTES) + workers * max(archives.values(), default=0)
    return workers * sum(buffer_sizes(chunk_list).values()) + kept + OVERHEAD_BYTES
