"""Quantized checkpoints in the family layer: which targets travel with a scale, what the architecture expects
of them, and the targets of a dequantizing merge.

The formats' facts live in :mod:`ckpttool.quant`; here they meet the plan. Kept quantized, every stored tensor
and every scale is a target of its own (byte copies): the model check accepts the scales of the architecture's
weights, and :mod:`ckpttool.quant.checks` that each has the shape the config's block size gives. Dequantized (``dtype`` given), a weight and its scale become one
:class:`~ckpttool.plan.plan.Dequantize` target under the weight's (FP8) or the tensor's (MXFP4) name, and the
scales are not written.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from operator import attrgetter

from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import Layout, Shape, TensorLayout
from ckpttool.plan.plan import Dequantize, TargetSpec
from ckpttool.errors import ConfigError
from ckpttool.families import mtp
from ckpttool.quant.checks import Problem, check_tensors, tensors_quantized
from ckpttool.quant.decode import FP8_BLOCKS, MXFP4_GROUPS
from ckpttool.quant.formats import (
    FP8,
    Link,
    Quantization,
    expected_shapes,
    links,
    mxfp4_logical_shape,
)
from ckpttool.quant import packed
from ckpttool.quant.packed_decode import FP8_TENSOR, NVFP4_GROUPS, PACKED_INT_GROUPS

#: the key of config.json a dequantizing merge removes
CONFIG_KEY = "quantization_config"
#: how a dequantizing merge without a config is refused: what asked, and what to do instead (``ckpttool diff``
#: words them for its ``dequantize=True``)
ASKS_TO_DEQUANTIZE = "dtype= asks to dequantize"
OR_KEEP_QUANTIZED = "merge without a dtype to keep the checkpoint quantized"


def with_quantized(model: ModelInfo, specs: Sequence[TargetSpec], quant: Quantization | None, *,
                   shapes: Mapping[str, Shape] | None = None) -> ModelInfo:
    """``model`` expecting the quantized tensors ``specs`` hold (the scales of its weights, MXFP4 tensors as
    ``_blocks`` and ``_scales``), for :func:`~ckpttool.families.compare_with_model`; ``shapes``: the specs' shapes
    by name, when the caller has them."""
    if quant is None:  # nothing is expected but the architecture's own tensors
        return model
    present = {s.name: s.shape for s in specs} if shapes is None else shapes
    layers = mtp.expected(model)  # the MTP layers the source holds carry scales like the main ones
    held = {name: shape for n in mtp.held(present, layers) for name, shape in layers[n].items()}
    expected = expected_shapes({**model.disk_shapes, **held}, present, quant)
    if quant is None or expected == {**model.disk_shapes, **held}:
        return model
    return replace(model, disk_shapes=expected)


def problems(specs: Sequence[TargetSpec], layout: Layout, quant: Quantization | None, *, has_config: bool,
             dequantize: bool = False) -> list[Problem]:
    """Every quantization problem of the targets ``specs`` (see :func:`ckpttool.quant.checks.check_tensors`); with
    ``dequantize`` (a merge given a dtype), also quantized tensors without a config that says how to dequantize
    them (a plain cast would turn float32 scales into bfloat16 and leave FP8 values unscaled)."""
    get = layout.tensors.get  # _dtype, inline: 90k targets
    if len(set(map(_NAME, specs))) == len(specs):  # each name once (always, but for a broken adapter): one pass
        tensors = {s.name: (t.dtype, s.shape) for s in specs
                   if (t := get(s.slices[0].source) if s.slices else None) is not None}
    else:  # a name twice: its last spec's dtype (or none) for every spec of it, as _dtype per name has it
        dtypes = {s.name: None if (t := get(s.slices[0].source) if s.slices else None) is None else t.dtype for s in specs}
        tensors = {s.name: (dtype, s.shape) for s in specs if (dtype := dtypes[s.name]) is not None}
    found = check_tensors(tensors, quant, has_config=has_config)
    found += _split_problems(specs, layout, quant)
    if dequantize and not has_config and (quantized := sorted(tensors_quantized(tensors))):
        found.append(Problem(
            "quant-config-missing", None,
            f"{ASKS_TO_DEQUANTIZE}, but there is no config.json to say how: {len(quantized)} tensors are "
            f"quantized ('{quantized[0]}', ...) and only the config's quantization_config gives their block size. Give "
            f"the release's config.json, or {OR_KEEP_QUANTIZED}",
        ))
    return found


def _split_problems(specs: Sequence[TargetSpec], layout: Layout, quant: Quantization | None) -> list[Problem]:
    """FP8 weights whose pieces (TP, FSDP ranks) are cut off their block boundaries: a piece's rows or columns
    that start inside a block share that block's scale with another piece, so which rows it was computed for
    cannot be told (a rank that quantized its own piece has blocks starting at its own row 0). Never guessed."""
    if quant is None or quant.method not in (FP8, *packed.PACKED_METHODS):
        return []
    if max(map(len, map(_PIECES, layout.tensors.values())), default=0) < 2:  # every tensor whole in one piece
        return []
    by_name = {s.name: s for s in specs}
    if quant.method == packed.FP8_MODELOPT:  # one scale for the whole tensor: any cut shares it, as the export does
        return []
    if quant.method != FP8:
        return _packed_split_problems(by_name, layout, quant)
    found = []
    for link, tensor in _split_weights(by_name, layout, (FP8,)):
        for dim, block, word in ((-2, quant.block[0], "row"), (-1, quant.block[1], "column")):
            bad = [c for c in _cuts(tensor, dim) if c % block]
            if bad:
                found.append(Problem(
                    "quant-split", link.weight,
                    f"'{link.weight}' {list(tensor.global_shape)} is split at {word} {bad[0]} (pieces in "
                    f"{_cut_files(tensor, dim, bad)}), not on a {block}-{word} block boundary (weight_block_size "
                    f"{list(quant.block)} in '{quant.label}'): the scale of the block holding {word}s "
                    f"{bad[0] // block * block}..{bad[0] // block * block + block} would serve two pieces, quantized "
                    f"apart or not. ckpttool does not guess; split on multiples of {block}, or dequantize each piece "
                    "where it was quantized",
                ))
    return found


def _packed_split_problems(by_name: Mapping[str, TargetSpec], layout: Layout, quant: Quantization) -> list[Problem]:
    """Packed weights whose pieces are cut off their group boundaries: a column cut inside a group of values (or
    any column cut of a weight with one scale per row) shares that group's scale between two pieces, and a row cut
    of an asymmetric INT weight inside its ``32 / bits`` rows shares a word of zero points. Never guessed."""
    per = 32 // quant.bits if quant.method == packed.PACKED_INT else 2  # values per stored element
    group = quant.block[1]
    found = []
    for link, tensor in _split_weights(by_name, layout, tuple(packed.LINK_OF.values())):
        for dim in (-1, -2):
            cuts = _cuts(tensor, dim)
            if dim == -1:
                bad = [c for c in cuts if not group or c * per % group]
                where = f"packed column {bad[0]} (value column {bad[0] * per})" if bad else ""
                why = (f"not on a boundary of its {group}-value groups (group_size {group}" if group else
                       "while each row has one scale (strategy 'channel'") + f" in '{quant.label}')"
            else:
                rows = 0 if quant.symmetric or quant.method != packed.PACKED_INT else per
                bad = [c for c in cuts if rows and c % rows]
                where = f"row {bad[0]}" if bad else ""
                why = (f"not on a multiple of {rows} rows, the rows one int32 of its zero points packs "
                       f"({quant.bits}-bit, asymmetric, in '{quant.label}')")
            if bad:
                found.append(Problem(
                    "quant-split", link.weight,
                    f"'{link.weight}' {list(tensor.global_shape)} is split at {where} (pieces in "
                    f"{_cut_files(tensor, dim, bad)}), {why}: a scale or zero point would serve two pieces, "
                    f"quantized apart or not. ckpttool does not guess; split on whole groups, or dequantize each "
                    "piece where it was quantized",
                ))
                break
    return found


def _split_weights(by_name: Mapping[str, TargetSpec], layout: Layout, methods: tuple[str, ...]) -> Iterator[
        tuple[Link, TensorLayout]]:
    """Each quantized weight of a link method in ``methods`` that the source holds in two or more pieces."""
    for link in links(by_name)[0]:
        spec = by_name[link.weight]
        tensor = layout.tensors.get(spec.slices[0].source) if spec.slices else None
        if link.method in methods and tensor is not None and len(tensor.global_shape) >= 2 and len(tensor.pieces) > 1:
            yield link, tensor


def _cuts(tensor: TensorLayout, dim: int) -> list[int]:
    """Where ``tensor``'s pieces start along ``dim``, inside it."""
    return sorted({p.box.offsets[dim] for p in tensor.pieces} - {0, tensor.global_shape[dim]})


