"""Quantization on merge (``quantize="fp8"``, ``quantize="mxfp4"``): which targets become FP8 or MXFP4, and the
config that says so.

What is quantized is read from the architecture's on-disk names and shapes, as FP8 releases do it (DeepSeek-V3,
Qwen3-FP8): the 2-D ``.weight`` of a Linear layer of attention, MLP and experts inside the decoder layers. Kept as
they are: norms, embeddings, ``lm_head`` (and an MTP layer's ``shared_head``), router weights (``mlp.gate``,
``block_sparse_moe.gate``, ``mlp.router``, ``shared_expert_gate``) and every bias; stacked 3-D experts too (no FP8
loader reads them block-scaled). Each quantized weight becomes two computed targets, its E4M3 values and its
float32 ``weight_scale_inv`` (:mod:`ckpttool.quant.encode`); ``config.json`` gets a ``quantization_config`` whose
``modules_to_not_convert`` names every module kept, in the patterns transformers matches.

MXFP4 is gpt-oss's release layout (openai/gpt-oss-20b and -120b): each expert tensor ``mlp.experts.gate_up_proj``
and ``mlp.experts.down_proj`` (named ``[E, in, out]``) becomes ``_blocks`` (``[E, out, in/32, 16]``) and ``_scales``
(``[E, out, in/32]``), two computed targets reading the same experts (:mod:`ckpttool.quant.encode`), after the
family's transform where it has one (a Megatron-Core source's fc1 interleaved and transposed); everything else is
written in bfloat16 (the release's dtype; another with ``dtype=``) and ``config.json`` gets the release's
``quantization_config`` (:data:`MXFP4_CONFIG`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ckpttool.io.dtypes import FLOAT_DTYPES
from ckpttool.layout.layout import Layout
from ckpttool.plan.plan import Dequantize, Plan, TargetSpec
from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.families.quantize_packed import PACK_METHODS, PackScheme, pack_scheme, packed_config, packed_specs
from ckpttool.quant.encode import FP8_SCALES, FP8_VALUES, MXFP4_BLOCKS, MXFP4_SCALES
from ckpttool.quant.formats import (
    BLOCKS_SUFFIX,
    FP8_SCALE_SUFFIX,
    MAX_FP8_BLOCK,
    MXFP4,
    MXFP4_GROUP,
    SCALES_SUFFIX,
    Quantization,
    fp8_scale_name,
    fp8_scale_shape,
    mxfp4_stored_shapes,
)

#: the methods ``quantize=`` accepts
METHODS = ("fp8", MXFP4, *PACK_METHODS)
#: the model types whose release layout MXFP4 is (transformers quantizes and loads only gpt-oss's experts so)
MXFP4_FAMILIES = ("gpt_oss",)
#: the expert tensors an MXFP4 release holds as ``_blocks`` and ``_scales``
_MXFP4_EXPERTS = re.compile(r"(?:^|\.)mlp\.experts\.(?:gate_up_proj|down_proj)$")
#: the ``quantization_config`` of openai/gpt-oss-20b and -120b, as their config.json holds it
MXFP4_CONFIG = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                           "model.embed_tokens", "lm_head"], "quant_method": MXFP4}
#: what ``quantize="mxfp4"`` writes everything but the experts in, unless a dtype is given: the release's
MXFP4_DTYPE = "bfloat16"
#: a module inside a decoder layer (MTP layers included)
_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")
#: the last part of a module name that is never quantized: norms, embeddings, heads, routers
_KEPT = re.compile(r"(?:norm|embed_tokens|embeddings?|lm_head|shared_head|head|gate|router)$")


def quantize_block(method: str | None, block: int | tuple[int, int] | None,
                   group: int | None = None) -> tuple[int, int] | str | PackScheme | None:
    """The block size a merge quantizes to FP8 in, :data:`~ckpttool.quant.formats.MXFP4` for MXFP4, the
    :class:`~ckpttool.families.quantize_packed.PackScheme` of an INT4 packing (``group`` values per scale), or None
    when it does not quantize.

    Raises:
        ArgumentError: an unknown method, a block size that is not one or two positive integers (or given
            with MXFP4, whose groups are 32 values, or INT4), a group given without INT4.
    """
    if group is not None and method not in PACK_METHODS:
        raise ArgumentError(f"group={group!r} is the INT4 group size of quantize='int4'; give quantize='int4' too")
    if method is None:
        if block is not None:
            raise ArgumentError(f"block={block!r} is the FP8 block size of quantize='fp8'; give quantize='fp8' too")
        return None
    if method in PACK_METHODS:
        if block is not None:
            raise ArgumentError(f"block={block!r} is the FP8 block size; quantize={method!r} scales groups of values "
                                "along a row: give group=")
        return pack_scheme(method, group)
    if method == MXFP4:
        if block is not None:
            raise ArgumentError(f"block={block!r} is the FP8 block size; quantize='mxfp4' scales groups of "
                                f"{MXFP4_GROUP} values and takes no block")
        return MXFP4
    if method != "fp8":
        raise ArgumentError(f"quantize={method!r}: ckpttool quantizes to fp8, to compressed-tensors' int4, int4-asym "
                            f"or nvfp4, or gpt-oss's experts to {MXFP4}")
    sizes = (128, 128) if block is None else (block, block) if isinstance(block, int) else tuple(block)
    if len(sizes) != 2 or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in sizes):
        raise ArgumentError(f"block={block!r}: the FP8 block size is one or two positive integers (128, or 128x128)")
    if max(sizes) > MAX_FP8_BLOCK:  # ckpttool would refuse to read its own output's weight_block_size
        raise ArgumentError(f"block={block!r}: the FP8 block size is at most {MAX_FP8_BLOCK} rows or columns")
    return sizes[0], sizes[1]


def quantizes(name: str, shape: tuple[int, ...], dtype: str | None) -> bool:
    """Whether the target ``name`` of ``shape`` and ``dtype`` is a Linear weight an FP8 release quantizes."""
    if not name.endswith(".weight") or len(shape) != 2 or dtype not in FLOAT_DTYPES or not _LAYER.search(name):
        return False
    return _KEPT.search(name.removesuffix(".weight")) is None


def refuse_requantizing(block: tuple[int, int] | str | PackScheme, quant: Quantization | None, source: str) -> None:
    """Refuse to quantize (in ``block``, as :func:`quantize_block` gives it) a source whose config declares a
    quantization ``quant`` already: the config alone decides it, so a merge asks before reading the checkpoint.

    Raises:
        ConfigError: ``quant`` is not None, naming ``source`` and what it is quantized to.
    """
    if quant is not None:
        _quantized_already(_method(block), source, quant.describe())


def _quantized_already(method: str, source: str, what: str) -> None:
    raise ConfigError(
        f"quantize='{method}': '{source}' is quantized already ({what}); quantizing "
        f"{'FP8' if method == 'fp8' else 'quantized'} values again would compound their rounding. Dequantize it "
        "first (dtype='bfloat16'), or merge it without quantize= to keep it as it is")


def _method(block: tuple[int, int] | str | PackScheme) -> str:
    """The ``quantize=`` name of what :func:`quantize_block` gave."""
    if isinstance(block, PackScheme):
        return "nvfp4" if block.nvfp4 else "int4"
    return MXFP4 if block == MXFP4 else "fp8"


def quantized_specs(specs: Sequence[TargetSpec], layout: Layout, block: tuple[int, int] | str | PackScheme, *, source: str,
                    quant: Quantization | None, has_model: bool, model_type: str | None = None) -> list[TargetSpec]:
    """The targets of a quantizing merge: each weight :func:`quantizes` picks as its E4M3 values and its float32
    scales (two computed targets reading the same source rows), the others as they are; with ``block`` MXFP4,
    gpt-oss's experts as their ``_blocks`` and ``_scales`` (:func:`mxfp4_specs`); with an ``PackScheme``, the same
    weights as compressed-tensors' packed INT4 (:func:`~ckpttool.families.quantize_packed.packed_specs`).

    Raises:
        ConfigError: the source is quantized already, has no config (or none transformers knows), or holds no
            weight to quantize; MXFP4 for a model that is not gpt-oss.
    """
    method = _method(block)
    if not has_model:
        raise ConfigError(
            f"quantize='{method}' needs the model's config (none usable for '{source}'): which tensors are Linear weights "
            "of attention and MLP (quantized) and which are norms, embeddings, lm_head and routers (kept) is read "
            "from the architecture's names. Give config='PATH'")
    dtypes = {s.name: _dtype(s, layout) for s in specs}
    already = sorted(n for n, d in dtypes.items() if d is not None and d not in FLOAT_DTYPES and (
        d.startswith("F8") or n.endswith((FP8_SCALE_SUFFIX, "_blocks", "_scales"))))
    if quant is not None:
        refuse_requantizing(block, quant, source)
    if already:
        _quantized_already(method, source, f"{len(already)} quantized tensors ('{already[0]}', ...)")
    if method == MXFP4:
        return mxfp4_specs(specs, dtypes, source=source, model_type=model_type)
    if isinstance(block, PackScheme):
        return packed_specs(specs, dtypes, block, source=source, quantizes=quantizes)
    out: list[TargetSpec] = []
    for spec in specs:
        if not quantizes(spec.name, spec.shape, dtypes[spec.name]):
            out.append(spec)
            continue
        rows = spec.shape[0]
        values = Dequantize(FP8_VALUES, (("block", block),), spec.shape, None, "F8_E4M3")
        scales = Dequantize(FP8_SCALES, (("block", block), ("rows", rows)), spec.shape, None, "F32")
        # after the family's transform, if any (torchtitan's q/k rows): it makes the weight the encoder reads
        out.append(TargetSpec(spec.name, spec.shape, spec.slices, values, spec.transform))
        out.append(TargetSpec(fp8_scale_name(spec.name), fp8_scale_shape(spec.shape, block), spec.slices, scales,
                              spec.transform))
    if len(out) == len(specs):
        raise ConfigError(f"quantize='fp8': '{source}' holds no Linear weight of a decoder layer in a floating-point "
                          f"dtype ({len(specs)} tensors): nothing to quantize")
    return out


def mxfp4_specs(specs: Sequence[TargetSpec], dtypes: Mapping[str, str | None], *, source: str,
                model_type: str | None) -> list[TargetSpec]:
    """gpt-oss's expert tensors as their MXFP4 ``_blocks`` and ``_scales`` (computed targets reading the same
    experts, after the spec's transform), the other targets as they are.

    Raises:
        ConfigError: the model is not gpt-oss, holds no floating-point expert tensor, or one whose input dim is
            not a multiple of 32.
    """
    if model_type not in MXFP4_FAMILIES:
        raise ConfigError(
            f"quantize='mxfp4' writes gpt-oss's MXFP4 release layout (its experts' _blocks and _scales); '{source}' "
            f"is a {model_type!r} model, whose MXFP4 layout transformers does not load. Use quantize='fp8'")
    out: list[TargetSpec] = []
    for spec in specs:
        if not (_MXFP4_EXPERTS.search(spec.name) and len(spec.shape) == 3 and dtypes[spec.name] in FLOAT_DTYPES):
            out.append(spec)
            continue
        stored = mxfp4_stored_shapes(spec.shape)
        if stored is None:
            raise ConfigError(
                f"quantize='mxfp4': '{spec.name}' {list(spec.shape)} has {spec.shape[1]} inputs per expert, not a "
                f"multiple of {MXFP4_GROUP} (MXFP4 scales groups of {MXFP4_GROUP} inputs); merge it without quantize=")
        for suffix, method, shape in ((BLOCKS_SUFFIX, MXFP4_BLOCKS, stored[0]), (SCALES_SUFFIX, MXFP4_SCALES, stored[1])):
            computed = Dequantize(method, (), spec.shape, None, "U8")
            out.append(TargetSpec(spec.name + suffix, shape, spec.slices, computed, spec.transform))
    if len(out) == len(specs):
        raise ConfigError(f"quantize='mxfp4': '{source}' holds no gpt-oss expert tensor (mlp.experts.gate_up_proj, "
                          f"down_proj) in a floating-point dtype ({len(specs)} tensors): nothing to quantize")
    return out


def quantizing_block(plan: Plan) -> tuple[int, int] | None:
    """The block size ``plan`` quantizes in, or None when it does not quantize."""
    for t in plan.targets:
        if t.dequant is not None and t.dequant.method == FP8_VALUES:
            return tuple(dict(t.dequant.params)["block"])  # type: ignore[return-value, call-overload]
    return None


def quantization_config(plan: Plan) -> dict[str, object] | None:
    """The ``quantization_config`` of a quantizing merge's output, or None when ``plan`` does not quantize."""
    packed = packed_config(plan)
    if packed is not None:
        return packed
    if any(t.dequant is not None and t.dequant.method == MXFP4_BLOCKS for t in plan.targets):
        return {**MXFP4_CONFIG, "modules_to_not_convert": list(MXFP4_CONFIG["modules_to_not_convert"])}
    block = quantizing_block(plan)
    if block is None:
        return None
    quantized = {t.name.removesuffix(".weight") for t in plan.targets
                 if t.dequant is not None and t.dequant.method == FP8_VALUES}
    kept = {t.name.rsplit(".", 1)[0] for t in plan.targets if "." in t.name} - quantized
    return {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": list(block),
            "modules_to_not_convert": not_converted(sorted(kept), sorted(quantized))}


