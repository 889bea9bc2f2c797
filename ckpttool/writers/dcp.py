"""The PyTorch Distributed Checkpoint output: ``__R_0.distcp`` per rank and ``.metadata``, as torch writes them.

torch's ``FileSystemWriter`` (one file per rank) writes every item a rank saves as one ``torch.save`` archive,
one after another in ``__R_0.distcp``; ``.metadata`` is a pickle of torch's ``Metadata``: every tensor's
global size, dtype and chunks (``offsets``, ``sizes``), and where each chunk's archive lies
(``MetadataIndex(fqn, offsets)`` -> ``_StorageInfo(relative_path, offset, length)``). A chunk held by several
ranks (a replicated norm) is written once, by the rank with the fewest bytes so far, as torch's
``dedup_save_plans`` chooses.

Here each archive's bytes around the elements come from :class:`~.torch_archive.TensorArchive`, and the
elements are streamed in by the executor (:mod:`ckpttool.execute.executor`), chunk by chunk, from positioned
reads of the source: a DCP chunk is a plan target. torch's ``dcp.load`` reads the result.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import threading
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.io.dtypes import torch_dtype, torch_dtype_name
from ckpttool.execute.buffers import Chunk, buffer_sizes, chunks, piece_uses
from ckpttool.execute.reads import Reader
from ckpttool.execute.executor import write_file as stream_file
from ckpttool.layout.layout import Box, Shape
from ckpttool.plan.plan import Target
from ckpttool.errors import OutputError
from ckpttool.writers.torch_archive import TensorArchive, crc32_combine
from ckpttool.writers.torch_globals import Call, Global, New, dumps
from ckpttool.writers.trust import create_file

METADATA = ".metadata"


def file_name(rank: int) -> str:
    """What torch's ``FileSystemWriter`` calls rank ``rank``'s file."""
    return f"__{rank}_0.distcp"


@dataclass(frozen=True, slots=True)
class Item:
    """One chunk of a tensor, saved by one rank: ``box`` of the global tensor ``fqn``, filled by ``target``
    (of shape ``box.sizes``), as the archive that starts at ``offset`` of its file."""

    fqn: str
    global_shape: Shape
    box: Box
    target: Target
    archive: TensorArchive
    offset: int

    @property
    def data_offset(self) -> int:
        """Where the elements start in the file."""
        return self.offset + self.archive.data_offset


@dataclass(frozen=True, slots=True)
class ObjectItem:
    """A bytes item (DCP's ``BytesStorageMetadata``: Megatron's ``ShardedObject``): ``data``, the whole
    ``torch.save`` archive of the object, at ``offset`` of its file."""

    fqn: str
    data: bytes
    offset: int


@dataclass(frozen=True, slots=True)
class DcpFile:
    """One rank's ``.distcp`` file and its items, in file order: tensors, then objects."""

    name: str
    rank: int
    items: tuple[Item, ...] = field(default=())
    objects: tuple[ObjectItem, ...] = field(default=())

    @property
    def nbytes(self) -> int:
        return sum(i.archive.length for i in self.items) + sum(len(o.data) for o in self.objects)

    @property
    def data_bytes(self) -> int:
        return sum(i.archive.nbytes for i in self.items)


def share_items(held: Sequence[Sequence[tuple[str, Box, int]]]) -> list[list[tuple[str, Box]]]:
    """Which rank writes each chunk: ``held[r]`` lists ``(fqn, box, weight)`` rank ``r`` holds, in its state-dict
    order; a chunk several ranks hold goes to the one with the least weight so far (the lowest on a tie), chunks
    taken in order of first appearance, as torch's ``dedup_save_plans`` (which weighs a chunk by the bytes of its
    whole tensor, ``WriteItem.tensor_storage_size``). Returns each rank's chunks, in order."""
    holders: dict[tuple[str, Shape], list[int]] = {}
    sizes: dict[tuple[str, Shape], int] = {}
    for rank, chunks_held in enumerate(held):
        for fqn, box, nbytes in chunks_held:
            holders.setdefault((fqn, box.offsets), []).append(rank)
            sizes[(fqn, box.offsets)] = nbytes
    load = [0] * len(held)
    writer = {}
    for key, ranks in holders.items():
        rank = min(ranks, key=load.__getitem__)  # ranks ascending (by enumerate): the first least loaded is the lowest
        load[rank] += sizes[key] or 1
        writer[key] = rank
    return [[(fqn, box) for fqn, box, _ in chunks_held if writer[(fqn, box.offsets)] == rank]
            for rank, chunks_held in enumerate(held)]


def lay_out(per_rank: Sequence[Sequence[tuple[str, Shape, Box, Target]]],
            objects: Sequence[Sequence[tuple[str, bytes]]] = ()) -> tuple[DcpFile, ...]:
    """Every rank's file: its items' archives one after another, from byte 0, then its ``objects``
    (``(fqn, archive bytes)`` per rank, when given)."""
    files = []
    for rank, items in enumerate(per_rank):
        laid, offset = [], 0
        for fqn, global_shape, box, target in items:
            archive = TensorArchive(target.dtype, box.sizes, f"{fqn}@{list(box.offsets)}")
            laid.append(Item(fqn, global_shape, box, target, archive, offset))
            offset += archive.length
        placed = []
        for fqn, data in objects[rank] if objects else ():
            placed.append(ObjectItem(fqn, data, offset))
            offset += len(data)
        files.append(DcpFile(file_name(rank), rank, tuple(laid), tuple(placed)))
    return tuple(files)


