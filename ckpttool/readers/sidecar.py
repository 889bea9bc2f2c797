"""ckpttool's own sidecar format (see :mod:`ckpttool.io.sidecar` for the spec): ``*.ckpttool.json`` per rank."""

from __future__ import annotations

import operator
from itertools import repeat
from operator import attrgetter
from pathlib import Path

from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import RAW, Box, Layout, Piece
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.io.paths import JSON_LIMIT, inside, read_inside
from ckpttool.io.safetensors_format import Entry, read_header
from ckpttool.io.sidecar import SUFFIX, Sidecar, parse_sidecar, shard_name
from ckpttool.readers.base import FormatReader

NAME = "sidecar"
LOOKS_FOR = f"*{SUFFIX} sidecars beside per-rank safetensors (ckpttool sidecar)"


def matches(root: Path) -> bool:
    return any(root.glob(f"*{SUFFIX}"))


def read(root: Path, model: ModelInfo | None) -> Layout:
    paths = sorted(root.glob(f"*{SUFFIX}"))
    if not paths:
        raise SourceNotFoundError(f"'{root}': no *{SUFFIX} sidecar")
    sidecars = [parse_sidecar(_text(root, p.name), p.name) for p in paths]
    worlds = {s.world_size for s in sidecars}
    if len(worlds) > 1:
        raise SourceError(
            f"'{root}': sidecars disagree on world_size ({sorted(worlds)}); are two checkpoints mixed in one directory?"
        )
    world = worlds.pop()
    first_of_step: dict[int | None, str] = {}
    for path, s in zip(paths, sidecars):
        first_of_step.setdefault(s.step, path.name)
    if len(first_of_step) > 1:
        listed = ", ".join(f"'{name}' is step {'unrecorded' if step is None else step}" for step, name in first_of_step.items())
        raise SourceError(f"'{root}': sidecars of different training steps are mixed ({listed}); keep one step's files")
    ranks: dict[int, str] = {}
    for path, s in zip(paths, sidecars):
        if s.rank in ranks:
            raise SourceError(f"'{path.name}' and '{ranks[s.rank]}' both claim rank {s.rank}")
        ranks[s.rank] = path.name
    builder = LayoutBuilder(str(root), NAME)
    builder.mark_missing(*(f"{shard_name(r, world)}{SUFFIX}" for r in range(world) if r not in ranks))
    for path, s in zip(paths, sidecars):
        data = inside(root, s.file, named_by=path.name)
        if not data.exists():  # a FIFO or a device is there: read_header says it is not a regular file
            raise SourceNotFoundError(f"'{path.name}' describes '{s.file}', which does not exist")
        header = read_header(data, s.file)
        where, entries = f"'{path.name}'", header.entries
        if _add_plain(builder, s, entries, where):
            continue
        for p in s.pieces:
            entry = entries.get(p.key)
            if entry is None:
                raise SourceError(f"'{s.file}': has no tensor '{p.key}' (for '{p.fqn}', named by {where})")
            if entry.shape != p.sizes or entry.dtype != p.dtype:
                raise SourceError(
                    f"'{s.file}': '{p.key}' is {entry.dtype} {list(entry.shape)} but {where} records "
                    f"{p.dtype} {list(p.sizes)}"
                )
            if builder.declare(p.fqn, p.global_shape, p.dtype, where=where, padding=p.padding, fusion=p.fusion):
                tags = (("rank", s.rank), *p.coordinates)
                builder.add(p.fqn, Piece(s.file, p.key, Box(p.offsets, p.sizes), p.dtype, RAW, entry.begin,
                                         entry.end - entry.begin, tags))
    notes = [f"{len(ranks)} of {world} rank sidecars present"] if len(ranks) != world else []
    return builder.build(notes)


def _add_plain(builder: LayoutBuilder, s: Sidecar, entries: dict[str, Entry], where: str) -> bool:
    """Add the pieces of sidecar ``s`` to ``builder`` when every one is in its data file (``entries``) with the
    shape and dtype the sidecar records, and none records padding or fusion, checked a column at a time (a rank
    of a DeepSeek-V3-sized checkpoint holds 11k pieces); False, having added nothing, otherwise: the loop over
    each piece then names what is wrong, or reads the records."""
    pieces = s.pieces
    keys = list(map(_KEY, pieces))
    found = list(map(entries.get, keys))
    sizes, dtypes = list(map(_SIZES, pieces)), list(map(_DTYPE, pieces))
    if (None in found or list(map(_SHAPE, found)) != sizes or list(map(_DTYPE, found)) != dtypes
            or any(map(_PADDING, pieces)) or any(p.fusion is not None for p in pieces)):
        return False
    rank = ("rank", s.rank)
    tags = {c: (rank, *c) for c in set(map(_COORDINATES, pieces))}  # a handful of distinct coordinates per rank
    begins = list(map(_BEGIN, found))
    made = list(map(Piece, repeat(s.file), keys, map(Box, map(_OFFSETS, pieces), sizes), dtypes, repeat(RAW), begins,
                    map(operator.sub, map(_END, found), begins), map(tags.__getitem__, map(_COORDINATES, pieces))))
    builder.add_pieces(list(map(_FQN, pieces)), list(map(_GLOBAL_SHAPE, pieces)), made, where)
    return True


_KEY, _FQN, _SIZES, _DTYPE, _SHAPE = attrgetter("key"), attrgetter("fqn"), attrgetter("sizes"), attrgetter("dtype"), attrgetter("shape")
_PADDING, _COORDINATES, _OFFSETS = attrgetter("padding"), attrgetter("coordinates"), attrgetter("offsets")
_GLOBAL_SHAPE, _BEGIN, _END = attrgetter("global_shape"), attrgetter("begin"), attrgetter("end")


def _text(root: Path, name: str) -> str:
    try:
        return read_inside(root, name, limit=JSON_LIMIT).decode("utf-8")  # no link out of the source
    except UnicodeDecodeError:
        raise SourceError(f"'{name}': not valid JSON (not UTF-8 text)") from None


READER = FormatReader(NAME, LOOKS_FOR, matches, read)
