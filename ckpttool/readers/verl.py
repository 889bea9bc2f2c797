"""FSDP / verl per-rank checkpoints: ``model_world_size_{W}_rank_{R}.pt`` holding DTensors.

verl's ``FSDPCheckpointManager.save_checkpoint`` has every rank ``torch.save`` its ``model.state_dict()``
(FSDP2, or FSDP1 under ``SHARDED_STATE_DICT``) to ``model_world_size_{W}_rank_{R}.pt``. Beside them it
writes ``optim_world_size_{W}_rank_{R}.pt`` and ``extra_state_world_size_{W}_rank_{R}.pt`` (optimizer,
scheduler and RNG state: skipped here), ``fsdp_config.json`` (``{"FSDP_version": .., "world_size": ..}``)
and ``huggingface/`` (config.json, generation config, tokenizer; with ``save_hf_model`` also full weights).

Every value of a rank's state dict is a DTensor, pickled as ``_rebuild_wrapper_subclass`` (the *global*
dtype, size and stride) plus a state holding the rank's ``_local_tensor`` and its ``_spec``: the
``DeviceMesh`` (its rank tensor, itself a stored tensor, and in newer torch such as 2.13 a layout of its dims),
the ``placements`` per mesh dim (``Shard(d)``, ``Replicate()``, ``_StridedShard(d, split_factor)``) and
``tensor_meta``. The pickle is walked with stand-ins for exactly these classes: nothing is imported from
torch.distributed and nothing in the file runs.

From the mesh shape, the rank's coordinate in the mesh and the placements, :func:`local_ranges` gives the
global index ranges the rank holds along every tensor dim, following what FSDP2 and DTensor TP do:
``torch.chunk`` splits (ceil-sized chunks, the last smaller, trailing ones empty) and ``_StridedShard``
(FSDP2 over TP on a 2-D mesh) as sharding "right to left": the TP split first, then each TP piece chunked
over the data-parallel dim. A rank's local tensor can hold several non-adjacent ranges; each becomes its
own piece, read in place at its own byte offset. Replicated copies are read once (the lowest present rank).
"""

from __future__ import annotations

import itertools
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from ..dtypes import dtype_name, itemsize
from .. import jsonfile
from ..errors import SourceError, SourceNotFoundError
from ..layout import RAW, Box, Layout, LayoutBuilder, Piece, c_strides
from ..models import ModelInfo
from ..paths import JSON_LIMIT, open_source, read_source
from ..pickle_bounds import charge, ints, text
from ..safe_pickle import Record, record_class
from ..torch_save import StoredTensor, scan
from ..validate import dims, expect, field, integer, malformed, shown

NAME = "verl"
LOOKS_FOR = "model_world_size_W_rank_R.pt files (FSDP/verl per-rank DTensor state dicts)"
RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
#: what verl writes beside the model files: {"FSDP_version": .., "world_size": ..}
FSDP_CONFIG = "fsdp_config.json"

Range = tuple[int, int]


# ----------------------------------------------------------------------------------------------------------
# Stand-ins for the classes a DTensor pickle names
# ----------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class _Wrapper:
    """What ``torch._utils._rebuild_wrapper_subclass`` gives: the global dtype, size and stride."""

    dtype: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, stride: Any, *rest: Any) -> _Wrapper:
    return _Wrapper(dtype, ints(size), ints(stride))


class _DTensor:
    """A DTensor as data: ``wrapper`` (global dtype/size), ``local`` (the rank's stored tensor), ``spec``."""

    def __init__(self, wrapper: Any, state: Any) -> None:
        self.wrapper = wrapper
        charge(state, *(state if isinstance(state, tuple) else ()))
        slots = {}
        if isinstance(state, tuple):
            for part in state:
                if isinstance(part, dict):
                    slots.update(part)
        elif isinstance(state, dict):
            slots = state
        self.local = slots.get("_local_tensor")
        self.spec = slots.get("_spec")


