"""Targets made of other targets: a plan's copies carried through a second mapping, checked again.

A plan proves how each of its targets is filled from the source's pieces. Another mapping may then say that a
new tensor is made of slices of those targets (split: an in-memory tensor made of on-disk HuggingFace
tensors), and that only a box of it is wanted (one rank's shard). :func:`compose` gives that box as a target
whose copies reach straight into the source's pieces, so it streams like any other, and proves it is tiled
exactly once. Reads no tensor data.

A transformed tensor (:mod:`ckpttool.plan.transforms`) is carried through too: a new tensor that is a transform of
what its slices make (split's way back: HF's halves to Meta's RoPE pairs), or a whole planned target that is one.
A box of it is then the same transform of a box of its pre tensor (:meth:`~ckpttool.plan.transforms.Permute.pre_box`),
which is what the target's copies tile; a box that cuts through a block the transform permutes is refused.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

from ckpttool.layout.layout import Box, RowIndex, Shape
from ckpttool.plan.tiling import Copy, Slice, check_tiling
from ckpttool.plan.plan import Target
from ckpttool.plan.transforms import Transform
from ckpttool.layout.regions import dim_map, map_region
from ckpttool.quant.decode import FP8_BLOCKS


def compose(name: str, box: Box, slices: Sequence[Slice], targets: Mapping[str, Target],
            transform: Transform | None = None, shape: Shape | None = None) -> tuple[Target | None, list[str]]:
    """``box`` of a tensor made of ``slices`` of ``targets`` (each :attr:`Slice.source` names a target), as a
    target of shape ``box.sizes`` whose copies read the pieces those targets read.

    Args:
        name: the new tensor's name, for messages (the target is called ``name`` too).
        box: the region wanted, in the new tensor's coordinates.
        slices: what the new tensor is made of: ``src`` a box of a target, ``dst`` a box of the new tensor (of
            its pre tensor, with ``transform``).
        targets: the planned targets, by name.
        transform: the new tensor is this transform of the tensor ``slices`` make; ``shape`` is then its whole
            shape (the transform is checked against it).

    Returns:
        The target (transformed, when the new tensor or the one target it is made of is), or None and every
        problem (a slice naming no target, sources of several dtypes, a gap or an overlap in ``box``, a box that
        cuts through a transform's blocks).

    Raises:
        ConfigError: ``transform`` does not fit ``shape`` (see :meth:`~ckpttool.plan.transforms.Permute.bound`).

    Example:
        >>> # rows 2..4 of a tensor that is two planned (2, 3) targets stacked:
        >>> target, problems = compose("t", Box((2, 0), (2, 3)), slices, planned)  # doctest: +SKIP
    """
    carried = _carried(slices, targets, transform)
    if carried is not None:  # a whole transformed target: its pre tensor, as a target of its own, transformed again
        target, transform = carried
        shape, whole = target.shape, Box.whole(target.filled_shape)
        slices = (Slice(target.name, whole, whole),)
        targets = {target.name: replace(target, shape=target.filled_shape, transform=None)}
    bound = None
    if transform is not None:
        if shape is None:
            raise ValueError("compose: a transform needs the new tensor's whole shape")
        bound = transform.bound(shape, name)
        pre = bound.pre_box(shape, box)
        if pre is None:
            return None, [f"'{name}': {box.describe(shape)} cuts through the blocks of {bound.name}, which must stay "
                          "whole in one chunk; shard it along another dim, or in whole blocks"]
        wanted_box, box = box, pre
    elif len(slices) == 1:
        found = _one_copy(name, box, slices[0], targets)
        if found is not None:
            return found, []
    problems: list[str] = []
    copies: list[Copy] = []
    dtypes: set[tuple[str, str]] = set()
    sources: list[str] = []
    hits: list[Slice] | None = None  # the slices meeting ``box``: found once, not once per slice (256 experts' slices)
    for sl in slices:
        target = targets.get(sl.source)
        if target is None:
            problems.append(f"'{name}': is made of '{sl.source}', which the source does not hold")
            continue
        if getattr(target, "dequant", None) is not None:
            if hits is None:
                hits = [s for s in slices if s.dst.intersect(box) is not None]
            if bound is None and hits == [sl]:
                return _dequantized(name, box, sl, target)  # one box of one FP8 matrix: dequantized on its own
            problems.append(f"'{name}': is made of '{sl.source}', which is computed from quantized weights; only "
                            "stored elements are carried through: merge with a dtype first, then use that output")
            continue
        if target.transform is not None:
            problems.append(f"'{name}': is made of '{sl.source}', which is transformed ({target.transform.name}) and "
                            "has a transform of its own, or is one of several parts: only a whole transformed tensor "
                            "is carried through, as it is; merge it first, then use that output")
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
    if bound is None:
        return Target(name, box.sizes, dtype, source_dtype, tuple(copies), tuple(dict.fromkeys(sources))), []
    local = bound.bound(wanted_box.sizes, name)  # the same map on the box: whole blocks, the same dims
    return Target(name, wanted_box.sizes, dtype, source_dtype, tuple(copies), tuple(dict.fromkeys(sources)),
                  transform=local), []


def _one_copy(name: str, box: Box, sl: Slice, targets: Mapping[str, Target]) -> Target | None:
    """What :func:`compose` gives for ``box`` inside one slice of a plain target of one copy that holds all the
    slice's box needs (a rank's chunk of one HF tensor stored whole: most chunks of a split, 367k of DeepSeek-V3's
    at TP8 x PP16 x EP64), in plain arithmetic: the same boxes :func:`~ckpttool.layout.regions.map_region` gives,
    without the ones between; None for anything else, which the general path then composes (or refuses)."""
    target = targets.get(sl.source)
    if target is None or getattr(target, "dequant", None) is not None or target.transform is not None:
        return None
    if len(target.copies) != 1 or not _within(box.offsets, box.sizes, sl.dst):
        return None
    copy = target.copies[0]
    region = _mapped(sl.src, sl.dst, box.offsets, box.sizes)  # the part of the target that fills ``box``
    if not _within(*region, copy.dst):
        return None
    src = _mapped(copy.src, copy.dst, *region)
    offsets, sizes = _mapped(sl.dst, sl.src, *region)
    if sizes != box.sizes or offsets != box.offsets:  # not the whole box: the general path proves or explains it
        return None
    return Target(name, box.sizes, target.dtype, target.source_dtype,
                  (Copy(copy.piece, Box(*src), Box.whole(box.sizes)),), tuple(dict.fromkeys(target.sources)))


def _within(offsets: Shape, sizes: Shape, outer: Box) -> bool:
    """Whether the box ``offsets``, ``sizes`` holds an element and lies inside ``outer`` (of as many dims)."""
    if len(offsets) != len(outer.offsets):
        return False
    for o, n, lo, m in zip(offsets, sizes, outer.offsets, outer.sizes):
        if n <= 0 or o < lo or o + n > lo + m:
            return False
    return True


def _mapped(src: Box, dst: Box, offsets: Shape, sizes: Shape) -> tuple[Shape, Shape]:
    """:func:`~ckpttool.layout.regions.map_region` of a region inside ``dst``, as offsets and sizes: the part of
    ``src`` that fills it."""
    out_offsets, out_sizes = list(src.offsets), list(src.sizes)
    for d, s in enumerate(dim_map(src, dst)):
        if s is not None:
            out_offsets[s] += offsets[d] - dst.offsets[d]
            out_sizes[s] = sizes[d]
    return tuple(out_offsets), tuple(out_sizes)


def _meets(a: Box, b: Box) -> bool:
    """Whether two boxes of as many dims share an element (``a.intersect(b) is not None``)."""
    for ao, an, bo, bn in zip(a.offsets, a.sizes, b.offsets, b.sizes):
        if max(ao, bo) >= min(ao + an, bo + bn):
            return False
    return True


def _dequantized(name: str, box: Box, sl: Slice, target: Target) -> tuple[Target | None, list[str]]:
    """``box`` of a tensor that ``sl``, one box of an FP8 block-scaled matrix ``target`` dequantized, fills whole, as
    a dequantized target of its own: its stored elements those of the box, its scales the blocks the box covers
    (``split --to megatron --dtype``: each chunk of a rank is one box of one HF weight). A box that starts inside a
    block reads only its own elements and the scales of every block it meets; the decoder is told where in the first
    block it starts (``origin``). At most one leading unit dim (an expert's chunk of a stacked Megatron tensor: the
    decoder's stacked form, ``ndim`` 3)."""
    dq, scale = target.dequant, target.scale
    assert dq is not None
    options = dict(dq.params)
    lead = len(box.sizes) - 2
    wanted = sl.dst.intersect(box)
    region = map_region(sl.src, sl.dst, wanted) if wanted is not None else None
    if (dq.method != FP8_BLOCKS or int(options.get("ndim", 2)) != 2 or scale is None or target.transform is not None
            or target.aux or lead not in (0, 1) or any(n != 1 for n in box.sizes[:lead])):
        return None, [f"'{name}': is made of '{sl.source}', which is computed from quantized weights ({dq.method}); "
                      "only FP8 block-scaled matrices are dequantized while splitting: merge with a dtype first, then "
                      "split that output"]
    if wanted != box or region is None or len(region.sizes) != 2:
        return None, [f"'{name}': {box.describe(box.sizes)} is not one box of '{sl.source}' (FP8), which is "
                      "dequantized only as whole boxes of it: merge with a dtype first, then split that output"]
    (b0, b1), (r0, c0), (rows, cols) = tuple(options["block"]), region.offsets, region.sizes  # type: ignore[misc]
    plain, problems = compose(name, box, (sl,), {sl.source: replace(target, dequant=None, scale=None)})
    if plain is None:
        return None, problems
    first = (r0 // b0, c0 // b1)
    blocks = (-(-(r0 + rows) // b0) - first[0], -(-(c0 + cols) // b1) - first[1])
    shape = (*(1,) * lead, *blocks)
    scales, problems = compose(scale.name, Box.whole(shape), (Slice(scale.name, Box(first, blocks), Box.whole(shape)),),
                               {scale.name: scale})
    if scales is None:
        return None, problems
    params = tuple((k, v) for k, v in dq.params if k != "ndim") + ((("ndim", 3),) if lead else ())
    if r0 % b0 or c0 % b1:  # a box that starts inside a block (a TP shard of 288 of 576 rows): decoded from the
        params += (("origin", (r0 % b0, c0 % b1)),)  # blocks it meets, its first element that far into the first
    return replace(plain, sources=tuple(dict.fromkeys((*plain.sources, *scales.sources))),
                   dequant=replace(dq, stored=box.sizes, params=params), scale=scales), []


def _carried(slices: Sequence[Slice], targets: Mapping[str, Target],
             transform: Transform | None) -> tuple[Target, Transform | None] | None:
    """The transformed target a new tensor is, whole and as it is (its transform carried through), or whole through
    the inverse of that transform (the two cancel: its pre tensor, untransformed); None for anything else (a new tensor made of part of a transformed target, or with a transform of its own, is refused
    by :func:`compose`: a transform of a transform is not composed here)."""
    found = [targets[sl.source] for sl in slices if sl.source in targets and targets[sl.source].transform is not None]
    if not found:
        return None
    target = found[0]
    whole = Box.whole(target.shape)
    if len(slices) == 1 and slices[0].src == whole and slices[0].dst == whole:
        if transform is None:
            return target, target.transform  # type: ignore[return-value]
        if transform.inverse() == target.transform:  # the two cancel: the new tensor is the pre tensor, as it is
            return target, None  # (torchtitan's Q rows, permuted to HF's halves and back, re-sharded)
    return None  # refused in compose's loop, with the slice named


class SliceIndex:
    """The slices a tensor is made of, found by the rows (dim 0) of a chunk with a bisect: a stacked tensor of 256
    experts is 256 slices (more with FP8 scales), and a rank's chunk of it meets one, so a plan of 400k chunks
    (DeepSeek-V3 at TP8 x PP16 x EP64) composes each from the slices it meets, not from all of them. Slices of
    several dtypes, or of no dim, are given whole: :func:`compose` then says what is wrong, or needs them all."""

    def __init__(self, slices, targets) -> None:
        self.slices = tuple(slices)
        dtypes = {(targets[s.source].dtype, targets[s.source].source_dtype) for s in self.slices if s.source in targets}
        self.whole = len(dtypes) > 1 or any(not s.dst.sizes for s in self.slices) or len(self.slices) < 8
        self.rows = None if self.whole else RowIndex([s.dst for s in self.slices])
        # slices of plain targets the source holds: one that misses the box adds nothing to compose's answer (nor a
        # message), so only those meeting it are given (a gate chunk is not composed with the up slice beside it)
        self.plain = all(s.source in targets and getattr(targets[s.source], "dequant", None) is None
                         and getattr(targets[s.source], "transform", None) is None for s in self.slices)
        self._by_rows: dict[tuple[int, int], list] = {}  # a row range's slices: a layer's expert is 16 chunks at TP8

    def meeting(self, box: Box):
        """The slices whose rows meet ``box``'s (of plain targets: that meet ``box``), in their order (all of them
        when none does: compose's message)."""
        if self.rows is None or not box.sizes:
            return self.slices
        rows = (box.offsets[0], box.sizes[0])
        found = self._by_rows.get(rows)
        if found is None:
            found = self._by_rows[rows] = [self.slices[i] for i in self.rows.meeting(box)]
        if self.plain:
            found = [s for s in found if _meets(s.dst, box)]
        return tuple(found) if found else self.slices