def _cut_files(tensor: TensorLayout, dim: int, bad: Sequence[int]) -> str:
    """The files of the pieces that start or end at a ``bad`` cut, quoted (four at most)."""
    files = sorted({p.file for p in tensor.pieces if p.box.offsets[dim] in bad or p.box.ends[dim] in bad})
    return ", ".join(repr(f) for f in files[:4])


_PIECES, _NAME = attrgetter("pieces"), attrgetter("name")


def scale_names(names: Sequence[str]) -> set[str]:
    """The scales among ``names`` whose weights are there too (not model weights: they have no dtype of their own
    for ``config.json`` nor for the audit's dtype checks), with the float scales a packed weight travels with
    (NVFP4's global scales, activation scales), which must be positive and finite like them."""
    found = links(names)[0]
    scales = {link.scale for link in found}
    for link in found:
        if link.method in packed.LINK_OF.values():
            scales.update(n for n in packed.companions(link.method, link.logical, names) if n.endswith(_FLOAT_SCALES))
    return scales


def companion_names(names: Sequence[str]) -> set[str]:
    """The integer tensors a packed weight travels with (``weight_shape``, zero points): no model weights, and no
    scales either (a zero point's packed words may be zero or negative)."""
    found = set()
    for link in links(names)[0]:
        if link.method in packed.LINK_OF.values():
            found.update(n for n in packed.companions(link.method, link.logical, names) if not n.endswith(_FLOAT_SCALES))
    return found


