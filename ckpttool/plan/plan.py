"""Plans: every target tensor as a list of box copies from source pieces, checked before any byte is read.

A family adapter (see :mod:`ckpttool.families`) says what each target is made of, as :class:`Slice` s of source
tensors in global coordinates. :func:`plan_merge` intersects those slices with the pieces of the layout, which
gives :class:`Copy` s from a piece's local box to a box of the target, and then proves that the copies tile
every target exactly once. Name mapping, padding strip, TP concatenation along any dim, uneven splits, stacked
experts to per-expert tensors and fused gate/up splits are all just slices.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ckpttool.io.dtypes import FLOAT_DTYPES, ITEMSIZES
from ckpttool.errors import ArgumentError, ConfigError, CoverageError
from ckpttool.fast.frozen import quick_init
from ckpttool.layout.layout import Box, Layout, Shape, TensorLayout
from ckpttool.plan.tiling import Copy, PieceRows, Slice, check_tiling, pieces_meeting, slab_copies, slice_copies
from ckpttool.plan.transforms import Transform

if TYPE_CHECKING:  # a fused target's deltas (.lora), only named here: the plan does not compute them
    from ckpttool.plan.lora import LoraDelta

__all__ = [
    "Dequantize", "Plan", "Target", "TargetSpec", "identity_specs", "plan_covered", "plan_merge", "target_sizes",
    "tensor_specs",
]


@quick_init  # built 90k times in a plan: see ckpttool.fast.frozen
@dataclass(frozen=True, slots=True)
class TargetSpec:
    """What a model mapping says one output tensor is made of.

    With a ``transform`` (:mod:`ckpttool.plan.transforms`), ``slices`` tile the pre tensor of shape
    ``transform.source_shape(shape)`` and the target is ``transform`` of it (Q/K rows from Meta's RoPE order, an
    interleave, a transpose)."""

    name: str
    shape: Shape
    slices: tuple[Slice, ...]
    dequant: Dequantize | None = None
    transform: Transform | None = None


@dataclass(frozen=True, slots=True)
class Dequantize:
    """A target computed, not copied: its slices tile ``stored`` source elements, ``scale`` (if any) its scales',
    and codec ``method`` (:mod:`ckpttool.quant.codecs`, with ``params``) computes its rows: a decoder (to the
    merge's dtype) or an FP8 encoder (to its own ``dtype``). ``aux``: small tensors the decoder reads whole with
    every chunk (a packed weight's zero points, its ``weight_shape``, an NVFP4 global scale)."""

    method: str
    params: tuple[tuple[str, object], ...]
    stored: Shape
    scale: TargetSpec | None
    dtype: str | None = None
    aux: tuple[TargetSpec, ...] = ()


@quick_init  # built 90k times in a plan: see ckpttool.fast.frozen
@dataclass(frozen=True, slots=True)
class Target:
    """One output tensor: its name, shape, output dtype, and the copies that fill it exactly once."""

    name: str
    shape: Shape
    dtype: str
    source_dtype: str
    copies: tuple[Copy, ...]
    sources: tuple[str, ...]
    #: a dequantized target: its copies fill ``dequant.stored`` in ``source_dtype``, ``scale``'s fill the scales
    dequant: Dequantize | None = None
    scale: Target | None = None
    #: a transformed target: its copies fill ``transform.source_shape(shape)``, and it is ``transform`` of that
    #: (checked against ``shape``, its dims plain: see :meth:`~ckpttool.plan.transforms.Permute.bound`)
    transform: Transform | None = None
    #: a fused target: the LoRA deltas (:class:`ckpttool.plan.lora.LoraDelta`) added to its rows, in order, in its
    #: source dtype, before any cast (see :mod:`ckpttool.lora`)
    lora: tuple[LoraDelta, ...] = ()
    #: a dequantized target's whole small inputs besides its scales (:attr:`Dequantize.aux`), in that order
    aux: tuple[Target, ...] = ()

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * ITEMSIZES[self.dtype]

    @property
    def filled_shape(self) -> Shape:
        """The shape the copies tile: the stored elements of a computed target, the pre tensor of a
        transformed one (of a transformed and quantized one: of its stored elements), else the target's own."""
        shape = self.dequant.stored if self.dequant is not None else self.shape
        return shape if self.transform is None else self.transform.source_shape(shape)


@dataclass(frozen=True, slots=True)
class Plan:
    """Every target tensor of the output, in output order, each proven to be tiled exactly once."""

    root: str
    format: str
    targets: tuple[Target, ...]
    notes: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        return sum(target_sizes(self.targets))

    def largest_target_bytes(self) -> int:
        return max(target_sizes(self.targets), default=0)


def target_sizes(targets: Sequence[Target]) -> Iterator[int]:
    """Each target's :attr:`Target.nbytes`, computed at C speed (a plan sums 90k of them more than once)."""
    return map(operator.mul, map(math.prod, map(_SHAPE, targets)), map(ITEMSIZES.__getitem__, map(_DTYPE, targets)))


_SHAPE, _DTYPE = operator.attrgetter("shape"), operator.attrgetter("dtype")


def plan_merge(
    layout: Layout,
    specs: Sequence[TargetSpec] | None = None,
    *,
    dtype: str | None = None,
    notes: Iterable[str] = (),
) -> Plan:
    """Turn a layout and a target mapping into a coverage-checked plan. Reads no tensor data.

    Args:
        layout: the source, from :func:`ckpttool.read_layout`.
        specs: what each target is made of; by default every source tensor becomes one target of the same
            name with recorded padding stripped (see :func:`identity_specs`).
        dtype: output dtype (safetensors name) for floating-point tensors; None keeps the source's.
        notes: extra notes to carry into the plan.

    Returns:
        A :class:`Plan` whose every target is tiled exactly once.

    Raises:
        CoverageError: some target has a gap, an overlap or a copy out of bounds; every problem is listed,
            with the region, the files holding its neighbours, and the likely cause.
        ArgumentError: ``dtype`` is not a floating-point dtype (a cast to an integer type would zero weights).

    Example:
        >>> plan = plan_merge(read_layout("ckpt/"))  # doctest: +SKIP
        >>> plan.nbytes  # doctest: +SKIP
    """
    plan, uncovered_targets = plan_covered(layout, specs, dtype=dtype, notes=notes)
    if uncovered_targets:
        raise CoverageError([problem for _, problems in uncovered_targets for problem in problems])
    return plan


def plan_covered(
    layout: Layout,
    specs: Sequence[TargetSpec] | None = None,
    *,
    dtype: str | None = None,
    notes: Iterable[str] = (),
    keep_dtype: Collection[str] = (),
) -> tuple[Plan, list[tuple[TargetSpec, list[str]]]]:
    """:func:`plan_merge` without raising: the plan of the targets tiled exactly once, and each other target
    with its coverage problems (the audit reports them as findings, one plan for all targets). Targets named in
    ``keep_dtype`` keep their source's dtype whatever ``dtype`` says (a family's rule, e.g. an FP32 router bias)."""
    if dtype is not None and dtype not in FLOAT_DTYPES:
        raise ArgumentError(f"dtype={dtype!r}: floating-point tensors are cast only to {', '.join(sorted(FLOAT_DTYPES))}")
    specs = identity_specs(layout) if specs is None else specs
    targets: list[Target] = []
    failed: list[tuple[TargetSpec, list[str]]] = []
    rows: PieceRows = {}
    for spec in specs:
        cast = None if spec.name in keep_dtype else dtype
        whole = len(spec.slices) == 1 and spec.dequant is None and spec.transform is None
        target = _whole_copy(layout, spec, cast) if whole else None
        if target is not None:  # most targets: one piece copied whole (_plan_target would try it first too)
            targets.append(target)
            continue
        target, found = _plan_target(layout, spec, cast, rows)
        if found:
            failed.append((spec, found))
        elif target is not None:
            targets.append(target)
    return Plan(layout.root, layout.format, tuple(targets), tuple(layout.notes) + tuple(notes)), failed


def identity_specs(layout: Layout) -> list[TargetSpec]:
    """One target per source tensor, same name, recorded padding stripped, fused tensors split into parts."""
    specs: list[TargetSpec] = []
    for tensor in layout.tensors.values():
        specs.extend(tensor_specs(tensor, tensor.fqn))
    return specs


def tensor_specs(tensor: TensorLayout, name: str) -> list[TargetSpec]:
    """The targets one source tensor gives by default: itself (padding stripped), or its fused parts."""
    shape = tensor.true_shape
    if tensor.fusion is None:
        pieces = tensor.pieces  # one piece of the whole tensor (most): its box is the slice's, not a copy of it
        box = pieces[0].box if len(pieces) == 1 else None
        whole = box if box is not None and box.sizes == shape and not any(box.offsets) else Box.whole(shape)
        return [TargetSpec(name, shape, (Slice(tensor.fqn, whole, whole),))]
    specs = []
    start = 0
    dim = tensor.fusion.dim
    for part, size in tensor.fusion.parts:
        offsets = tuple(start if d == dim else 0 for d in range(len(shape)))
        sizes = tuple(size if d == dim else n for d, n in enumerate(shape))
        specs.append(TargetSpec(part, sizes, (Slice(tensor.fqn, Box(offsets, sizes), Box.whole(sizes)),)))
        start += size
    return specs


def _plan_target(layout: Layout, spec: TargetSpec, dtype: str | None,
                 rows: PieceRows | None = None) -> tuple[Target | None, list[str]]:
    plain = len(spec.slices) == 1 and spec.dequant is None and spec.transform is None
    whole = _whole_copy(layout, spec, dtype) if plain else None
    if whole is not None:
        return whole, []
    transform = _bound_transform(spec)
    rows = {} if rows is None else rows
    problems: list[str] = []
    copies: list[Copy] = []
    source_dtypes = set()
    for sl in spec.slices:
        tensor = layout.tensors.get(sl.source)
        if tensor is None:
            problems.append(f"'{spec.name}': its source tensor '{sl.source}' is not in the checkpoint")
            continue
        source_dtypes.add(tensor.dtype)
        if not sl.src.inside(tensor.global_shape):
            problems.append(
                f"'{spec.name}': needs {sl.src.describe()} of '{sl.source}', outside its global shape "
                f"{list(tensor.global_shape)}"
            )
            continue
        copies.extend(slice_copies(sl, pieces_meeting(tensor, sl.src, rows)))
    if len(source_dtypes) > 1:
        problems.append(f"'{spec.name}': its sources have different dtypes {sorted(source_dtypes)}")
    if not spec.slices:
        problems.append(f"'{spec.name}': the whole tensor covered by no piece (the mapping names no source for it)")
    if problems:
        return None, problems
    if spec.dequant is not None:
        return _plan_dequantized(layout, spec, spec.dequant, copies, source_dtypes.pop(), dtype, transform, rows)
    # a transform is a bijection: its pre tensor tiled exactly once is the target tiled exactly once
    filled = spec.shape if transform is None else transform.source_shape(spec.shape)
    problems = check_tiling(spec.name, filled, copies, layout, spec.slices)
    source_dtype = source_dtypes.pop()
    out_dtype = dtype if (dtype is not None and source_dtype in FLOAT_DTYPES) else source_dtype
    sources = tuple(dict.fromkeys(sl.source for sl in spec.slices))
    target = Target(spec.name, spec.shape, out_dtype, source_dtype, tuple(copies), sources, transform=transform)
    return target, problems


def _bound_transform(spec: TargetSpec) -> Transform | None:
    """``spec``'s transform checked against its shape (see :meth:`~ckpttool.plan.transforms.Permute.bound`).

    Raises:
        ConfigError: the transform does not fit the target, or the target is dequantized too (not supported yet;
            quantized, by an encoder, is: the transform makes what it encodes), or it drops elements (a
            :class:`~ckpttool.plan.transforms.Take`, a split's: a merge reads every stored element once).
    """
    if spec.transform is None:
        return None
    if not spec.transform.bijective():
        raise ConfigError(f"'{spec.name}': {spec.transform.name} leaves the other parts unread; a merge's target is a "
                          "transform of every element its slices tile (a family cut that drops elements is a bug)")
    if spec.dequant is not None and spec.dequant.dtype is None:
        raise ConfigError(
            f"'{spec.name}': is both dequantized ({spec.dequant.method}) and transformed ({spec.transform.name}); "
            "a target does one or the other for now. Merge the quantized checkpoint without a dtype (or dequantize it "
            "first with a merge), then transform that output"
        )
    # an encoder quantizes after the transform: it maps the pre tensor to the elements the encoder reads
    return spec.transform.bound(spec.dequant.stored if spec.dequant is not None else spec.shape, spec.name)


def _whole_copy(layout: Layout, spec: TargetSpec, dtype: str | None) -> Target | None:
    """The target :func:`_plan_target` plans when ``spec`` is one slice that is the whole of its source tensor,
    copied as it is from one piece or from slabs cut along one dim (most tensors of a checkpoint, and a plan can
    hold 90k of them: :func:`~ckpttool.plan.tiling.slab_copies`), without the general tiling machinery; None for
    any other spec, or pieces that do not tile it so (the general path then says why)."""
    sl = spec.slices[0]
    tensor = layout.tensors.get(sl.source)
    if tensor is None:
        return None
    box, src, dst = tensor.pieces[0].box if len(tensor.pieces) == 1 else None, sl.src, sl.dst
    if box is None:  # several pieces: the slice must be the whole tensor, and the pieces slabs of it
        if not (src == dst and src.sizes == spec.shape == tensor.global_shape and not any(src.offsets)):
            return None
        copies = slab_copies(spec.shape, tensor.pieces)
        if copies is None:
            return None
    elif box is src and box is dst:  # one box object, as identity_specs and the readers give it: compared once
        if not (box.sizes == spec.shape == tensor.global_shape and not any(box.offsets) and min(box.sizes, default=1) > 0):
            return None
        copies = (Copy(tensor.pieces[0], box, dst),)
    elif not (box.sizes == src.sizes == dst.sizes == spec.shape == tensor.global_shape
              and box.offsets == src.offsets == dst.offsets and not any(box.offsets) and min(box.sizes, default=1) > 0):
        return None
    else:
        copies = (Copy(tensor.pieces[0], box, dst),)
    out_dtype = dtype if (dtype is not None and tensor.dtype in FLOAT_DTYPES) else tensor.dtype
    return Target(spec.name, spec.shape, out_dtype, tensor.dtype, copies, (sl.source,))


def _plan_dequantized(layout: Layout, spec: TargetSpec, dq: Dequantize, copies: list[Copy], stored_dtype: str,
                      dtype: str | None, transform: Transform | None = None,
                      rows: PieceRows | None = None) -> tuple[Target | None, list[str]]:
    """A computed target: its copies tile the stored elements (or, quantized after a ``transform``, the pre tensor
    of those), its scale (if it reads one) is a target of its own."""
    scale, problems = _plan_target(layout, dq.scale, None, rows) if dq.scale is not None else (None, [])
    aux = []
    for extra in dq.aux:
        planned, found = _plan_target(layout, extra, None, rows)
        problems = [*problems, *found]
        if planned is not None:
            aux.append(planned)
    filled = dq.stored if transform is None else transform.source_shape(dq.stored)
    problems, dtype = check_tiling(spec.name, filled, copies, layout, spec.slices) + problems, dq.dtype or dtype
    if dtype is None:
        problems.append(f"'{spec.name}': a dequantized target needs an output dtype")
    if problems or dtype is None:
        return None, problems
    sources = tuple(dict.fromkeys([*(sl.source for sl in spec.slices), *(scale.sources if scale else ()),
                                   *(s for a in aux for s in a.sources)]))
    return Target(spec.name, spec.shape, dtype, stored_dtype, tuple(copies), sources, dq, scale, transform,
                  aux=tuple(aux)), []
