"""Packing on merge (``quantize="int4"``, ``"int4-asym"``, ``"nvfp4"``): which targets become compressed-tensors
``pack-quantized`` INT4 or ``nvfp4-pack-quantized``, and the config that says so.

What is packed is what a compressed-tensors W4A16 release packs: the 2-D ``.weight`` of every Linear layer inside
the decoder layers that an FP8 release quantizes too (:func:`ckpttool.families.quantize.quantizes`: attention,
MLP, experts; norms, embeddings, ``lm_head`` and routers kept as they are). Each packed weight ``X.weight`` becomes
the computed targets ``X.weight_packed``, ``X.weight_scale``, ``X.weight_shape`` and, asymmetric,
``X.weight_zero_point`` (NVFP4: ``X.weight_packed``, ``X.weight_scale`` and ``X.weight_global_scale``), all
reading the same source rows (:mod:`ckpttool.quant.pack_encode`); ``config.json``
gets compressed-tensors' ``quantization_config`` (:func:`packed_config`) whose ``ignore`` names every 2-D weight
of a module left unpacked that a ``Linear`` target would match (``lm_head``, routers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.families.quantize_release import Release, release_config, release_specs
from ckpttool.io.dtypes import FLOAT_DTYPES
from ckpttool.plan.plan import Dequantize, Plan, TargetSpec
from ckpttool.quant.pack_encode import INT_PACKED, INT_SCALES, INT_ZERO_POINTS, NVFP4_PART, WEIGHT_SHAPE
from ckpttool.quant.packed import MAX_GROUP, NVFP4_CT, NVFP4_GROUP, PACKED_INT, stored_shapes, zero_point_shape

NVFP4 = "nvfp4"
#: the methods ``quantize=`` packs to, and whether each is symmetric
INT_METHODS = {"int4": True, "int4-asym": False}
PACK_METHODS = (*INT_METHODS, NVFP4)
#: the group size when none is given: Kimi K2's W4A16 (compressed-tensors' W4A16 preset has 128)
DEFAULT_GROUP = 32
#: the compressed-tensors version whose config layout and arithmetic the output follows
CT_VERSION = "0.20.0"
#: the dtype the scales are written in (the source is rounded to it first: see :mod:`ckpttool.quant.pack_encode`)
SCALE_DTYPE = "BF16"
#: 2-D weights left unpacked that are no Linear module (compressed-tensors' ``Linear`` target never sees them)
_NOT_LINEAR = re.compile(r"(?:norm|embed_tokens|embeddings?)$")


@dataclass(frozen=True, slots=True)
class PackScheme:
    """What ``quantize="int4"`` packs to: ``bits`` per value, one scale per ``group`` values of a row (0: one per
    row, the ``channel`` strategy), symmetric or with zero points; or, ``nvfp4``, compressed-tensors' NVFP4 (E2M1
    values, an E4M3 scale per 16, a float32 global scale)."""

    bits: int = 4
    group: int = DEFAULT_GROUP
    symmetric: bool = True
    nvfp4: bool = False
    #: re-pack with this release's scales (``scales_from=``): the release decides what is packed, and how
    release: Release | None = None

    def describe(self) -> str:
        if self.release is not None:
            return f"{self.release.quant.describe()} with the scales of '{self.release.root}'"
        if self.nvfp4:
            return "nvfp4-pack-quantized NVFP4 (E2M1 values, F8_E4M3 scales per 16, F32 weight_global_scale)"
        groups = f"groups of {self.group}" if self.group else "one scale per row"
        return (f"pack-quantized INT{self.bits} {'symmetric' if self.symmetric else 'asymmetric'} in {groups} "
                "(weight_packed, bfloat16 weight_scale, weight_shape)")


def pack_scheme(method: str, group: int | None) -> PackScheme:
    """The scheme of ``quantize=method`` with ``group`` (None: :data:`DEFAULT_GROUP`; 0: one scale per row).

    Raises:
        ArgumentError: ``group`` is not an integer from 0 to :data:`~ckpttool.quant.packed.MAX_GROUP`, or given
            with NVFP4 (whose groups are 16 values).
    """
    if method == NVFP4:
        if group is not None:
            raise ArgumentError(f"group={group!r}: quantize='nvfp4' scales groups of {NVFP4_GROUP} values and takes "
                                "no group")
        return PackScheme(4, NVFP4_GROUP, True, nvfp4=True)
    size = DEFAULT_GROUP if group is None else group
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_GROUP:
        raise ArgumentError(f"group={group!r}: the INT4 group size is 1 to {MAX_GROUP} values (32: Kimi K2's; 128: "
                            "compressed-tensors' W4A16), or 0 for one scale per row")
    return PackScheme(4, size, INT_METHODS[method])


def packed_specs(specs: Sequence[TargetSpec], dtypes: Mapping[str, str | None], scheme: PackScheme, *,
                 source: str, quantizes) -> list[TargetSpec]:
    """Each weight ``quantizes(name, shape, dtype)`` picks as its packed targets, the others as they are.

    Raises:
        ConfigError: a weight whose columns are not a whole number of groups, or no weight to pack; with a
            release (:attr:`PackScheme.release`), as :func:`~ckpttool.families.quantize_release.release_specs`.
    """
    if scheme.release is not None:
        return release_specs(specs, dtypes, scheme.release, source=source)
    out: list[TargetSpec] = []
    for spec in specs:
        if not quantizes(spec.name, spec.shape, dtypes[spec.name]):
            out.append(spec)
            continue
        rows, cols = spec.shape
        if scheme.group and cols % scheme.group:
            how = ("Give a group that divides {cols} (group=), or 0 for one scale per row" if not scheme.nvfp4
                   else "Merge it without quantize=, or drop the tensor")
            raise ConfigError(
                f"quantize='{'nvfp4' if scheme.nvfp4 else 'int4'}': '{spec.name}' {list(spec.shape)} has {cols} "
                f"columns, not a whole number of groups of {scheme.group} (compressed-tensors packs whole groups). "
                + how.format(cols=cols))
        if scheme.nvfp4:
            out.extend(_nvfp4_specs(spec))
            continue
        packed, scale = stored_shapes(PACKED_INT, spec.shape, scheme.bits, scheme.group)  # type: ignore[misc]
        common = (("bits", scheme.bits), ("group", scheme.group))
        values = (*common, ("symmetric", scheme.symmetric))
        made = [(INT_PACKED, values, "_packed", packed, "I32"), (INT_SCALES, values, "_scale", scale, SCALE_DTYPE),
                (WEIGHT_SHAPE, (("shape", spec.shape),), "_shape", (2,), "I64")]
        if not scheme.symmetric:
            made.append((INT_ZERO_POINTS, (*common, ("rows", rows)), "_zero_point",
                         zero_point_shape(spec.shape, scheme.bits, scheme.group), "I32"))
        for method, params, suffix, shape, dtype in made:
            computed = Dequantize(method, params, spec.shape, None, dtype)
            out.append(TargetSpec(spec.name + suffix, shape, spec.slices, computed, spec.transform))
    if len(out) == len(specs):
        raise ConfigError(f"quantize='{'nvfp4' if scheme.nvfp4 else 'int4'}': '{source}' holds no Linear weight of a decoder layer in a floating-point "
                          f"dtype ({len(specs)} tensors): nothing to pack")
    return out


def _nvfp4_specs(spec: TargetSpec) -> list[TargetSpec]:
    """An NVFP4 weight's three computed targets, each reading the whole weight (its global scale is the tensor's)."""
    packed, scale = stored_shapes(NVFP4_CT, spec.shape, 4, NVFP4_GROUP)  # type: ignore[misc]
    out = []
    for part, suffix, shape, dtype in (("packed", "_packed", packed, "U8"), ("scales", "_scale", scale, "F8_E4M3"),
                                       ("global", "_global_scale", (1,), "F32")):
        computed = Dequantize(NVFP4_PART, (("part", part), ("rows", spec.shape[0])), spec.shape, None, dtype)
        out.append(TargetSpec(spec.name + suffix, shape, spec.slices, computed, spec.transform))
    return out


def _packed_weights(plan: Plan) -> tuple[set[str], tuple[tuple[str, object], ...] | None]:
    """The modules ``plan`` packs, and the params of one of their packed values (None when it packs none)."""
    found = [t for t in plan.targets if t.dequant is not None and (
        t.dequant.method == INT_PACKED or t.dequant.method == NVFP4_PART and dict(t.dequant.params)["part"] == "packed")]
    return {t.name.removesuffix(".weight_packed") for t in found}, found[0].dequant.params if found else None


def packed_config(plan: Plan) -> dict[str, object] | None:
    """compressed-tensors' ``quantization_config`` of a packing merge's output (as compressed-tensors 0.20 saves
    it), or None when ``plan`` packs nothing; a re-packing with a release's scales writes the release's own."""
    released = release_config(plan)
    if released is not None:
        return released
    packed, found = _packed_weights(plan)
    if found is None:
        return None
    params = dict(found)
    ignore = sorted({t.name.removesuffix(".weight") for t in plan.targets
                     if t.name.endswith(".weight") and len(t.shape) == 2 and t.dtype in FLOAT_DTYPES
                     and not _NOT_LINEAR.search(t.name.removesuffix(".weight"))} - packed)
    if "part" in params:  # NVFP4
        fmt, weights = NVFP4_CT, {"dynamic": False, "group_size": NVFP4_GROUP, "num_bits": 4,
                                  "scale_dtype": "torch.float8_e4m3fn", "strategy": "tensor_group", "symmetric": True,
                                  "type": "float"}
    else:
        group = int(params["group"])  # type: ignore[call-overload]
        fmt, weights = PACKED_INT, {"dynamic": False, "group_size": group or None, "num_bits": params["bits"],
                                    "strategy": "group" if group else "channel", "symmetric": params["symmetric"],
                                    "type": "int"}
    return {"config_groups": {"group_0": {"format": fmt, "input_activations": None, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": fmt, "global_compression_ratio": None, "ignore": ignore, "kv_cache_scheme": None,
            "moe_sparsity_config": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": CT_VERSION}