def item_chunks(item: Item) -> list[Chunk]:
    """The executor's chunks of an item's elements, at their offsets in its file."""
    return chunks(item.target, item.data_offset)


def write_files(
    root: str | Path, files: Sequence[DcpFile], directory: Path, *, workers: int = 1,
    on_bytes: Callable[[int], None] = lambda n: None,
) -> None:
    """Write ``files`` into ``directory``: the elements streamed from the source under ``root`` by ``workers``
    threads (a whole file each when there are enough files, else the chunks of one file at a time), each
    chunk's CRC-32 taken as it is written, then every archive's bytes around its elements.

    Raises:
        OutputError: a file cannot be written (a full disk); SourceError: a source file cannot be read.
    """
    every_chunk = [c for f in files for item in f.items for c in item_chunks(item)]
    # each rank's file takes a slice of every source tensor: no read-ahead into the slices of ranks written later
    reader = Reader(root, piece_uses(every_chunk), buffer_sizes(every_chunk), readahead=False)
    lock = threading.Lock()

    def counted(n: int) -> None:
        with lock:
            on_bytes(n)

    try:
        if workers > 1 and len(files) >= workers:  # a file per thread: one pool, so each thread sizes its buffers once
            with ThreadPoolExecutor(max_workers=workers) as pool:
                list(pool.map(lambda out: _write_file(directory / out.name, out, reader, 1, counted), files))
        else:
            for out in files:
                _write_file(directory / out.name, out, reader, workers, on_bytes)
    finally:
        reader.close()


def _write_file(path: Path, out: DcpFile, reader: Reader, workers: int, on_bytes: Callable[[int], None]) -> None:
    per_item = [item_chunks(item) for item in out.items]
    crcs: dict[int, int] = {}
    lock = threading.Lock()

    def take_crc(chunk: Chunk, crc: int) -> None:
        with lock:
            crcs[id(chunk)] = crc

    try:
        stream_file(path, b"", [c for cs in per_item for c in cs], reader, workers, on_bytes, take_crc)
        fd = os.open(path, os.O_WRONLY | os.O_NOFOLLOW)  # the file stream_file just created
        try:
            for item, item_chunk_list in zip(out.items, per_item):
                crc = 0
                for chunk in item_chunk_list:
                    crc = crc32_combine(crc, crcs[id(chunk)], chunk.nbytes)
                _write_at(fd, item.archive.head(), item.offset)
                _write_at(fd, item.archive.tail(crc), item.data_offset + item.archive.nbytes)
            for obj in out.objects:
                _write_at(fd, obj.data, obj.offset)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        raise OutputError(f"'{out.name}': cannot write: {e.strerror or e}; nothing was published") from None
    size = path.stat().st_size
    if size != out.nbytes:
        raise OutputError(f"'{out.name}': wrote {size} bytes, expected {out.nbytes}; is the disk full?")