_FLOAT_SCALES = ("_global_scale", "_scale_2", "input_scale")


def dequantized(specs: Sequence[TargetSpec], layout: Layout, quant: Quantization) -> list[TargetSpec]:
    """The targets of a dequantizing merge: each linked weight and scale as one computed target, others as they are.

    Call only once :func:`problems` found nothing: the pairs, dtypes and shapes are then consistent.
    """
    by_name = {s.name: s for s in specs}
    if quant.method in packed.PACKED_METHODS:
        return _dequantized_packed(specs, by_name, layout, quant)
    found = [link for link in links(by_name)[0] if link.method == quant.method]
    used = {n for link in found for n in (link.weight, link.scale)}
    out = [s for s in specs if s.name not in used]
    for link in found:
        weight, scale = by_name[link.weight], by_name[link.scale]
        if len(weight.shape) not in ((2, 3) if quant.method == FP8 else (4,)):
            raise ConfigError(f"'{link.weight}' has shape {list(weight.shape)}; ckpttool dequantizes FP8 matrices "
                              "[O, I] or stacked [E, O, I] and MXFP4 stacked experts [E, R, G, 16] only")
        if quant.method == FP8:
            params: tuple[tuple[str, object], ...] = (
                ("block", quant.block), ("ndim", len(weight.shape)), ("ue8m0_bytes", _dtype(scale, layout) == "U8"))
            spec = TargetSpec(link.logical, weight.shape, weight.slices, Dequantize(FP8_BLOCKS, params, weight.shape, scale))
        else:
            spec = TargetSpec(link.logical, mxfp4_logical_shape(weight.shape), weight.slices,
                              Dequantize(MXFP4_GROUPS, (("transpose", True),), weight.shape, scale))
        out.append(spec)
    return out


