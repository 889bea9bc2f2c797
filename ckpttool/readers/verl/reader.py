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

From the mesh shape, the rank's coordinate in the mesh and the placements,
:func:`ckpttool.layout.placements.local_ranges` gives the global index ranges the rank holds along every tensor dim,
following what FSDP2 and DTensor TP do: ``torch.chunk`` splits (ceil-sized chunks, the last smaller, trailing
ones empty) and ``_StridedShard`` (FSDP2 over TP on a 2-D mesh) as sharding "right to left": the TP split first,
then each TP piece chunked over the data-parallel dim. A rank's local tensor can hold several non-adjacent
ranges; each becomes its own piece, read in place at its own byte offset. Replicated copies are read once (the
lowest present rank).

The reader in four rooms: this module (the files of a step directory, the layout), ``verl_pickle`` (the
stand-ins a rank file's pickle may build), ``verl_entries`` (one tensor entry: its mesh, placements and checks)
and ``verl_pieces`` (the regions of every tensor, as pieces); the arithmetic is ``ckpttool.layout.placements``.
"""

from __future__ import annotations

import itertools
import json
import math
import re
from pathlib import Path

from ckpttool.io import jsonfile
from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import Layout
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.io.paths import JSON_LIMIT, open_inside, read_inside
from ckpttool.io.torch_save import scan
from ckpttool.readers.base import FormatReader
from ckpttool.readers.verl.entries import (
    Mesh,
    describe,
    Entry,
    read_entry,
)
from ckpttool.readers.verl.classes import RankAllow
from ckpttool.readers.verl.pieces import add_pieces

__all__ = ["FSDP_CONFIG", "LOOKS_FOR", "NAME", "RANK_FILE", "READER", "matches", "rank_files", "read"]

NAME = "verl"
LOOKS_FOR = "model_world_size_W_rank_R.pt files (FSDP/verl per-rank DTensor state dicts)"
RANK_FILE = re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$")
#: what verl writes beside the model files: {"FSDP_version": .., "world_size": ..}
FSDP_CONFIG = "fsdp_config.json"


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
    entries: dict[str, list[Entry]] = {}
    plain = 0
    for rank, name in sorted(files.items()):
        with open_inside(root, name) as f:
            state = scan(f, label=name, allow=RankAllow(name, root))
            if not isinstance(state, dict):
                raise SourceError(f"'{name}': not a state dict (a {type(state).__name__})")
            meshes: dict[int, Mesh] = {}
            for fqn, value in state.items():
                entry = read_entry(str(fqn), value, rank, name, f, meshes)
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
                builder.problem(
                    f"'{fqn}': ranks disagree on the placement: {describe(first)} in '{first.file}' but "
                    f"{describe(e)} in '{e.file}'"
                )
        if first.mesh is not None:
            if math.prod(first.mesh.shape) > math.prod(parallel.values() or [0]):  # the largest mesh: the job's
                parallel = {n or f"mesh{i}": s for i, (n, s) in
                            enumerate(itertools.zip_longest(first.mesh.names, first.mesh.shape, fillvalue=""))}
            if len(set(first.mesh.ranks)) != math.prod(first.mesh.shape):
                builder.problem(f"'{fqn}': the device mesh in '{first.file}' repeats ranks: {first.mesh.ranks}")
        add_pieces(builder, fqn, found, world, files)
    if builder.has_problems:
        return builder.build()
    meshes_seen = {e.mesh.ranks for found in entries.values() for e in found if e.mesh is not None}
    all_ranks = set().union(*meshes_seen) if meshes_seen else set(range(world))
    if meshes_seen and (len(all_ranks) != world or all_ranks != set(range(world))):
        raise SourceError(
            f"'{root}': the file names give a world of {world} ranks, but the device meshes in the files hold "
            f"{len(all_ranks)} ranks ({sorted(all_ranks)[:8]}{'...' if len(all_ranks) > 8 else ''}); expected "
            f"{world}. Were the files renamed, or saved by a different world size?"
        )
    builder.set_parallel(**parallel)
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
        recorded = jsonfile.loads(read_inside(root, FSDP_CONFIG, limit=JSON_LIMIT)).get("world_size")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
        raise SourceError(f"'{FSDP_CONFIG}': cannot read it: {e}") from None
    if recorded is not None and recorded != world:
        raise SourceError(f"'{FSDP_CONFIG}' records world_size {recorded}, but the rank files are for a world of "
                          f"{world} (e.g. '{next(iter(files.values()))}'): expected {recorded}, found {world}")


READER = FormatReader(NAME, LOOKS_FOR, matches, read)
