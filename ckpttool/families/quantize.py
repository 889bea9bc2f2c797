"""FP8 quantization on merge (``quantize="fp8"``): which targets become FP8, and the config that says so.

What is quantized is read from the architecture's on-disk names and shapes, as FP8 releases do it (DeepSeek-V3,
Qwen3-FP8): the 2-D ``.weight`` of a Linear layer of attention, MLP and experts inside the decoder layers. Kept as
they are: norms, embeddings, ``lm_head`` (and an MTP layer's ``shared_head``), router weights (``mlp.gate``,
``block_sparse_moe.gate``, ``mlp.router``, ``shared_expert_gate``) and every bias; stacked 3-D experts too (no FP8
loader reads them block-scaled). Each quantized weight becomes two computed targets, its E4M3 values and its
float32 ``weight_scale_inv`` (:mod:`ckpttool.quant.encode`); ``config.json`` gets a ``quantization_config`` whose
``modules_to_not_convert`` names every module kept, in the patterns transformers matches.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from ckpttool.io.dtypes import FLOAT_DTYPES
from ckpttool.layout.layout import Layout
from ckpttool.plan.plan import Dequantize, Plan, TargetSpec
from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.quant.encode import FP8_SCALES, FP8_VALUES
from ckpttool.quant.formats import (
    FP8_SCALE_SUFFIX,
    MAX_FP8_BLOCK,
    Quantization,
    fp8_scale_name,
    fp8_scale_shape,
)

#: the methods ``quantize=`` accepts
METHODS = ("fp8",)
#: a module inside a decoder layer (MTP layers included)
_LAYER = re.compile(r"(?:^|\.)layers\.\d+\.")
#: the last part of a module name that is never quantized: norms, embeddings, heads, routers
_KEPT = re.compile(r"(?:norm|embed_tokens|embeddings?|lm_head|shared_head|head|gate|router)$")


def quantize_block(method: str | None, block: int | tuple[int, int] | None) -> tuple[int, int] | None:
    """The block size a merge quantizes in, or None when it does not quantize.

    Raises:
        ArgumentError: an unknown method, or a block size that is not one or two positive integers.
    """
    if method is None:
        if block is not None:
            raise ArgumentError(f"block={block!r} is the FP8 block size of quantize='fp8'; give quantize='fp8' too")
        return None
    if method != "fp8":
        raise ArgumentError(f"quantize={method!r}: ckpttool quantizes to {', '.join(METHODS)} only")
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


def quantized_specs(specs: Sequence[TargetSpec], layout: Layout, block: tuple[int, int], *, source: str,
                    quant: Quantization | None, has_model: bool) -> list[TargetSpec]:
    """The targets of a quantizing merge: each weight :func:`quantizes` picks as its E4M3 values and its float32
    scales (two computed targets reading the same source rows), the others as they are.

    Raises:
        ConfigError: the source is quantized already, has no config (or none transformers knows), or holds no
            weight to quantize.
    """
    if not has_model:
        raise ConfigError(
            f"quantize='fp8' needs the model's config (none usable for '{source}'): which tensors are Linear weights "
            "of attention and MLP (quantized) and which are norms, embeddings, lm_head and routers (kept) is read "
            "from the architecture's names. Give config='PATH'")
    dtypes = {s.name: _dtype(s, layout) for s in specs}
    already = sorted(n for n, d in dtypes.items() if d is not None and d not in FLOAT_DTYPES and (
        d.startswith("F8") or n.endswith((FP8_SCALE_SUFFIX, "_blocks", "_scales"))))
    if quant is not None or already:
        what = quant.describe() if quant is not None else f"{len(already)} quantized tensors ('{already[0]}', ...)"
        raise ConfigError(
            f"quantize='fp8': '{source}' is quantized already ({what}); quantizing FP8 values again would compound "
            "their rounding. Dequantize it first (dtype='bfloat16'), or merge it without quantize= to keep it as it is")
    out: list[TargetSpec] = []
    for spec in specs:
        if not quantizes(spec.name, spec.shape, dtypes[spec.name]):
            out.append(spec)
            continue
        rows = spec.shape[0]
        values = Dequantize(FP8_VALUES, (("block", block),), spec.shape, None, "F8_E4M3")
        scales = Dequantize(FP8_SCALES, (("block", block), ("rows", rows)), spec.shape, None, "F32")
        out.append(TargetSpec(spec.name, spec.shape, spec.slices, values))
        out.append(TargetSpec(fp8_scale_name(spec.name), fp8_scale_shape(spec.shape, block), spec.slices, scales))
    if len(out) == len(specs):
        raise ConfigError(f"quantize='fp8': '{source}' holds no Linear weight of a decoder layer in a floating-point "
                          f"dtype ({len(specs)} tensors): nothing to quantize")
    return out


def quantizing_block(plan: Plan) -> tuple[int, int] | None:
    """The block size ``plan`` quantizes in, or None when it does not quantize."""
    for t in plan.targets:
        if t.dequant is not None and t.dequant.method == FP8_VALUES:
            return tuple(dict(t.dequant.params)["block"])  # type: ignore[return-value, call-overload]
    return None


def quantization_config(plan: Plan) -> dict[str, object] | None:
    """The ``quantization_config`` of a quantizing merge's output, or None when ``plan`` does not quantize."""
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
