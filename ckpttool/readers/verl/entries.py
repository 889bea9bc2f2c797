"""One rank file's tensors as data: the device mesh, the placements and the checks of a DTensor entry.

:func:`read_entry` turns one value of a rank's state dict (a :class:`~ckpttool.readers.verl.classes.DTensorStandIn` stand-in
or a plain stored tensor) into an :class:`Entry`: its local stored tensor, global shape and dtype, the
:class:`Mesh` it lives on (read from the mesh's rank tensor in the file) and its placements, each checked against
the others before any region is computed.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckpttool.io.dtypes import dtype_name, itemsize
from ckpttool.layout.layout import c_strides
from ckpttool.errors import SourceError
from ckpttool.layout.placements import Placement
from ckpttool.io.safe_pickle import Record
from ckpttool.io.torch_save import StoredTensor
from ckpttool.readers.validate import dims, expect, field, integer, malformed, shown
from ckpttool.readers.verl.classes import DTensorStandIn, TensorMetaStandIn, WrapperStandIn


@dataclass(frozen=True, slots=True)
class Mesh:
    """A device mesh as data: ``ranks`` (global rank at each position, C order over ``shape``), names."""

    shape: tuple[int, ...]
    ranks: tuple[int, ...]
    names: tuple[str, ...]

    def coordinate(self, rank: int) -> tuple[int, ...] | None:
        if rank not in self.ranks:
            return None
        flat = self.ranks.index(rank)
        coord = []
        for stride in c_strides(self.shape):
            coord.append(flat // stride if stride else 0)
            flat = flat % stride if stride else flat
        return tuple(coord)


def _read_ints(f: BinaryIO, t: StoredTensor, label: str) -> list[int]:
    offset = t.byte_offset()
    if offset is None or t.dtype not in ("I32", "I64"):
        raise SourceError(f"'{label}': the device mesh's rank tensor cannot be read in place")
    f.seek(offset)
    size = itemsize(t.dtype)
    data = f.read(t.numel * size)
    if len(data) != t.numel * size:
        raise SourceError(f"'{label}': the device mesh's rank tensor is truncated")
    return [int.from_bytes(data[i:i + size], "little", signed=True) for i in range(0, len(data), size)]


def _axes_of(layout: Record, label: str) -> list[Record]:
    """The axes of torch 2.10's ``_MeshLayout``, which keeps a shape and a stride per mesh dim itself (torch 2.13
    keeps one layout per dim in ``axes``); a dim flattened from several has nested tuples."""
    shape = expect(layout.get("shape"), (tuple, list), "device mesh layout shape", label)
    stride = expect(layout.get("stride"), (tuple, list), "device mesh layout stride", label)
    if len(shape) != len(stride):
        raise malformed(label, "device mesh layout", "a stride per dim of its shape", (shape, stride))
    return [Record(shape=tuple(s) if isinstance(s, (tuple, list)) else (s,),
                   stride=tuple(t) if isinstance(t, (tuple, list)) else (t,)) for s, t in zip(shape, stride)]


def _mesh(raw: Any, rank: int, f: BinaryIO, label: str) -> Mesh:
    """The mesh of a DTensor spec: its shape, names and the ranks at its positions, for the cell holding
    ``rank`` (a sub-mesh of a larger mesh is one of several cells of the root's rank map)."""
    names = expect(raw.get("_mesh_dim_names") or raw.get("mesh_dim_names") or (), (tuple, list),
                   "device mesh dim names", label)
    names = tuple(str(n) for n in names)
    old = raw.get("mesh")
    if isinstance(old, StoredTensor):  # older torch: the mesh's rank tensor itself
        if not old.shape or 0 in old.shape:
            raise malformed(label, "device mesh", "a rank tensor of one or more ranks per dim", list(old.shape))
        return Mesh(old.shape, tuple(_read_ints(f, old, label)), names)
    rank_map, layout = raw.get("_rank_map"), raw.get("_layout")
    axes = layout.get("axes") if isinstance(layout, Record) else None
    if not axes and isinstance(layout, Record) and layout.get("shape") is not None:
        axes = _axes_of(layout, label)  # torch 2.10
    if not isinstance(rank_map, StoredTensor) or not axes:
        raise SourceError(f"'{label}': a DTensor's device mesh records no rank tensor")
    expect(axes, (tuple, list), "device mesh layout axes", label)
    flat = _read_ints(f, rank_map, label)
    shape, offsets = [], [0]
    for axis in axes:
        a_shape = field(axis, "shape", dims, label, what="device mesh layout: an axis's shape")
        a_stride = field(axis, "stride", dims, label, what="device mesh layout: an axis's stride")
        if len(a_shape) != len(a_stride):
            raise SourceError(f"'{label}': unreadable device mesh layout {axes!r}")
        shape.append(math.prod(a_shape))
        if not shape[-1] or math.prod(shape) > len(flat):
            raise malformed(label, "device mesh layout", f"axes of 1 to {len(flat)} ranks (the rank tensor's size)",
                            axes)
        positions = [sum(i * s for i, s in zip(idx, a_stride)) for idx in itertools.product(*(range(n) for n in a_shape))]
        offsets = [o + p for o in offsets for p in positions]
    cells = []
    covered: set[int] = set()
    for base in range(len(flat)):
        if base in covered:
            continue
        cell = [base + o for o in offsets]
        if any(p >= len(flat) for p in cell):
            break
        covered.update(cell)
        cells.append(cell)
    for cell in cells:
        ranks = tuple(flat[p] for p in cell)
        if rank in ranks:
            return Mesh(tuple(shape), ranks, names)
    return Mesh(tuple(shape), tuple(flat[p] for p in cells[0]) if cells else (), names)


def _placements(raw: Any, label: str, fqn: str) -> tuple[Placement, ...]:
    out = []
    for p in expect(raw or (), (tuple, list), f"'{fqn}' placements", label):
        kind = getattr(p, "kind", None)
        if kind == "Replicate":
            out.append(Placement("replicate"))
        elif kind == "Shard":
            out.append(Placement("shard", field(p, "dim", integer, label, what=f"'{fqn}' placement Shard's dim")))
        elif kind == "_StridedShard":
            dim = field(p, "dim", integer, label, what=f"'{fqn}' placement _StridedShard's dim")
            factor = p.get("split_factor") or 1
            out.append(Placement("strided", dim, integer(factor, f"'{fqn}' placement's split_factor", label, minimum=1)))
        elif kind == "Partial":
            raise SourceError(f"'{label}': '{fqn}' is a Partial DTensor (unreduced sums); save it after a reduction")
        else:
            raise SourceError(f"'{label}': '{fqn}' has a placement ckpttool does not know: {p!r}")
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Entry:
    """One tensor in one rank's file."""

    rank: int
    file: str
    local: StoredTensor
    global_shape: tuple[int, ...]
    dtype: str
    mesh: Mesh | None
    placements: tuple[Placement, ...]
    order: tuple[tuple[int, tuple[int, ...]], ...] | None = None


def describe(e: Entry) -> str:
    if e.mesh is None:
        return "a plain tensor"
    return f"mesh {list(e.mesh.shape)} placements ({', '.join(str(p) for p in e.placements)})"


def read_entry(fqn: str, value: Any, rank: int, name: str, f: BinaryIO, meshes: dict[int, Mesh]) -> Entry | None:
    if isinstance(value, StoredTensor):
        return Entry(rank, name, value, value.shape, value.dtype, None, ())
    if not isinstance(value, DTensorStandIn):
        return None  # not a tensor (an extra state): nothing to merge
    local, spec, wrapper = value.local, value.spec, value.wrapper
    if not isinstance(local, StoredTensor) or not isinstance(spec, Record) or not isinstance(wrapper, WrapperStandIn):
        raise SourceError(f"'{name}': '{fqn}' is a DTensor without a local tensor or spec")
    try:
        dtype = dtype_name(wrapper.dtype)
    except SourceError:
        raise SourceError(f"'{name}': '{fqn}' has dtype {wrapper.dtype}, which safetensors cannot hold") from None
    if dtype != local.dtype:
        raise SourceError(f"'{name}': '{fqn}' is a {dtype} DTensor whose local tensor is {local.dtype}")
    meta = spec.get("tensor_meta")
    meta_shape = getattr(meta, "shape", wrapper.size) if isinstance(meta, TensorMetaStandIn) else wrapper.size
    if not isinstance(meta_shape, (tuple, list)) or tuple(meta_shape) != wrapper.size:
        other = list(meta_shape) if isinstance(meta_shape, (tuple, list)) else shown(meta_shape)
        raise SourceError(f"'{name}': '{fqn}' records two global shapes: {list(wrapper.size)} and {other}")
    order = _shard_order(spec.get("shard_order"), name, fqn)
    raw_mesh = spec.get("mesh")
    if not isinstance(raw_mesh, Record):
        raise SourceError(f"'{name}': '{fqn}' has no device mesh")
    mesh = meshes.get(id(raw_mesh))
    if mesh is None:
        mesh = meshes[id(raw_mesh)] = _mesh(raw_mesh, rank, f, name)
    if mesh.names and len(mesh.names) != len(mesh.shape):
        raise malformed(name, f"'{fqn}' device mesh dim names", f"{len(mesh.shape)} names, one per mesh dim",
                        mesh.names)
    placements = _placements(spec.get("placements"), name, fqn)
    if len(placements) != len(mesh.shape):
        raise SourceError(f"'{name}': '{fqn}' has {len(placements)} placements on a {len(mesh.shape)}-D mesh")
    for p in placements:
        if p.kind != "replicate" and not 0 <= p.dim < len(wrapper.size):
            raise SourceError(f"'{name}': '{fqn}' of {len(wrapper.size)} dims is sharded on dim {p.dim}")
        if p.split_factor > math.prod(mesh.shape):  # what the later mesh dims split: never more than the ranks
            raise malformed(name, f"'{fqn}' placement {p}", f"a split_factor of at most {math.prod(mesh.shape)} "
                            "(the mesh's size)", p.split_factor)
    if order is not None:
        expected = sorted((m, p.dim) for m, p in enumerate(placements) if p.kind != "replicate")
        if sorted((m, d) for d, dims in order for m in dims) != expected or any(
                placements[m].kind != "shard" for _, dims in order for m in dims):
            raise SourceError(f"'{name}': '{fqn}': its shard_order {[list(e) for e in order]} does not match its "
                              f"placements ({', '.join(str(p) for p in placements)})")
    coord = mesh.coordinate(rank)
    if coord is None:
        raise SourceError(f"'{name}': rank {rank} is not in the device mesh of '{fqn}' (ranks {list(mesh.ranks)}); "
                          "was the file renamed?")
    recorded = raw_mesh.get("_coordinate_on_dim")
    if isinstance(recorded, (tuple, list)) and tuple(recorded) != coord:
        raise SourceError(f"'{name}': '{fqn}': rank {rank} sits at {list(coord)} in the mesh's rank tensor, but the "
                          f"mesh records coordinate {list(recorded)}; was the file renamed?")
    return Entry(rank, name, local, wrapper.size, dtype, mesh, placements, order)


def _shard_order(raw: Any, name: str, fqn: str) -> tuple[tuple[int, tuple[int, ...]], ...] | None:
    """A DTensorSpec's ``shard_order`` (newer torch, e.g. 2.13) as ``(tensor dim, mesh dims)`` entries, or None."""
    if raw is None:
        return None
    entries = []
    for e in raw if isinstance(raw, (tuple, list)) else [None]:
        tensor_dim, mesh_dims = getattr(e, "tensor_dim", None), getattr(e, "mesh_dims", None)
        if not (isinstance(tensor_dim, int) and isinstance(mesh_dims, (tuple, list))
                and all(isinstance(m, int) for m in mesh_dims)):
            raise SourceError(f"'{name}': '{fqn}' has an unreadable shard_order {raw!r:.80}")
        entries.append((int(tensor_dim), tuple(int(m) for m in mesh_dims)))
    return tuple(entries)