class _Args:
    """A stand-in for a NamedTuple-like class rebuilt with ``NEWOBJ`` and positional arguments."""

    fields: tuple[str, ...] = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> _Args:  # noqa: PYI034 (stand-in, never subclassed further)
        charge(*args, *kwargs.values())
        obj = object.__new__(cls)
        obj.__dict__.update(zip(cls.fields, args))
        obj.__dict__.update(kwargs)
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        charge(state)
        if isinstance(state, dict):
            self.__dict__.update(state)


class _TensorMeta(_Args):
    fields = ("shape", "stride", "dtype")


class _ShardOrderEntry(_Args):
    fields = ("tensor_dim", "mesh_dims")


_Shard, _Replicate, _Strided, _Partial = (record_class(n) for n in ("Shard", "Replicate", "_StridedShard", "Partial"))
_Mesh, _Spec = record_class("DeviceMesh"), record_class("DTensorSpec")


def _allow() -> dict[tuple[str, str], Any]:
    allow: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
        ("torch.serialization", "_get_layout"): text,
        ("torch", "device"): lambda *args: text(args[0]) if args else "cpu",
        ("torch.distributed.device_mesh", "DeviceMesh"): _Mesh,
        ("torch.distributed._mesh_layout", "_MeshLayout"): record_class("_MeshLayout"),
        ("torch.distributed._mesh_layout", "_FlatLayout"): record_class("_FlatLayout"),
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
    }
    # the modules DTensor classes were pickled under, across torch versions
    for module in ("torch.distributed.tensor", "torch.distributed.tensor._api", "torch.distributed._tensor.api",
                   "torch.distributed._tensor"):
        allow[(module, "DTensor")] = _DTensor
    for module in ("torch.distributed.tensor._dtensor_spec", "torch.distributed._tensor.placement_types",
                   "torch.distributed.tensor.placement_types"):
        allow[(module, "DTensorSpec")] = _Spec
        allow[(module, "TensorMeta")] = _TensorMeta
        allow[(module, "ShardOrderEntry")] = _ShardOrderEntry
    for module in ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types"):
        allow[(module, "Shard")] = _Shard
        allow[(module, "Replicate")] = _Replicate
        allow[(module, "_StridedShard")] = _Strided
        allow[(module, "Partial")] = _Partial
        allow[(module, "_Partial")] = _Partial
    return allow


ALLOW = _allow()


# ----------------------------------------------------------------------------------------------------------
# Placement arithmetic (pure)
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Placement:
    """One mesh dim's placement: ``kind`` is ``shard``, ``strided`` (``_StridedShard``) or ``replicate``."""

    kind: str
    dim: int = -1
    split_factor: int = 1

    def __str__(self) -> str:
        if self.kind == "shard":
            return f"Shard({self.dim})"
        if self.kind == "strided":
            return f"_StridedShard({self.dim}, sf={self.split_factor})"
        return "Replicate()"