def not_converted(kept: Sequence[str], quantized: Sequence[str]) -> list[str]:
    """``kept`` modules as transformers' ``modules_to_not_convert`` patterns: layer numbers folded into ``*``
    (``model.layers.*.input_layernorm``) where the pattern matches no module of ``quantized``, else by name."""
    check = Quantization("fp8", (1, 1), "float", "F8_E4M3")
    patterns: dict[str, list[str]] = {}
    for module in kept:
        patterns.setdefault(re.sub(r"(^|\.)layers\.\d+\.", r"\1layers.*.", module), []).append(module)
    out: list[str] = []
    for pattern, members in patterns.items():
        folded = Quantization(check.method, check.block, check.scale_fmt, check.weight_dtype, (pattern,))
        out.extend([pattern] if all(folded.converts(m) for m in quantized) else members)
    return sorted(out)


def output_config(config: Mapping[str, object] | None, plan: Plan) -> Mapping[str, object] | None:
    """``config.json`` of a quantizing merge: the source's, with the ``quantization_config`` of ``plan``."""
    quantization = quantization_config(plan)
    if config is None or quantization is None:
        return config
    return {**config, "quantization_config": quantization}


def _dtype(spec: TargetSpec, layout: Layout) -> str | None:
    tensor = layout.tensors.get(spec.slices[0].source) if spec.slices else None
    return tensor.dtype if tensor is not None else None
