"""PyTorch Distributed Checkpoint: ``.metadata`` (a pickle, read with an allow-list) + ``*.distcp`` files.

The metadata records every tensor's global shape and dtype and its chunks (offsets and sizes); the storage
table says which file and byte range holds each chunk, as a ``torch.save`` archive. FSDP2, DTensor TP,
2-D meshes, torchtitan and Megatron-Core ``torch_dist`` all write this. Optimizer state and non-tensor
entries are skipped by default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import replace
from pathlib import Path
from typing import BinaryIO

from ckpttool.model.description import ModelInfo
from ckpttool.io.dtypes import dtype_name, itemsize
from ckpttool.layout.layout import RAW, TORCH_SAVE, Box, Layout, Piece
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.io.paths import inside, open_inside, read_inside
from ckpttool.io.safe_pickle import Record, load_metadata_pickle
from ckpttool.io.torch_save import locate
from ckpttool.readers.validate import dims, expect, field, integer
from ckpttool.readers import accelerate
from ckpttool.readers.base import FormatReader

NAME = "dcp"
LOOKS_FOR = ".metadata with *.distcp files (PyTorch Distributed Checkpoint)"
METADATA = ".metadata"
#: top-level state-dict keys that hold training state, not model weights
NOT_MODEL = ("optim", "optimizer", "optimizers", "lr_scheduler", "lr_schedulers", "scheduler", "dataloader",
             "train_state", "rng", "rng_state", "extra_state")


#: set by :func:`locating_deferred`: the format's reader (:data:`READER`) then leaves every item unlocated
_DEFERRED: ContextVar[bool] = ContextVar("ckpttool_dcp_locating_deferred", default=False)


@contextmanager
def locating_deferred(deferred: bool = True) -> Iterator[None]:
    """Within this block (when ``deferred``), the DCP reader (:data:`READER`, as :func:`ckpttool.readers.read_layout`
    calls it) describes each present item without opening its ``.distcp`` file to locate its data record: for a
    plan that reads no byte (``merge --dry-run``, ``audit`` without data). At 92k items locating takes seconds.

    What such a layout still proves, from ``.metadata`` and one ``stat`` per file: every tensor's chunks, their
    storage entries, that each entry lies inside its file and holds at least its chunk's bytes. What it defers to
    the run that reads: that each item is a ``torch.save`` archive of one plain tensor of that dtype and shape
    (:func:`ckpttool.io.torch_save.locate`); an item that is not is loaded whole (``torch.load(weights_only=True)``)
    or refused there, with the message it gets today. A deferred item is a raw piece whose ``byte_offset`` is the
    item's start, not its data's: such a layout must never be read (its pieces' bytes would be the zip records).

    Example:
        >>> with locating_deferred():  # doctest: +SKIP
        ...     layout = read_layout("ckpt/step-100")  # plan and check only
    """
    token = _DEFERRED.set(deferred)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def deferring() -> bool:
    """Whether this is inside :func:`locating_deferred`: for a reader that calls :func:`read` itself (Megatron
    ``torch_dist``) and chooses to defer too, as ``read(..., locate=not deferring())``."""
    return _DEFERRED.get()


def matches(root: Path) -> bool:
    return (root / METADATA).is_file() or bool(accelerate.model_folders(root))


def read(root: Path, model: ModelInfo | None, *, within: Path | None = None, locate: bool = True,
         extents: dict[tuple[str, int], int] | None = None) -> Layout:
    """The layout of the DCP checkpoint in ``root``; ``within``: the source folder above ``root`` (a Megatron
    iteration), inside which symlinks may lead (by default ``root``: no link out of it is followed). An
    accelerate ``save_state`` folder (no ``.metadata`` of its own) is read through its model folder
    (:mod:`.accelerate`). ``locate=False`` leaves every present item unlocated, as :func:`locating_deferred`
    says (a layout for plans that read nothing); ``extents``, if given, is then filled with each unlocated item's
    whole storage entry, ``(file, byte_offset) -> length``, for a reader that still looks into some items
    (Megatron ``torch_dist``'s screen for Transformer Engine tensors)."""
    path = root / METADATA
    if not path.is_file() and accelerate.model_folders(root):
        folder = accelerate.the_model_folder(root)
        layout = read(folder, model, within=root if within is None else within, locate=locate, extents=extents)
        return replace(layout, notes=(accelerate.note(root, folder), *layout.notes))
    if not path.is_file():
        raise SourceNotFoundError(f"'{root}': no {METADATA} file")
    md = load_metadata_pickle(read_inside(root, METADATA, within=within), METADATA)
    named_by = METADATA if within is None else (root / METADATA).relative_to(within).as_posix()
    tensors_md = md.get("state_dict_metadata") if getattr(md, "kind", None) == "Metadata" else None
    storage_md = md.get("storage_data") if tensors_md is not None else None
    if not isinstance(tensors_md, dict) or not isinstance(storage_md, dict):
        raise SourceError(f"'{METADATA}': not DCP metadata (no state_dict_metadata/storage_data)")
    storage = {}
    for index, info in storage_md.items():
        state = index.__dict__ if isinstance(index, Record) else {}
        fqn, offsets = state.get("fqn"), state.get("offset")
        if type(fqn) is not str or not (offsets is None or _is_dims(offsets)):  # checked again, for the message
            fqn = field(index, "fqn", str, METADATA, what="storage_data index: fqn")
            if offsets is not None:
                offsets = dims(offsets, f"storage_data index of '{fqn}': offset", METADATA)
        storage[(fqn, offsets)] = info
    builder = LayoutBuilder(str(root), NAME)
    skipped_state, skipped_bytes = 0, 0
    sizes: dict[str, int | None] = {}
    handles: dict[str, BinaryIO] = {}
    try:
        for fqn, tmd in tensors_md.items():
            expect(fqn, str, "state_dict_metadata: a tensor name", METADATA)
            if getattr(tmd, "kind", "") != "TensorStorageMetadata":
                skipped_bytes += 1
                continue
            if fqn.split(".", 1)[0] in NOT_MODEL or fqn.endswith("._extra_state"):
                skipped_state += 1
                continue
            props = tmd.get("properties")
            stored = props.get("dtype") if isinstance(props, Record) else None
            try:
                dtype = dtype_name(stored or "")
            except SourceError:
                raise SourceError(f"'{METADATA}': '{fqn}' has dtype {stored!r}, which safetensors cannot hold") from None
            shape = tmd.get("size")
            if not isinstance(shape, tuple):
                raise SourceError(f"'{METADATA}': '{fqn}' has no global size")
            if not builder.declare(fqn, shape, dtype, where=f"'{METADATA}'"):
                continue
            for chunk in expect(tmd.get("chunks") or [], (list, tuple), f"'{fqn}' chunks", METADATA):
                offsets, chunk_sizes = _box(fqn, chunk, len(shape))
                info = storage.get((fqn, offsets))
                if info is None:
                    raise SourceError(f"'{METADATA}': '{fqn}' chunk at offsets {list(offsets)} has no storage entry")
                rel, start, length = _entry(fqn, info)
                if rel not in sizes:  # confine and stat each file once, not once per chunk
                    file = inside(root, rel, named_by=named_by, within=within)
                    sizes[rel] = os.path.getsize(file) if file.is_file() else None
                if sizes[rel] is not None and start + length > sizes[rel]:
                    raise SourceError(
                        f"'{rel}': '{fqn}' needs bytes {start}..{start + length} but the file has {sizes[rel]}; "
                        "it is truncated"
                    )
                needed = math.prod(chunk_sizes) * itemsize(dtype)
                if length < needed:  # checked before anything is allocated: absurd sizes stop here
                    raise SourceError(
                        f"'{rel}': '{fqn}' chunk of sizes {list(chunk_sizes)} needs at least {needed} bytes, but its "
                        f"storage entry holds {length}"
                    )
                if sizes[rel] is None:
                    piece = Piece(rel, fqn, Box(offsets, chunk_sizes), dtype, TORCH_SAVE, start, length)
                elif not locate:
                    piece = Piece(rel, fqn, Box(offsets, chunk_sizes), dtype, RAW, start, needed)
                    if extents is not None:
                        extents[(rel, start)] = length
                else:
                    piece = _as_raw(root, Piece(rel, fqn, Box(offsets, chunk_sizes), dtype, TORCH_SAVE, start, length),
                                    handles, within)
                builder.add(fqn, piece, present=sizes[rel] is not None)
    finally:
        for handle in handles.values():
            handle.close()
    notes = []
    if skipped_state:
        notes.append(f"skipped {skipped_state} optimizer/training-state tensors")
    if skipped_bytes:
        notes.append(f"skipped {skipped_bytes} non-tensor entries")
    return builder.build(notes)


_INTS = frozenset({int})


def _is_dims(value: object) -> bool:
    """Whether ``value`` is a tuple of non-negative ints, told at C speed (a ``torch.Size`` as the stand-in loads it)."""
    return type(value) is tuple and set(map(type, value)) <= _INTS and min(value, default=0) >= 0


def _box(fqn: str, chunk: object, ndim: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """A chunk's offsets and sizes, checked: the common case (tuples of ints, one per dim) at C speed, anything else
    by :mod:`.validate`, which names what is wrong."""
    state = chunk.__dict__ if isinstance(chunk, Record) else None
    if state is not None:
        offsets, sizes = state.get("offsets") or (), state.get("sizes") or ()
        if _is_dims(offsets) and _is_dims(sizes) and len(offsets) == len(sizes) == ndim:
            return offsets, sizes
    expect(chunk, Record, f"'{fqn}' chunk", METADATA)
    offsets = dims(chunk.get("offsets") or (), f"'{fqn}' chunk offsets", METADATA)  # type: ignore[attr-defined]
    sizes = dims(chunk.get("sizes") or (), f"'{fqn}' chunk sizes", METADATA)  # type: ignore[attr-defined]
    if not len(offsets) == len(sizes) == ndim:
        raise SourceError(
            f"'{METADATA}': '{fqn}' has a chunk with offsets {list(offsets)} and sizes {list(sizes)} "
            f"for a tensor of {ndim} dims"
        )
    return offsets, sizes


def _entry(fqn: str, info: object) -> tuple[str, int, int]:
    """A chunk's storage entry, checked (as :func:`_box`): its file, offset and length."""
    state = info.__dict__ if isinstance(info, Record) else None
    if state is not None:
        rel, start, length = state.get("relative_path"), state.get("offset"), state.get("length")
        if (type(rel) is str and type(start) is int and type(length) is int and start >= 0 and length >= 0
                and not state.get("transform_descriptors")):
            return rel, start, length
    rel = field(info, "relative_path", str, METADATA, what=f"'{fqn}' storage relative_path")
    transforms = info.get("transform_descriptors")  # type: ignore[attr-defined]
    if transforms:
        raise SourceError(f"'{rel}': '{fqn}' is stored with transforms {transforms}, which ckpttool does not decode yet")
    start = field(info, "offset", integer, METADATA, what=f"'{fqn}' storage offset")
    length = field(info, "length", integer, METADATA, what=f"'{fqn}' storage length")
    return rel, start, length


def _as_raw(root: Path, piece: Piece, handles: dict[str, BinaryIO], within: Path | None) -> Piece:
    """The piece as raw bytes inside its ``torch.save`` item when they can be located (read in place, in
    bounded chunks), else unchanged (loaded whole with ``torch.load(weights_only=True)``)."""
    handle = handles.get(piece.file)
    if handle is None:
        handle = handles[piece.file] = open_inside(root, piece.file, within=within)  # closed by the caller
    found = locate(handle, piece.byte_offset, piece.byte_length, label=piece.file, item=piece.key)
    if found is None or found.dtype != piece.dtype or found.shape != piece.box.sizes:
        return piece
    offset = found.byte_offset()
    assert offset is not None  # locate returns only tensors whose bytes are in place
    nbytes = found.numel * itemsize(found.dtype)
    # built directly: dataclasses.replace costs ~1 s at 90k items
    return Piece(piece.file, piece.key, piece.box, piece.dtype, RAW, piece.byte_offset + offset, nbytes, piece.tags)


def _read_source(root: Path, model: ModelInfo | None) -> Layout:
    """:func:`read` as the format's reader: items unlocated inside :func:`locating_deferred`."""
    return read(root, model, locate=not deferring())


READER = FormatReader(NAME, LOOKS_FOR, matches, _read_source)