def _dequantized_packed(specs: Sequence[TargetSpec], by_name: Mapping[str, TargetSpec], layout: Layout,
                        quant: Quantization) -> list[TargetSpec]:
    """:func:`dequantized` of a packed format: each weight from its packed values, scales and companions (read
    whole with each chunk); its activation scales are not written (a dequantized model has no quantized input)."""
    del layout
    method = packed.LINK_OF[quant.method]
    found = [link for link in links(by_name)[0] if link.method == method]
    extras = {link.weight: packed.companions(method, link.logical, by_name) for link in found}
    used = {n for link in found for n in (link.weight, link.scale, *extras[link.weight])}
    out = [s for s in specs if s.name not in used]
    for link in found:
        weight, scale = by_name[link.weight], by_name[link.scale]
        if quant.method == packed.FP8_MODELOPT:  # one scale per tensor: read whole with each chunk, as aux
            out.append(TargetSpec(link.logical, weight.shape, weight.slices,
                                  Dequantize(FP8_TENSOR, (), weight.shape, None, aux=(scale,))))
            continue
        if len(weight.shape) != 2 or len(scale.shape) != 2:
            raise ConfigError(f"'{link.weight}' has shape {list(weight.shape)}; ckpttool dequantizes packed Linear "
                              "weights [O, I] only")
        base = link.weight if method == packed.MODELOPT_LINK else link.weight.removesuffix(packed.PACKED_SUFFIX)
        if quant.method == packed.PACKED_INT:
            params: tuple[tuple[str, object], ...] = (
                ("bits", quant.bits), ("group", quant.block[1]), ("symmetric", quant.symmetric))
            aux = [base + "_shape", *(() if quant.symmetric else (base + "_zero_point",))]
            codec = PACKED_INT_GROUPS
        elif quant.method == packed.NVFP4_CT:
            shape = [base + "_shape"] if base + "_shape" in by_name else []  # compressed-tensors writes none
            params, aux, codec = (("divide", True),), [*shape, base + "_global_scale"], NVFP4_GROUPS
        else:
            params, aux, codec = (("divide", False),), [base + "_scale_2"], NVFP4_GROUPS
        logical = packed.logical_shape(quant.method, weight.shape, scale.shape, quant.bits, quant.block[1])
        dq = Dequantize(codec, params, weight.shape, scale, aux=tuple(by_name[n] for n in aux))
        out.append(TargetSpec(link.logical, logical, weight.slices, dq))
    return out


def refusal(layout: Layout, found: Sequence[Problem]) -> ConfigError:
    """The error a merge raises for a quantized checkpoint whose tensors or config do not agree."""
    count = len(found)
    # a live job's layout has no directory: its pieces are the ranks' tensors, and nothing on disk to audit
    what = f"checkpoint in '{layout.root}'" if layout.root else f"tensors of the {layout.format} job"
    return ConfigError(
        f"the quantized {what} {'are' if not layout.root else 'is'} inconsistent "
        f"({count} problem{'s' if count != 1 else ''}):\n"
        + "\n".join(f"  - {p.message}" for p in found[:40])
        + (f"\n  ... and {count - 40} more" if count > 40 else "")
        + "\nckpttool never guesses a missing scale or a block size"
        + ("; `ckpttool audit` lists the same problems." if layout.root else ".")
    )


def output_config(config: Mapping[str, object] | None, dequantizing: bool) -> Mapping[str, object] | None:
    """``config.json`` for the output: without ``quantization_config`` once the weights are dequantized."""
    if config is None or not dequantizing or CONFIG_KEY not in config:
        return config
    return {k: v for k, v in config.items() if k != CONFIG_KEY}


def _dtype(spec: TargetSpec, layout: Layout) -> str | None:
    tensor = layout.tensors.get(spec.slices[0].source) if spec.slices else None
    return tensor.dtype if tensor is not None else None
