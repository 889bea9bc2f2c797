"""ckpttool's sidecar: a small JSON beside each rank's file that records how its pieces fit the whole.

Any training loop can write it with :func:`save_shard`, so nothing has to be guessed when merging: the
global shape, the offsets of each piece, vocab padding, fused parts, and the parallel coordinates.

File pair per rank, in one directory::

    rank-00003-of-00008.safetensors     # the rank's local tensors
    rank-00003-of-00008.ckpttool.json   # this sidecar

Sidecar, version 1 (all keys required unless marked optional)::

    {
      "format": "ckpttool-sidecar",
      "version": 1,
      "rank": 3, "world_size": 8,
      "step": 1200,                               # optional: the training step; sidecars must agree
      "file": "rank-00003-of-00008.safetensors",
      "pieces": [
        {
          "fqn": "model.embed_tokens.weight",     # global tensor name
          "key": "model.embed_tokens.weight",     # name in the data file (optional, default fqn)
          "global_shape": [128512, 8192],         # padded global shape, as trained
          "offsets": [48192, 0],                  # where this piece starts in the global tensor
          "sizes": [16064, 8192],                 # local shape; must match the data file
          "dtype": "BF16",                        # safetensors dtype name
          "padding": [{"dim": 0, "true_size": 128256}],                       # optional
          "fusion": {"dim": 0, "parts": [["a.gate_proj.weight", 64], ["a.up_proj.weight", 64]]},  # optional
          "tp_rank": 3, "pp_stage": 0, "ep_rank": 0, "expert": null     # optional coordinates
        }
      ]
    }

A tensor every rank holds whole (a replicated layer norm) is a piece with zero offsets and full sizes; the
merge takes one copy. Any other overlap, gap, or disagreement between sidecars is an error.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import chain, repeat
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ckpttool.io import jsonfile
from ckpttool.io.dtypes import dtype_name
from ckpttool.layout.layout import Fusion, Padding
from ckpttool.errors import SourceError
from ckpttool.fast.frozen import quick_init

if TYPE_CHECKING:  # a merge reads sidecars without torch; save_shard is given tensors, so torch is loaded then
    import torch

FORMAT = "ckpttool-sidecar"
VERSION = 1
SUFFIX = ".ckpttool.json"
COORDINATES = ("tp_rank", "pp_stage", "ep_rank", "dp_rank", "expert")


@dataclass(frozen=True, slots=True)
class PieceSpec:
    """Where a rank's local tensor sits in its global tensor.

    Example (the seed incident: a vocab of 128256 padded to 128512, split 8 ways, rank 3's piece)::

        PieceSpec.split((128512, 8192), dim=0, index=3, count=8, true_size=128256)
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    padding: tuple[Padding, ...] = ()
    fusion: Fusion | None = None
    coordinates: tuple[tuple[str, int], ...] = ()

    @classmethod
    def replicated(cls, shape: tuple[int, ...], **coordinates: int) -> PieceSpec:
        """A tensor the rank holds whole."""
        return cls(tuple(shape), tuple(0 for _ in shape), coordinates=tuple(coordinates.items()))

    @classmethod
    def split(
        cls,
        global_shape: tuple[int, ...],
        *,
        dim: int,
        index: int,
        count: int,
        true_size: int | None = None,
        fusion: Fusion | None = None,
        **coordinates: int,
    ) -> PieceSpec:
        """Piece ``index`` of ``count`` equal pieces along ``dim`` (``global_shape[dim]`` divisible by count).

        ``true_size`` records that ``dim`` was padded beyond its true length (stripped on merge).
        """
        if global_shape[dim] % count:
            raise ValueError(f"dim {dim} of {list(global_shape)} is not divisible into {count} equal pieces")
        step = global_shape[dim] // count
        offsets = tuple(index * step if d == dim else 0 for d in range(len(global_shape)))
        padding = (Padding(dim, true_size),) if true_size is not None and true_size != global_shape[dim] else ()
        return cls(tuple(global_shape), offsets, padding, fusion, tuple(coordinates.items()))


def shard_name(rank: int, world_size: int) -> str:
    return f"rank-{rank:05d}-of-{world_size:05d}"


def save_shard(
    tensors: Mapping[str, torch.Tensor],
    specs: Mapping[str, PieceSpec],
    directory: str | os.PathLike[str],
    *,
    rank: int,
    world_size: int,
    step: int | None = None,
) -> Path:
    """Write one rank's local tensors and the sidecar describing them. Call on every rank.

    Args:
        tensors: the rank's local tensors by global fqn (on any device; they are copied to CPU).
        specs: for each fqn, where the local tensor sits in the global one.
        directory: the checkpoint directory (created if needed).
        rank: this rank's index in ``0..world_size-1``.
        world_size: how many ranks write into ``directory``.
        step: the training step (optional); a merge refuses sidecars of different steps in one directory.

    Returns:
        The path of the sidecar written.

    Raises:
        ValueError: a tensor has no spec, or its shape does not fit its spec.

    Example:
        >>> save_shard({"w": local}, {"w": PieceSpec.split((8, 4), dim=0, index=rank, count=2)},
        ...            "ckpt", rank=rank, world_size=2)  # doctest: +SKIP
    """
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    base = shard_name(rank, world_size)
    pieces = []
    local = {}
    for fqn, tensor in tensors.items():
        spec = specs.get(fqn)
        if spec is None:
            raise ValueError(f"'{fqn}': no PieceSpec given")
        sizes = tuple(tensor.shape)
        if len(sizes) != len(spec.global_shape) or any(
            o + s > n for o, s, n in zip(spec.offsets, sizes, spec.global_shape)
        ):
            raise ValueError(
                f"'{fqn}': local shape {list(sizes)} at offsets {list(spec.offsets)} does not fit the global "
                f"shape {list(spec.global_shape)}"
            )
        try:
            dtype = dtype_name(tensor.dtype)
        except SourceError as e:
            raise ValueError(f"'{fqn}': {e}") from None
        local[fqn] = tensor.detach().to("cpu").contiguous()
        entry: dict[str, Any] = {
            "fqn": fqn,
            "key": fqn,
            "global_shape": list(spec.global_shape),
            "offsets": list(spec.offsets),
            "sizes": list(sizes),
            "dtype": dtype,
        }
        if spec.padding:
            entry["padding"] = [{"dim": p.dim, "true_size": p.true_size} for p in spec.padding]
        if spec.fusion is not None:
            entry["fusion"] = {"dim": spec.fusion.dim, "parts": [list(p) for p in spec.fusion.parts]}
        entry.update(dict(spec.coordinates))
        pieces.append(entry)
    data_path = out / f"{base}.safetensors"
    _atomic(data_path, lambda p: save_file(local, str(p), metadata={"format": "pt"}))
    sidecar = {"format": FORMAT, "version": VERSION, "rank": rank, "world_size": world_size,
               "file": data_path.name, "pieces": pieces}
    if step is not None:
        sidecar["step"] = step
    side_path = out / f"{base}{SUFFIX}"
    _atomic(side_path, lambda p: p.write_text(json.dumps(sidecar, indent=1)))
    return side_path


def _atomic(path: Path, write: Any) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    write(tmp)
    os.replace(tmp, path)


@quick_init  # built once per piece: ~90k for a DeepSeek-V3-sized model (see ckpttool.fast.frozen)
@dataclass(frozen=True, slots=True)
class SidecarPiece:
    fqn: str
    key: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    dtype: str
    padding: tuple[Padding, ...]
    fusion: Fusion | None
    coordinates: tuple[tuple[str, int], ...]


@dataclass(frozen=True, slots=True)
class Sidecar:
    rank: int
    world_size: int
    file: str
    pieces: tuple[SidecarPiece, ...]
    step: int | None = None


def parse_sidecar(text: str, label: str) -> Sidecar:
    """Validate and parse a sidecar; ``label`` names it in errors.

    Raises:
        SourceError: not JSON, not a sidecar, an unknown version, or a malformed field (named).
    """
    try:
        doc = jsonfile.loads(text)
    except json.JSONDecodeError as e:
        raise SourceError(f"'{label}': not valid JSON ({e})") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise SourceError(f"'{label}': not a ckpttool sidecar (\"format\" must be \"{FORMAT}\")")
    if doc.get("version") != VERSION:
        raise SourceError(
            f"'{label}': sidecar version {doc.get('version')!r} is not supported by this ckpttool "
            f"(it reads version {VERSION}); upgrade ckpttool"
        )
    rank, world = _int(doc, "rank", f"'{label}'"), _int(doc, "world_size", f"'{label}'")
    if not 0 <= rank < world:
        raise SourceError(f"'{label}': rank {rank} is outside world_size {world}")
    file = doc.get("file")
    if not isinstance(file, str):
        raise SourceError(f"'{label}': \"file\" must name the rank's data file")
    raw_pieces = doc.get("pieces")
    if not isinstance(raw_pieces, list):
        raise SourceError(f"'{label}': \"pieces\" must be a list")
    step = _int(doc, "step", f"'{label}'") if "step" in doc else None
    pieces = _plain_pieces(raw_pieces)
    if pieces is None:  # something is wrong, or a piece records padding or fusion: one piece at a time
        pieces = tuple(_piece(p, label) for p in raw_pieces)
    return Sidecar(rank, world, file, pieces, step)


#: the keys of a piece that records no padding and no fusion (what :func:`_plain_pieces` takes)
_PLAIN_KEYS = frozenset(("fqn", "key", "global_shape", "offsets", "sizes", "dtype", *COORDINATES))
_REQUIRED = itemgetter("fqn", "global_shape", "offsets", "sizes", "dtype")


def _plain_pieces(raw: list[Any]) -> tuple[SidecarPiece, ...] | None:
    """The pieces of a sidecar in which no piece records padding or fusion, each passing every check of
    :func:`_piece`, checked a column at a time (a DeepSeek-V3-sized checkpoint is ~90k pieces: a fifth of the
    time of :func:`_piece` on each); None when any check fails or a piece holds another key, for
    :func:`_piece` to say which and why, or to read its records. Accepts only what :func:`_piece` accepts."""
    if not set(map(type, raw)) <= _DICT or not set(chain.from_iterable(raw)) <= _PLAIN_KEYS:
        return None
    try:
        fqns, shapes, offsets, sizes, dtypes = zip(*map(_REQUIRED, raw)) if raw else ((),) * 5
    except KeyError:
        return None
    keys = list(map(dict.get, raw, repeat("key"), fqns))  # the name in the data file, the fqn by default
    dims = (shapes, offsets, sizes)
    if (not set(map(type, fqns)) <= _STR or not set(map(type, keys)) <= _STR
            or not set(map(type, chain(*dims))) <= _LIST):
        return None
    numbers = list(chain.from_iterable(chain(*dims)))
    if not set(map(type, numbers)) <= _INT or min(numbers, default=0) < 0:
        return None
    ndims = list(map(len, shapes))
    if ndims != list(map(len, offsets)) or ndims != list(map(len, sizes)):
        return None
    resolved: dict[Any, str] = {}
    for value in set(map(_hashable, dtypes)):
        try:
            resolved[value] = _dtype(value, "", "")
        except SourceError:
            return None
    # a piece's coordinates in COORDINATES' order, the absent and the null left out: few distinct rows in a sidecar
    rows = list(zip(*(map(dict.get, raw, repeat(k)) for k in COORDINATES))) if raw else []
    if not set(map(type, chain.from_iterable(rows))) <= _INT_OR_NONE:
        return None
    coordinates = {row: tuple((k, v) for k, v in zip(COORDINATES, row) if v is not None) for row in set(rows)}
    return tuple(map(SidecarPiece, fqns, keys, map(tuple, shapes), map(tuple, offsets), map(tuple, sizes),
                     map(resolved.__getitem__, dtypes), repeat(()), repeat(None), map(coordinates.__getitem__, rows)))


def _hashable(value: Any) -> Any:
    # a dtype recorded as a list or an object is no dict key: a tuple stands for it, and _dtype refuses it
    return value if type(value) is str else ("unhashable",)


def _piece(p: Any, label: str) -> SidecarPiece:
    # the hot path of a sidecar merge (one call per piece, ~90k for a DeepSeek-V3-sized model): the message of
    # an error is built only when one is raised, and the dims are checked by C-level set/min, not per element
    if type(p) is not dict or type(p.get("fqn")) is not str:
        raise SourceError(f"'{label}': every piece needs an \"fqn\"")
    fqn = p["fqn"]
    shape, offsets, sizes = (_dims(p, k, label, fqn) for k in ("global_shape", "offsets", "sizes"))
    if not len(shape) == len(offsets) == len(sizes):
        raise SourceError(f"'{label}': '{fqn}': global_shape, offsets and sizes have different lengths")
    dtype = _dtype(p.get("dtype", ""), label, fqn)
    padding: tuple[Padding, ...] = ()
    fusion = None
    raw_padding = p.get("padding")
    if raw_padding:
        where = f"'{label}': '{fqn}'"
        if not isinstance(raw_padding, list):
            raise SourceError(f"{where}: \"padding\" must be a list of {{\"dim\", \"true_size\"}}")
        padding = tuple(Padding(_int(x, "dim", where), _int(x, "true_size", where)) for x in raw_padding)
    if p.get("fusion") is not None:
        f = p["fusion"]
        parts = f.get("parts") if isinstance(f, dict) else None
        if not (
            isinstance(f, dict) and _is_int(f.get("dim")) and isinstance(parts, list)
            and all(isinstance(x, list) and len(x) == 2 and isinstance(x[0], str) and _is_int(x[1]) for x in parts)
        ):
            raise SourceError(f"'{label}': '{fqn}': fusion must be {{\"dim\": int, \"parts\": [[name, size], ...]}}")
        fusion = Fusion(f["dim"], tuple((name, size) for name, size in parts))
    coords = tuple((k, _int(p, k, f"'{label}': '{fqn}'")) for k in COORDINATES if p.get(k) is not None)
    key = p.get("key", fqn)
    if type(key) is not str:
        raise SourceError(f"'{label}': '{fqn}': \"key\" must be a string")
    return SidecarPiece(fqn, key, shape, offsets, sizes, dtype, padding, fusion, coords)


#: dtype names already resolved (a sidecar repeats a handful of them ~90k times)
_DTYPES: dict[str, str] = {}


def _dtype(value: Any, label: str, fqn: str) -> str:
    if type(value) is str and value in _DTYPES:
        return _DTYPES[value]
    try:
        found = dtype_name(value)
    except SourceError:
        raise SourceError(f"'{label}': '{fqn}': unknown dtype {value!r}") from None
    if type(value) is str:
        _DTYPES[value] = found
    return found


_INT = frozenset((int,))
_INT_OR_NONE, _STR, _LIST, _DICT = frozenset((int, type(None))), frozenset((str,)), frozenset((list,)), frozenset((dict,))


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(doc: Any, key: str, where: str) -> int:
    value = doc.get(key) if isinstance(doc, dict) else None
    if not _is_int(value):
        raise SourceError(f"{where}: \"{key}\" must be an integer")
    return value


def _dims(doc: dict[str, Any], key: str, label: str, fqn: str) -> tuple[int, ...]:
    value = doc.get(key)
    # every element exactly an int (JSON's bool is not one) and none negative
    if type(value) is not list or not _INT.issuperset(map(type, value)) or (value and min(value) < 0):
        raise SourceError(f"'{label}': '{fqn}': \"{key}\" must be a list of non-negative integers")
    return tuple(value)
