"""ColossalAI sharded model outputs: ``HybridParallelCheckpointIO`` and ``MoECheckpointIO``
``save_model(..., shard=True)``.

Tensors are whole (gathered over TP, vocab padding removed) under the HuggingFace model's names; what is
sharded is the set of tensors, over files:

- pp == 1: ``pytorch_model-00001.bin`` ... (``torch.save`` of a dict of tensors) or ``model-00001.safetensors``
  ..., and ``pytorch_model.bin.index.json`` / ``model.safetensors.index.json`` (``{"metadata":
  {"total_size": <MiB>}, "weight_map": {name: file}}``; the total is in MiB, as ColossalAI counts it).
- pp > 1: every stage writes ``pytorch_model-stage-{stage:05d}-shard-{idx:05d}.bin`` and its own index
  ``tmp_index_files/pytorch_model.bin.index-stage-{stage:05d}.json``; at the end pp rank 0 merges the stage
  indexes into the final index and deletes ``tmp_index_files/``. A save interrupted before that leaves only
  the stage indexes (and no config.json): they are merged here, with a note.
- MoE (pp > 1 or ep > 1): ``...-stage-{stage:05d}-{ep:05d}-shard-{idx:05d}...`` and stage indexes
  ``...index-stage-{stage:05d}-{ep:05d}.json``. Experts keep their global ids
  (``block_sparse_moe.experts.{id}.w1.weight``); every EP rank also saves the non-expert tensors of its stage,
  so those appear once per EP rank (the final index names one copy; without it the lowest EP rank's copy is
  read, after checking the copies agree on shape and dtype).

``.bin`` shards are walked with :func:`ckpttool.io.torch_save.scan` (no code runs; the classes a shard may name,
with the releases that write them: ``readers/colossalai_classes.py``), safetensors shards through their headers.
Detection looks only at ColossalAI's own names (stage shard names, ``tmp_index_files/``, an index whose shards are
numbered ``-00001`` without HuggingFace's ``-of-``), so HuggingFace directories stay with the ``hf`` reader.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

from ckpttool.io import jsonfile
from ckpttool.model.description import ModelInfo
from ckpttool.io.dtypes import itemsize
from ckpttool.layout.layout import RAW, Box, Layout, Piece
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.io.paths import JSON_LIMIT, contained, inside, list_inside, open_inside, read_inside
from ckpttool.io.safetensors_format import read_header
from ckpttool.io.torch_save import StoredTensor, scan
from ckpttool.readers.base import FormatReader
from ckpttool.readers.colossalai_classes import ShardAllow

NAME = "colossalai"
LOOKS_FOR = ("ColossalAI sharded model files (*-stage-XXXXX[-XXXXX]-shard-XXXXX.bin/.safetensors, "
             "tmp_index_files/, or an index of *-XXXXX.bin/.safetensors shards)")
TMP = "tmp_index_files"
_INDEX = re.compile(r"^(?:pytorch_model|model)(?:\.[^/]+)?\.(?:bin|safetensors)\.index(?:\.[^/]+)?\.json$")
# model files only: optimizer shards (pytorch_optim*, optimizer*) saved alongside are not the model's
_STAGE_INDEX = re.compile(
    r"^(?:pytorch_model|model)(?:\.[^/]+)?\.(?:bin|safetensors)\.index(?:\.[^/]+)?-stage-(\d{5})(?:-(\d{5}))?\.json$")
_STAGE_SHARD = re.compile(
    r"^((?:pytorch_model|model)(?:\.[^/]+)?)-stage-(\d{5})(?:-(\d{5}))?-shard-(\d{5})\.(bin|safetensors)$")
_PLAIN_SHARD = re.compile(r"^(?:pytorch_model|model)(?:\.[^/]+)?-(\d{5})\.(bin|safetensors)$")
_EXPERT = re.compile(r"\.experts\.(\d+)\.")
#: a shard's tensors: name -> (shape, dtype, byte offset, byte length)
_Found = dict[str, tuple[tuple[int, ...], str, int, int]]
#: ColossalAI's total_size is a float sum of MiB; allow for the order of summation
_MB_TOLERANCE = 1e-6


@dataclass(frozen=True, slots=True)
class _Index:
    """One index file: its name, weight map and recorded total size (MiB), and the (stage, EP rank) it is for."""

    name: str
    weight_map: dict[str, str]
    total_size: float | None
    stage: int | None = None
    ep: int | None = None


def matches(root: Path) -> bool:
    if (root / TMP).is_dir() and any(_STAGE_INDEX.match(p.name) for p in (root / TMP).iterdir()):
        return True
    names = [p.name for p in root.iterdir() if p.is_file()]
    if any(_STAGE_SHARD.match(n) for n in names):
        return True
    for n in names:
        if _INDEX.match(n):
            try:
                index = _read_index(root, n)
            except SourceError:
                continue
            files = set(index.weight_map.values())
            if files and all(_PLAIN_SHARD.match(f) or _STAGE_SHARD.match(f) for f in files):
                return True
    return False


def read(root: Path, model: ModelInfo | None) -> Layout:
    builder = LayoutBuilder(str(root), NAME)
    notes: list[str] = []
    cache: dict[str, _Found] = {}
    finals = sorted(p.name for p in root.iterdir() if p.is_file() and _INDEX.match(p.name))
    if len(finals) > 1:
        raise SourceError(f"'{root}': two ColossalAI indexes, {' and '.join(repr(f) for f in finals)}; expected one. "
                          "Are two saves mixed in one directory?")
    stage_indexes = _stage_indexes(root)
    if finals:
        final = _read_index(root, finals[0])
        _check_total(root, final, cache, moe=_is_moe(final.weight_map.values()))
        sources = {name: [rel] for name, rel in final.weight_map.items()}
        if stage_indexes:
            notes.append(f"ignored {TMP}/ ({len(stage_indexes)} stage indexes left behind); read '{final.name}'")
        index_label = final.name
    elif stage_indexes:
        _check_stages(root, stage_indexes)
        for index in stage_indexes:
            _check_total(root, index, cache, moe=False)
        sources = {}
        for index in sorted(stage_indexes, key=lambda i: (i.stage or 0, i.ep or 0)):
            for name, rel in index.weight_map.items():
                sources.setdefault(name, []).append(rel)
        notes.append(f"no final index: the save did not finish; merged the {len(stage_indexes)} stage indexes in "
                     f"{TMP}/ (ColossalAI merges them at the end of a save)")
        index_label = f"{TMP}/"
    else:
        raise SourceNotFoundError(f"'{root}': no ColossalAI index (pytorch_model.bin.index.json, "
                                  f"model.safetensors.index.json or {TMP}/*-stage-*.json)")
    notes.extend(_check_orphans(root, sources, cache))
    tensors = _read_shards(root, sources, index_label, cache)
    stages, eps = set(), set()
    for name, holders in sources.items():
        first = None
        for rel in holders:
            m = _STAGE_SHARD.match(rel)
            if m:
                stages.add(int(m.group(2)))
                if m.group(3):
                    eps.add(int(m.group(3)))
            stored = tensors[rel].get(name)
            if stored is None:
                raise SourceError(f"'{index_label}' puts '{name}' in '{rel}', but that file has no such tensor "
                                  f"(expected '{name}' in '{rel}', found {len(tensors[rel])} other tensors)")
            shape, dtype, offset, length = stored
            if first is None:
                first = rel
                if builder.declare(name, shape, dtype, where=f"'{rel}'"):
                    builder.add(name, Piece(rel, name, Box.whole(shape), dtype, RAW, offset, length, _tags(rel)))
            else:  # a non-expert tensor every EP rank saved: the copies must agree
                builder.declare(name, shape, dtype, where=f"'{rel}'")
    _check_experts(builder, sources, model)
    if len(stages) > 1 or eps:
        builder.set_parallel(pp=max(stages) if stages else 1, **({"ep": max(eps)} if eps else {}))
    dup = sum(len(h) > 1 for h in sources.values())
    if dup:
        notes.append(f"{dup} non-expert tensors are saved by every EP rank; read each once (lowest EP rank)")
    return builder.build(notes)


def _tags(rel: str) -> tuple[tuple[str, int], ...]:
    m = _STAGE_SHARD.match(rel)
    if not m:
        return ()
    return (("pp_stage", int(m.group(2)) - 1),) + ((("ep_rank", int(m.group(3)) - 1),) if m.group(3) else ())


def _is_moe(files) -> bool:
    return any((m := _STAGE_SHARD.match(f)) and m.group(3) for f in files)


def _read_index(root: Path, rel: str) -> _Index:
    try:
        index = jsonfile.loads(read_inside(root, rel, limit=JSON_LIMIT))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"'{rel}': cannot read the index: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise SourceError(f"'{rel}': no 'weight_map' of tensor names to file names")
    metadata = index.get("metadata")
    total = metadata.get("total_size") if isinstance(metadata, dict) else None
    m = _STAGE_INDEX.match(Path(rel).name)
    return _Index(rel, weight_map, total if isinstance(total, (int, float)) else None,
                  int(m.group(1)) if m else None, int(m.group(2)) if m and m.group(2) else None)


def _stage_indexes(root: Path) -> list[_Index]:
    tmp = root / TMP
    if not tmp.is_dir():
        return []
    return [_read_index(root, f"{TMP}/{p.name}") for p in list_inside(root, TMP) if _STAGE_INDEX.match(p.name)]


def _check_stages(root: Path, indexes: list[_Index]) -> None:
    """Every stage (and every EP rank of every stage) has its index; name the first that does not."""
    stages = {i.stage for i in indexes}
    eps = {i.ep for i in indexes}
    moe = eps != {None}
    if moe and None in eps:
        raise SourceError(f"'{TMP}/': stage indexes with and without an EP rank; expected one kind")
    # the highest stage and EP rank any file names, indexes or shards
    for p in root.iterdir():
        m = _STAGE_SHARD.match(p.name)
        if m:
            stages.add(int(m.group(2)))
            if moe and m.group(3):
                eps.add(int(m.group(3)))
    example = indexes[0].name
    for stage in range(1, max(stages) + 1):
        for ep in (range(1, max(e for e in eps if e is not None) + 1) if moe else [None]):
            if any(i.stage == stage and i.ep == ep for i in indexes):
                continue
            tag = f"-stage-{stage:05d}" + (f"-{ep:05d}" if ep is not None else "")
            expected = re.sub(r"-stage-\d{5}(?:-\d{5})?\.json$", f"{tag}.json", example)
            shards = sorted(p.name for p in root.iterdir() if (m := _STAGE_SHARD.match(p.name))
                            and int(m.group(2)) == stage and (ep is None or m.group(3) and int(m.group(3)) == ep))
            found = f"its shards {', '.join(repr(s) for s in shards[:3])} are there" if shards else "no shard of it either"
            what = f"pipeline stage {stage}" + (f", EP rank {ep}" if ep is not None else "")
            raise SourceNotFoundError(
                f"'{expected}' is missing: the index of {what} ({found}); expected "
                f"{max(stages)} stage{'s' if max(stages) > 1 else ''}"
                + (f" x {max(e for e in eps if e is not None)} EP ranks" if moe else "")
                + " from the files present. Restore it, or re-save the checkpoint."
            )


def _check_total(root: Path, index: _Index, cache: dict[str, _Found], *, moe: bool) -> None:
    """An index's total_size (MiB) against the tensors it names. A finished MoE index is not checked: its
    total counts the non-expert copies of every EP rank, its map names one."""
    if index.total_size is None or moe:
        return
    sizes: dict[str, _Found] = {}
    total = 0.0
    for name, rel in index.weight_map.items():
        if rel not in sizes:
            path = inside(root, rel, named_by=index.name)
            if not path.is_file():
                return  # reported with the file and the tensor when the shards are read
            sizes[rel] = _tensors(root, rel, cache)
        if name not in sizes[rel]:
            return  # reported when the shards are read
        shape, dtype, _, _ = sizes[rel][name]
        total += math.prod(shape) * itemsize(dtype) / 1024 / 1024
    if abs(total - index.total_size) > _MB_TOLERANCE * max(1.0, total):
        raise SourceError(f"'{index.name}': metadata.total_size is {index.total_size} MiB, but the tensors it names "
                          f"hold {total} MiB (expected {total}, found {index.total_size}); the index does not "
                          "describe these shards")


def _check_orphans(root: Path, sources: dict[str, list[str]], cache: dict[str, _Found]) -> list[str]:
    """Shards no index names. A finished MoE save leaves some (an EP rank's copies of non-expert tensors
    that the merged index took from another EP rank): those are noted. A shard holding a tensor no index
    names is an error: its tensors would be silently dropped."""
    named = {rel for holders in sources.values() for rel in holders}
    orphans = sorted(p.name for p in root.iterdir()
                     if (_STAGE_SHARD.match(p.name) or _PLAIN_SHARD.match(p.name)) and p.name not in named)
    for rel in orphans:
        unknown = sorted(set(_tensors(root, rel, cache)) - set(sources))
        if unknown:
            more = f" (and {len(unknown) - 1} more tensors)" if len(unknown) > 1 else ""
            raise SourceError(f"'{rel}' holds '{unknown[0]}'{more}, which no index names; expected every tensor of "
                              "a shard in the index. Are two saves mixed in one directory, or is a stage index lost?")
    if not orphans:
        return []
    note = (f"{len(orphans)} shard{'s' if len(orphans) > 1 else ''} no index names hold only copies of indexed "
            f"tensors (an EP rank's non-expert tensors); not read: {', '.join(orphans[:3])}")
    return [note]


def _tensors(root: Path, rel: str, cache: dict[str, _Found] | None = None) -> _Found:
    """Every tensor of a shard: ``name -> (shape, dtype, byte offset, byte length)`` (scanned once per read)."""
    if cache is not None and rel in cache:
        return cache[rel]
    found = _scan_shard(root, rel)
    if cache is not None:
        cache[rel] = found
    return found


def _scan_shard(root: Path, rel: str) -> _Found:
    path = contained(root, rel)
    if rel.endswith(".safetensors"):
        header = read_header(path, rel)
        return {k: (e.shape, e.dtype, e.begin, e.end - e.begin) for k, e in header.entries.items()}
    with open_inside(root, rel) as f:
        state = scan(f, label=rel, allow=ShardAllow(rel, root))
    if not isinstance(state, dict):
        raise SourceError(f"'{rel}': not a dict of tensors (a {type(state).__name__})")
    out = {}
    for key, t in state.items():
        if not isinstance(t, StoredTensor):
            continue  # an extra state
        out[str(key)] = (t.shape, t.dtype, t.required_offset(rel, str(key)), t.numel * itemsize(t.dtype))
    return out


def _read_shards(root: Path, sources: dict[str, list[str]], index_label: str, cache: dict[str, _Found]) -> dict[str, _Found]:
    by_file: dict[str, list[str]] = {}
    for name, holders in sources.items():
        for rel in holders:
            by_file.setdefault(rel, []).append(name)
    out = {}
    for rel, names in sorted(by_file.items()):
        path = inside(root, rel, named_by=index_label)
        if not path.is_file():
            more = f" (and {len(names) - 1} more tensors)" if len(names) > 1 else ""
            m = _STAGE_SHARD.match(rel)
            experts = sorted({int(e.group(1)) for n in names if (e := _EXPERT.search(n))})
            whose = (f" (pipeline stage {int(m.group(2))}" + (f", EP rank {int(m.group(3))}" if m.group(3) else "")
                     + (f": experts {', '.join(map(str, experts))}" if experts else "") + ")") if m else ""
            raise SourceNotFoundError(f"'{index_label}' puts '{names[0]}'{more} in '{rel}'{whose}, which does not "
                                      "exist. Restore that file.")
        out[rel] = _tensors(root, rel, cache)
    return out


def _check_experts(builder: LayoutBuilder, sources: dict[str, list[str]], model: ModelInfo | None) -> None:
    """Each EP rank's file holds only its own experts: ``ep * E/ep .. (ep+1) * E/ep`` (global ids)."""
    if model is None:
        return
    experts = model.config.get("num_local_experts") or model.config.get("num_experts")
    files = {rel for holders in sources.values() for rel in holders}
    eps = {int(m.group(3)) for rel in files if (m := _STAGE_SHARD.match(rel)) and m.group(3)}
    if not isinstance(experts, int) or not eps:
        return
    if min(eps) < 1:  # ColossalAI numbers stages and EP ranks from 1 in file names
        bad = sorted(rel for rel in files if (m := _STAGE_SHARD.match(rel)) and m.group(3) and int(m.group(3)) < 1)
        builder.problem(f"'{bad[0]}': EP rank number 0 in the file name; ColossalAI numbers them from 1")
        return
    ep_size = max(eps)
    if experts % ep_size:
        builder.problem(f"{ep_size} EP ranks cannot split the config's {experts} experts evenly")
        return
    per = experts // ep_size
    for name, holders in sources.items():
        e = _EXPERT.search(name)
        if not e:
            continue
        for rel in holders:
            m = _STAGE_SHARD.match(rel)
            if not (m and m.group(3)):
                continue
            ep = int(m.group(3)) - 1
            if not ep * per <= int(e.group(1)) < (ep + 1) * per:
                builder.problem(
                    f"'{name}' is in '{rel}' (EP rank {ep + 1} of {ep_size}), but expert {e.group(1)} belongs to EP "
                    f"rank {int(e.group(1)) // per + 1}: expected experts {ep * per}..{(ep + 1) * per - 1} in that "
                    "file. Were files of different saves mixed?"
                )


READER = FormatReader(NAME, LOOKS_FOR, matches, read)
