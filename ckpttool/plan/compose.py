"""Targets made of other targets: a plan's copies carried through a second mapping, checked again.

A plan proves how each of its targets is filled from the source's pieces. Another mapping may then say that a
new tensor is made of slices of those targets (split: an in-memory tensor made of on-disk HuggingFace
tensors), and that only a box of it is wanted (one rank's shard). :func:`compose` gives that box as a target
whose copies reach straight into the source's pieces, so it streams like any other, and proves it is tiled
exactly once. Reads no tensor data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ckpttool.layout.layout import Box
from ckpttool.plan.plan import Copy, Slice, Target, check_tiling
from ckpttool.layout.regions import map_region


def compose(name: str, box: Box, slices: Sequence[Slice], targets: Mapping[str, Target]) -> tuple[Target | None, list[str]]:
    """``box`` of a tensor made of ``slices`` of ``targets`` (each :attr:`Slice.source` names a target), as a
    target of shape ``box.sizes`` whose copies read the pieces those targets read.

    Args:
        name: the new tensor's name, for messages (the target is called ``name`` too).
        box: the region wanted, in the new tensor's coordinates.
        slices: what the new tensor is made of: ``src`` a box of a target, ``dst`` a box of the new tensor.
        targets: the planned targets, by name.

    Returns:
        The target, or None and every problem (a slice naming no target, sources of several dtypes, a gap or
        an overlap in ``box``).

    Example:
        >>> # rows 2..4 of a tensor that is two planned (2, 3) targets stacked:
        >>> target, problems = compose("t", Box((2, 0), (2, 3)), slices, planned)  # doctest: +SKIP
    """
    problems: list[str] = []
    copies: list[Copy] = []
    dtypes: set[tuple[str, str]] = set()
    sources: list[str] = []
    for sl in slices:
        target = targets.get(sl.source)
        if target is None:
            problems.append(f"'{name}': is made of '{sl.source}', which the source does not hold")
            continue
        if getattr(target, "dequant", None) is not None:
            problems.append(f"'{name}': is made of '{sl.source}', which is computed from quantized weights; only "
                            "stored elements are carried through: merge with a dtype first, then use that output")
            continue
        dtypes.add((target.dtype, target.source_dtype))
        wanted = sl.dst.intersect(box)
        if wanted is None:
            continue
        sources.extend(target.sources)
        region = map_region(sl.src, sl.dst, wanted)  # the part of the target that fills ``wanted``
        assert region is not None
        for copy in target.copies:
            common = copy.dst.intersect(region)
            if common is None:
                continue
            src = map_region(copy.src, copy.dst, common)
            dst = map_region(sl.dst, sl.src, common)
            assert src is not None and dst is not None
            copies.append(Copy(copy.piece, src, dst.shift(box.offsets)))
    if not dtypes and not problems:
        problems.append(f"'{name}': the mapping names no tensor it is made of")
    if len(dtypes) > 1:
        problems.append(f"'{name}': its parts have different dtypes {sorted(d for d, _ in dtypes)}")
    if problems:
        return None, problems
    problems = check_tiling(name, box.sizes, copies)
    if problems:
        return None, problems
    dtype, source_dtype = dtypes.pop()
    return Target(name, box.sizes, dtype, source_dtype, tuple(copies), tuple(dict.fromkeys(sources))), []