def _write_at(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


_METADATA = "torch.distributed.checkpoint.metadata"
_FILESYSTEM = "torch.distributed.checkpoint.filesystem"
#: torch's classes and functions ``.metadata`` names (:mod:`.torch_globals`: written without importing torch)
_CLASS = {name: Global(_METADATA, name) for name in (
    "Metadata", "TensorStorageMetadata", "TensorProperties", "ChunkStorageMetadata", "BytesStorageMetadata",
    "MetadataIndex", "StorageMeta")}
_STORAGE_INFO = Global(_FILESYSTEM, "_StorageInfo")
_SIZE = Global("torch", "Size")
#: the module of every dtype: one string, and another object than ``torch.Size``'s ``"torch"``, as in torch's
#: pickle (the pickler writes a string once and refers back to the same object after)
_DTYPE_MODULE = "".join(("tor", "ch"))
#: ``TensorProperties``' defaults as its ``__getstate__`` records them: a strided layout (one object, so pickled
#: once and referred to after, as torch's one ``torch.strided``), contiguous memory
_STRIDED = Call(Global("torch.serialization", "_get_layout"), ("torch.strided",))
_CONTIGUOUS = Call(Global(_METADATA, "_MEM_FORMAT_ENCODING"), (0,))
#: the format version torch's ``FileSystemWriter`` records (``CURRENT_DCP_VERSION`` of torch 2.13, the release this was
#: checked against: the only one installed here)
DCP_VERSION = "1.0.0"


def _size(values: tuple[int, ...]) -> Call:
    """A ``torch.Size``: each one a tuple of its own, as ``Size.__reduce__`` makes one per call."""
    return Call(_SIZE, (tuple(list(values)),))


#: the most chunks whose ``.metadata`` is pickled by hand (:mod:`.torch_globals`: the standard library's Python
#: pickler, ~0.5 ms a chunk); above it, torch's classes are imported and pickled by the C pickler (~2 s to import,
#: then ~20 us a chunk), the same bytes
HAND_PICKLED_CHUNKS = 4000


def metadata_pickle(files: Sequence[DcpFile]) -> bytes:
    """``.metadata``: the pickle of torch's ``Metadata`` as ``FileSystemWriter.finish`` writes it, byte for byte:
    chunks listed per tensor in rank order, ``planner_data`` mapping each name to itself (a flat state dict), a
    save id derived from the layout. Written without importing torch up to :data:`HAND_PICKLED_CHUNKS` chunks
    (what keeps a split's start-up short), else from :func:`torch_metadata`."""
    if sum(len(out.items) + len(out.objects) for out in files) > HAND_PICKLED_CHUNKS:
        return pickle.dumps(torch_metadata(files))
    dtypes: dict[str, Global] = {}
    tensors: dict[str, New] = {}
    storage: dict[New, New] = {}
    for out in files:
        for item in out.items:
            md = tensors.get(item.fqn)
            if md is None:
                dtype = dtypes.setdefault(item.target.dtype, Global(_DTYPE_MODULE, torch_dtype_name(item.target.dtype)))
                properties = New(_CLASS["TensorProperties"], (dtype, _STRIDED, False, _CONTIGUOUS, False))
                md = tensors[item.fqn] = New(_CLASS["TensorStorageMetadata"], {
                    "properties": properties, "size": _size(item.global_shape), "chunks": []})
            chunks_of = md.state["chunks"]
            chunks_of.append(New(_CLASS["ChunkStorageMetadata"], {
                "offsets": _size(item.box.offsets), "sizes": _size(item.box.sizes)}))
            index = New(_CLASS["MetadataIndex"], {"fqn": item.fqn, "index": len(chunks_of) - 1,
                                                  "offset": _size(item.box.offsets)})
            storage[index] = _storage_info(out.name, item.offset, item.archive.length)
    objects: dict[str, New] = {}
    for out in files:
        for obj in out.objects:
            objects[obj.fqn] = New(_CLASS["BytesStorageMetadata"])
            storage[New(_CLASS["MetadataIndex"], {"fqn": obj.fqn, "index": None})] = _storage_info(
                out.name, obj.offset, len(obj.data))
    meta = New(_CLASS["StorageMeta"], {"checkpoint_id": None, "save_id": _save_id(files), "load_id": None,
                                       "modules": []})
    return dumps(New(_CLASS["Metadata"], {
        "state_dict_metadata": {**tensors, **objects}, "planner_data": {name: (name,) for name in tensors},
        "storage_data": storage, "storage_meta": meta, "version": DCP_VERSION}))


def torch_metadata(files: Sequence[DcpFile]) -> Any:
    """torch's own ``Metadata`` of ``files`` (imports ``torch.distributed.checkpoint``): what
    :func:`metadata_pickle` pickles."""
    import torch
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                       MetadataIndex, StorageMeta, TensorProperties,
                                                       TensorStorageMetadata)

    tensors: dict[str, Any] = {}
    storage = {}
    for out in files:
        for item in out.items:
            md = tensors.setdefault(item.fqn, TensorStorageMetadata(
                TensorProperties(dtype=torch_dtype(item.target.dtype)), torch.Size(item.global_shape), []))
            md.chunks.append(ChunkStorageMetadata(torch.Size(item.box.offsets), torch.Size(item.box.sizes)))
            storage[MetadataIndex(item.fqn, torch.Size(item.box.offsets), len(md.chunks) - 1)] = _StorageInfo(
                out.name, item.offset, item.archive.length)
    objects = {}
    for out in files:
        for obj in out.objects:
            objects[obj.fqn] = BytesStorageMetadata()
            storage[MetadataIndex(obj.fqn)] = _StorageInfo(out.name, obj.offset, len(obj.data))
    return Metadata({**tensors, **objects}, planner_data={name: (name,) for name in tensors}, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=None, save_id=_save_id(files)), version=CURRENT_DCP_VERSION)


def _save_id(files: Sequence[DcpFile]) -> str:
    """A save id derived from the layout, so a split writes the same bytes every time."""
    digest = hashlib.sha256(repr([(f.name, [(i.fqn, i.box.offsets, i.offset) for i in f.items]) for f in files]).encode())
    return str(uuid.UUID(bytes=digest.digest()[:16], version=4))


def _storage_info(relative_path: str, offset: int, length: int) -> New:
    """torch's ``_StorageInfo``, as its ``__getstate__`` records it (no ``transform_descriptors``)."""
    return New(_STORAGE_INFO, {"relative_path": relative_path, "offset": offset, "length": length})


def write_metadata(files: Sequence[DcpFile], directory: Path) -> None:
    """Write ``.metadata`` (:func:`metadata_pickle`) into ``directory``.

    Raises:
        OutputError: it cannot be written.
    """
    data = metadata_pickle(files)
    try:
        with os.fdopen(create_file(directory / METADATA), "wb") as f:
            f.write(data)
    except OSError as e:
        raise OutputError(f"'{METADATA}': cannot write: {e.strerror or e}; nothing was published") from None
