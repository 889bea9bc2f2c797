"""The pieces of one verl tensor: one copy of every region the ranks hold, read in place from the rank files.

For a DTensor, the ranks of the mesh fall into groups of replicas (same coordinate on every sharded mesh dim);
each group's region comes from its lowest present rank, as :func:`~ckpttool.layout.placements.local_ranges` gives it, cut
by :func:`~ckpttool.layout.placements.range_pieces` into boxes contiguous in the local tensor's bytes. A region whose
rank file is missing is still recorded (absent), so the coverage error names the file.
"""

from __future__ import annotations

from ckpttool.io.dtypes import itemsize
from ckpttool.layout.layout import RAW, Piece, c_strides
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.layout.placements import Range, local_ranges, local_shape, range_pieces
from ckpttool.readers.verl.entries import Entry


def add_pieces(builder: LayoutBuilder, fqn: str, found: list[Entry], world: int, files: dict[int, str]) -> None:
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
        builder.problem(
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
            builder.problem(
                f"'{fqn}' is in {len(found)} of {len(files)} rank files but not in '{files[rank]}' (rank {rank}, "
                f"expected to hold {_region(ranges, first.global_shape)}); are files of different saves mixed?"
            )
        else:
            name = f"model_world_size_{world}_rank_{rank}.pt"
            ghost = Entry(rank, name, first.local, first.global_shape, first.dtype, mesh, placements)
            _emit(builder, fqn, ghost, ranges, present=False)


def _region(ranges: list[list[Range]], shape: tuple[int, ...]) -> str:
    boxes = [glob for _, glob in range_pieces(ranges)]
    return ", ".join(b.describe(shape) for b in boxes[:4]) + (" ..." if len(boxes) > 4 else "") if boxes else "nothing"


def _emit(builder: LayoutBuilder, fqn: str, e: Entry, ranges: list[list[Range]], *, present: bool) -> None:
    size = itemsize(e.dtype)
    base = e.local.byte_offset() if present else 0
    if present and base is None and e.local.numel:
        builder.problem(f"'{fqn}': the local tensor in '{e.file}' is not stored contiguously; "
                                "ckpttool cannot read it in place")
        return
    shape = local_shape(ranges)
    strides = c_strides(shape)
    tags = (("rank", e.rank),)
    for local, glob in range_pieces(ranges):
        start = sum(o * s for o, s in zip(local.offsets, strides))
        builder.add(fqn, Piece(e.file, fqn, glob, e.dtype, RAW, (base or 0) + start * size, glob.numel * size, tags),
                    present=present)