def _chunk(length: int, parts: int, index: int) -> Range:
    """Elements ``index`` of ``torch.chunk`` of ``length`` into ``parts``: ceil-sized, the last smaller,
    trailing chunks empty."""
    size = -(-length // parts) if length else 0
    start = min(index * size, length)
    return start, min(start + size, length)


def _take(segments: Sequence[Range], start: int, stop: int) -> list[Range]:
    """Elements ``start..stop`` of the concatenation of ``segments``, as global ranges."""
    out: list[Range] = []
    pos = 0
    for a, b in segments:
        n = b - a
        lo, hi = max(start - pos, 0), min(stop - pos, n)
        if lo < hi:
            out.append((a + lo, a + hi))
        pos += n
    return out


def local_ranges(global_shape: Sequence[int], mesh_shape: Sequence[int], coordinate: Sequence[int],
                 placements: Sequence[Placement], order: Sequence[tuple[int, tuple[int, ...]]] | None = None,
                 ) -> list[list[Range]]:
    """For every tensor dim, the global ``[start, stop)`` ranges a rank holds, in the order of its local tensor.

    ``Shard(d)`` on a mesh dim of size ``n`` keeps ``torch.chunk`` piece ``coordinate`` of what the rank
    holds along ``d`` (mesh dims applied left to right, as DTensor does). ``_StridedShard(d, sf)`` is a
    ``Shard`` applied as if after the ``sf`` pieces that later mesh dims make: what the rank holds along
    ``d`` is cut into ``sf`` pieces (``torch.chunk``), each piece chunked ``n`` ways, and the rank keeps its
    chunk of every piece. A later ``Shard(d)`` whose mesh size divides the number of pieces then selects
    whole pieces, which is FSDP2-over-TP's layout, uneven splits included.

    ``order`` is a DTensorSpec's ``shard_order``: ``(tensor dim, mesh dims in the order they shard it)``
    entries; absent, mesh dims shard left to right.

    Example:
        >>> # 6 rows, TP=2 then FSDP=2 over dp: rank (dp=1, tp=0) holds row 2
        >>> local_ranges([6, 4], [2, 2], [1, 0], [Placement("strided", 0, 2), Placement("shard", 0)])[0]
        [(2, 3)]
    """
    segments: list[list[Range]] = [[(0, n)] for n in global_shape]
    steps = list(range(len(placements)))
    if order is not None:
        steps = [m for _, mesh_dims in order for m in mesh_dims]
    for mesh_dim in steps:
        placement = placements[mesh_dim]
        if placement.kind == "replicate":
            continue
        d, n, c = placement.dim, mesh_shape[mesh_dim], coordinate[mesh_dim]
        current = segments[d]
        total = sum(b - a for a, b in current)
        if placement.kind == "strided":
            sf = placement.split_factor
            pieces = [_take(current, *_chunk(total, sf, p)) for p in range(sf)]
            new: list[Range] = []
            for piece in pieces:
                length = sum(b - a for a, b in piece)
                lo, hi = _chunk(length, n, c)
                got = _take(piece, lo, hi)
                new.extend(got if got else [(0, 0)])  # keep a placeholder: later shards select pieces
            segments[d] = new
        elif len(current) > 1 and len(current) % n == 0:
            per = len(current) // n
            segments[d] = current[c * per:(c + 1) * per]
        else:
            segments[d] = _take(current, *_chunk(total, n, c))
    return [[(a, b) for a, b in dim if b > a] or [(0, 0)] for dim in segments]


def local_shape(ranges: Sequence[Sequence[Range]]) -> tuple[int, ...]:
    return tuple(sum(b - a for a, b in dim) for dim in ranges)


def range_pieces(ranges: Sequence[Sequence[Range]]) -> list[tuple[Box, Box]]:
    """The local tensor (C order) cut into boxes contiguous in its bytes: ``(local box, global box)`` pairs."""
    shape = local_shape(ranges)
    if math.prod(shape) == 0:
        return []
    # per dim: (local start, global start, length) of each range
    runs = []
    for dim in ranges:
        pos, items = 0, []
        for a, b in dim:
            if b > a:
                items.append((pos, a, b - a))
                pos += b - a
        runs.append(items)
    out: list[tuple[Box, Box]] = []
    for combo in itertools.product(*runs):
        local = Box(tuple(r[0] for r in combo), tuple(r[2] for r in combo))
        glob = Box(tuple(r[1] for r in combo), tuple(r[2] for r in combo))
        out.extend(_contiguous(local, glob, shape))
    return out


def _contiguous(local: Box, glob: Box, shape: Sequence[int]) -> list[tuple[Box, Box]]:
    """Split a sub-box of a C-order tensor into sub-boxes each contiguous in memory."""
    partial = [d for d in range(len(shape)) if local.sizes[d] != shape[d]]
    if not partial:
        return [(local, glob)]
    last = partial[-1]
    if all(local.sizes[d] == 1 for d in range(last)):
        return [(local, glob)]
    out = []
    for idx in itertools.product(*(range(local.sizes[d]) for d in range(last))):
        lo = tuple(local.offsets[d] + i for d, i in enumerate(idx)) + local.offsets[last:]
        go = tuple(glob.offsets[d] + i for d, i in enumerate(idx)) + glob.offsets[last:]
        sizes = (1,) * last + local.sizes[last:]
        out.append((Box(lo, sizes), Box(go, sizes)))
    return out


# ----------------------------------------------------------------------------------------------------------
# Meshes
# ----------------------------------------------------------------------------------------------------------
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


# ----------------------------------------------------------------------------------------------------------
# The reader
# ----------------------------------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class _Entry:
    """One tensor in one rank's file."""

    rank: int
    file: str
    local: StoredTensor
    global_shape: tuple[int, ...]
    dtype: str
    mesh: Mesh | None
    placements: tuple[Placement, ...]
    order: tuple[tuple[int, tuple[int, ...]], ...] | None = None


def matches(root: Path) -> bool:
    return any(RANK_FILE.match(p.name) for p in root.iterdir() if p.is_file())


def rank_files(root: Path) -> tuple[int, dict[int, str]]:
    """The world size the file names give and the rank files present.

    Raises:
        SourceError: the names give two world sizes, or a rank outside ``0..W-1``.
    """
    found: dict[int, dict[int, str]] = {}
    for p in sorted(root.iterdir()):
        m = RANK_FILE.match(p.name)
        if m and p.is_file():
            found.setdefault(int(m.group(1)), {})[int(m.group(2))] = p.name
    if not found:
        raise SourceNotFoundError(f"'{root}': no model_world_size_W_rank_R.pt files")
    if len(found) > 1:
        sizes = ", ".join(f"{w} ({len(f)} files, e.g. '{next(iter(f.values()))}')" for w, f in sorted(found.items()))
        raise SourceError(f"'{root}': rank files of different world sizes: {sizes}; expected one world size. "
                          "Are two checkpoints mixed in one directory?")
    world, files = next(iter(found.items()))
    outside = sorted(r for r in files if r >= world)
    if outside:
        raise SourceError(f"'{files[outside[0]]}': rank {outside[0]} in a world of {world} ranks "
                          f"(expected ranks 0..{world - 1})")
    return world, files


def read(root: Path, model: ModelInfo | None) -> Layout:
    world, files = rank_files(root)
    _check_fsdp_config(root, world, files)
    builder = LayoutBuilder(str(root), NAME)
    entries: dict[str, list[_Entry]] = {}
    plain = 0
    for rank, name in sorted(files.items()):
        with open_source(root / name, name) as f:
            state = scan(f, label=name, allow=ALLOW)
            if not isinstance(state, dict):
                raise SourceError(f"'{name}': not a state dict (a {type(state).__name__})")
            meshes: dict[int, Mesh] = {}
            for fqn, value in state.items():
                entry = _entry(str(fqn), value, rank, name, f, meshes)
                if entry is None:
                    continue
                plain += entry.mesh is None
                entries.setdefault(str(fqn), []).append(entry)
    parallel: dict[str, int] = {}
    for fqn, found in entries.items():
        first = found[0]
        where = f"'{first.file}'"
        if not builder.declare(fqn, first.global_shape, first.dtype, where=where):
            continue
        for e in found[1:]:
            builder.declare(fqn, e.global_shape, e.dtype, where=f"'{e.file}'")
            if (e.mesh is None) != (first.mesh is None) or (e.mesh and (e.mesh.shape, e.placements, e.order) != (first.mesh.shape, first.placements, first.order)):
                builder.problems.append(
                    f"'{fqn}': ranks disagree on the placement: {_describe(first)} in '{first.file}' but "
                    f"{_describe(e)} in '{e.file}'"
                )
        if first.mesh is not None:
            if math.prod(first.mesh.shape) > math.prod(parallel.values() or [0]):  # the largest mesh: the job's
                parallel = {n or f"mesh{i}": s for i, (n, s) in
                            enumerate(itertools.zip_longest(first.mesh.names, first.mesh.shape, fillvalue=""))}
            if len(set(first.mesh.ranks)) != math.prod(first.mesh.shape):
                builder.problems.append(f"'{fqn}': the device mesh in '{first.file}' repeats ranks: {first.mesh.ranks}")
        _add_pieces(builder, fqn, found, world, files)
    if builder.problems:
        return builder.build()
    meshes_seen = {e.mesh.ranks for found in entries.values() for e in found if e.mesh is not None}
    all_ranks = set().union(*meshes_seen) if meshes_seen else set(range(world))
    if meshes_seen and (len(all_ranks) != world or all_ranks != set(range(world))):
        raise SourceError(
            f"'{root}': the file names give a world of {world} ranks, but the device meshes in the files hold "
            f"{len(all_ranks)} ranks ({sorted(all_ranks)[:8]}{'...' if len(all_ranks) > 8 else ''}); expected "
            f"{world}. Were the files renamed, or saved by a different world size?"
        )
    builder.parallel = parallel
    notes = []
    skipped = sorted(p.name for p in root.iterdir() if p.name.startswith(("optim_world_size_", "extra_state_world_size_")))
    if skipped:
        notes.append(f"skipped {len(skipped)} optimizer/extra-state files ({skipped[0]}, ...)")
    if plain:
        notes.append(f"{plain} plain (non-DTensor) tensor entries read as whole tensors replicated on every rank")
    missing = list(itertools.islice((r for r in range(world) if r not in files), 8))  # the world may be absurd
    if missing:
        more = world - len(files) - len(missing)
        notes.append("missing rank files: " + ", ".join(f"model_world_size_{world}_rank_{r}.pt" for r in missing)
                     + (f" and {more} more" if more else ""))
    return builder.build(notes)


def _check_fsdp_config(root: Path, world: int, files: dict[int, str]) -> None:
    """verl's ``fsdp_config.json`` records the world size; it must agree with the file names."""
    path = root / FSDP_CONFIG
    if not path.is_file():
        return
    try:
        recorded = jsonfile.loads(read_source(path, FSDP_CONFIG, limit=JSON_LIMIT)).get("world_size")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise SourceError(f"'{FSDP_CONFIG}': cannot read it: {e}") from None
    if recorded is not None and recorded != world:
        raise SourceError(f"'{FSDP_CONFIG}' records world_size {recorded}, but the rank files are for a world of "
                          f"{world} (e.g. '{next(iter(files.values()))}'): expected {recorded}, found {world}")


def _describe(e: _Entry) -> str:
    if e.mesh is None:
        return "a plain tensor"
    return f"mesh {list(e.mesh.shape)} placements ({', '.join(str(p) for p in e.placements)})"


def _entry(fqn: str, value: Any, rank: int, name: str, f: BinaryIO, meshes: dict[int, Mesh]) -> _Entry | None:
    if isinstance(value, StoredTensor):
        return _Entry(rank, name, value, value.shape, value.dtype, None, ())
    if not isinstance(value, _DTensor):
        return None  # not a tensor (an extra state): nothing to merge
    local, spec, wrapper = value.local, value.spec, value.wrapper
    if not isinstance(local, StoredTensor) or not isinstance(spec, Record) or not isinstance(wrapper, _Wrapper):
        raise SourceError(f"'{name}': '{fqn}' is a DTensor without a local tensor or spec")
    try:
        dtype = dtype_name(wrapper.dtype)
    except SourceError:
        raise SourceError(f"'{name}': '{fqn}' has dtype {wrapper.dtype}, which safetensors cannot hold") from None
    if dtype != local.dtype:
        raise SourceError(f"'{name}': '{fqn}' is a {dtype} DTensor whose local tensor is {local.dtype}")
    meta = spec.get("tensor_meta")
    meta_shape = getattr(meta, "shape", wrapper.size) if isinstance(meta, _TensorMeta) else wrapper.size
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
    return _Entry(rank, name, local, wrapper.size, dtype, mesh, placements, order)


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


def _add_pieces(builder: LayoutBuilder, fqn: str, found: list[_Entry], world: int, files: dict[int, str]) -> None:
    """One copy of every region: for each group of replicas, the lowest present rank; absent regions of
    missing rank files recorded so the coverage error names them."""
    first = found[0]
    by_rank = {e.rank: e for e in found}
    if first.mesh is None:  # plain tensor: whole on every rank
        e = found[0]
        _emit(builder, fqn, e, [[(0, n)] for n in e.global_shape], present=True)
        return
    mesh, placements = first.mesh, first.placements
    sharded = [i for i, p in enumerate(placements) if p.kind != "replicate"]
    groups: dict[tuple[int, ...], list[int]] = {}
    for r in sorted(set(mesh.ranks)):
        coord = mesh.coordinate(r)
        assert coord is not None
        groups.setdefault(tuple(coord[i] for i in sharded), []).append(r)
    chosen = []
    for key, ranks in sorted(groups.items()):
        present = [r for r in ranks if r in by_rank]
        rank = present[0] if present else ranks[0]
        coord = mesh.coordinate(rank)
        assert coord is not None
        ranges = local_ranges(first.global_shape, mesh.shape, coord, placements, first.order)
        chosen.append((rank, coord, present, ranges))
    wrong = [(rank, coord, ranges) for rank, coord, present, ranges in chosen
             if present and local_shape(ranges) != by_rank[rank].local.shape]
    for rank, coord, ranges in wrong:  # before any region is cut: a global shape the locals contradict may be absurd
        builder.problems.append(
            f"'{fqn}': rank {rank}'s local tensor in '{by_rank[rank].file}' has shape "
            f"{list(by_rank[rank].local.shape)}, "
            f"but the placements ({', '.join(str(p) for p in placements)}) on mesh {list(mesh.shape)} at "
            f"{list(coord)} give {list(local_shape(ranges))} of the global {list(first.global_shape)}"
        )
    if wrong:
        return
    for rank, coord, present, ranges in chosen:
        if present:
            _emit(builder, fqn, by_rank[rank], ranges, present=True)
        elif rank in files:
            builder.problems.append(
                f"'{fqn}' is in {len(found)} of {len(files)} rank files but not in '{files[rank]}' (rank {rank}, "
                f"expected to hold {_region(ranges, first.global_shape)}); are files of different saves mixed?"
            )
        else:
            name = f"model_world_size_{world}_rank_{rank}.pt"
            ghost = _Entry(rank, name, first.local, first.global_shape, first.dtype, mesh, placements)
            _emit(builder, fqn, ghost, ranges, present=False)


def _region(ranges: list[list[Range]], shape: tuple[int, ...]) -> str:
    boxes = [glob for _, glob in range_pieces(ranges)]
    return ", ".join(b.describe(shape) for b in boxes[:4]) + (" ..." if len(boxes) > 4 else "") if boxes else "nothing"


def _emit(builder: LayoutBuilder, fqn: str, e: _Entry, ranges: list[list[Range]], *, present: bool) -> None:
    size = itemsize(e.dtype)
    base = e.local.byte_offset() if present else 0
    if present and base is None and e.local.numel:
        builder.problems.append(f"'{fqn}': the local tensor in '{e.file}' is not stored contiguously; "
                                "ckpttool cannot read it in place")
        return
    shape = local_shape(ranges)
    strides = c_strides(shape)
    tags = (("rank", e.rank),)
    for local, glob in range_pieces(ranges):
        start = sum(o * s for o, s in zip(local.offsets, strides))
        builder.add(fqn, Piece(e.file, fqn, glob, e.dtype, RAW, (base or 0) + start * size, glob.numel * size, tags),
                    present=present)
