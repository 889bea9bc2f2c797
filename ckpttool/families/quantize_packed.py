"""Packing on merge (``quantize="int4"``, ``"int4-asym"``): which targets become compressed-tensors
``pack-quantized`` INT4, and the config that says so.

What is packed is what a compressed-tensors W4A16 release packs: the 2-D ``.weight`` of every Linear layer inside
the decoder layers that an FP8 release quantizes too (:func:`ckpttool.families.quantize.quantizes`: attention,
MLP, experts; norms, embeddings, ``lm_head`` and routers kept as they are). Each packed weight ``X.weight`` becomes
the computed targets ``X.weight_packed``, ``X.weight_scale``, ``X.weight_shape`` and, asymmetric,
``X.weight_zero_point``, all reading the same source rows (:mod:`ckpttool.quant.pack_encode`); ``config.json``
gets compressed-tensors' ``quantization_config`` (:func:`packed_config`) whose ``ignore`` names every 2-D weight
of a module left unpacked that a ``Linear`` target would match (``lm_head``, routers).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.io.dtypes import FLOAT_DTYPES
from ckpttool.plan.plan import Dequantize, Plan, TargetSpec
from ckpttool.quant.pack_encode import INT_PACKED, INT_SCALES, INT_ZERO_POINTS, WEIGHT_SHAPE
from ckpttool.quant.packed import MAX_GROUP, PACKED_INT, stored_shapes, zero_point_shape

#: the methods ``quantize=`` packs to, and whether each is symmetric
INT_METHODS = {"int4": True, "int4-asym": False}
#: the group size when none is given: Kimi K2's W4A16 (compressed-tensors' W4A16 preset has 128)
DEFAULT_GROUP = 32
#: the compressed-tensors version whose config layout and arithmetic the output follows
CT_VERSION = "0.20.0"
#: the dtype the scales are written in (the source is rounded to it first: see :mod:`ckpttool.quant.pack_encode`)
SCALE_DTYPE = "BF16"
#: 2-D weights left unpacked that are no Linear module (compressed-tensors' ``Linear`` target never sees them)
_NOT_LINEAR = re.compile(r"(?:norm|embed_tokens|embeddings?)$")


@dataclass(frozen=True, slots=True)
class IntScheme:
    """What ``quantize="int4"`` packs to: ``bits`` per value, one scale per ``group`` values of a row (0: one per
    row, the ``channel`` strategy), symmetric or with zero points."""

    bits: int = 4
    group: int = DEFAULT_GROUP
    symmetric: bool = True

    def describe(self) -> str:
        groups = f"groups of {self.group}" if self.group else "one scale per row"
        return f"INT{self.bits} {'symmetric' if self.symmetric else 'asymmetric'} in {groups}"


def int_scheme(method: str, group: int | None) -> IntScheme:
    """The scheme of ``quantize=method`` with ``group`` (None: :data:`DEFAULT_GROUP`; 0: one scale per row).

    Raises:
        ArgumentError: ``group`` is not an integer from 0 to :data:`~ckpttool.quant.packed.MAX_GROUP`.
    """
    size = DEFAULT_GROUP if group is None else group
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_GROUP:
        raise ArgumentError(f"group={group!r}: the INT4 group size is 1 to {MAX_GROUP} values (32: Kimi K2's; 128: "
                            "compressed-tensors' W4A16), or 0 for one scale per row")
    return IntScheme(4, size, INT_METHODS[method])


def packed_specs(specs: Sequence[TargetSpec], dtypes: Mapping[str, str | None], scheme: IntScheme, *,
                 source: str, quantizes) -> list[TargetSpec]:
    """Each weight ``quantizes(name, shape, dtype)`` picks as its packed targets, the others as they are.

    Raises:
        ConfigError: a weight whose columns are not a whole number of groups, or no weight to pack.
    """
    out: list[TargetSpec] = []
    for spec in specs:
        if not quantizes(spec.name, spec.shape, dtypes[spec.name]):
            out.append(spec)
            continue
        rows, cols = spec.shape
        if scheme.group and cols % scheme.group:
            raise ConfigError(
                f"quantize='int4': '{spec.name}' {list(spec.shape)} has {cols} columns, not a whole number of groups "
                f"of {scheme.group} (compressed-tensors packs whole groups). Give a group that divides {cols} "
                "(group=, --group), or 0 for one scale per row")
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
        raise ConfigError(f"quantize='int4': '{source}' holds no Linear weight of a decoder layer in a floating-point "
                          f"dtype ({len(specs)} tensors): nothing to pack")
    return out


def packed_config(plan: Plan) -> dict[str, object] | None:
    """compressed-tensors' ``quantization_config`` of a packing merge's output (as compressed-tensors 0.20 saves
    it), or None when ``plan`` packs nothing."""
    found = next((t.dequant for t in plan.targets if t.dequant is not None and t.dequant.method == INT_PACKED), None)
    if found is None:
        return None
    params = dict(found.params)
    group, symmetric = int(params["group"]), bool(params["symmetric"])  # type: ignore[call-overload]
    packed = {t.name.removesuffix(".weight_packed") for t in plan.targets
              if t.dequant is not None and t.dequant.method == INT_PACKED}
    ignore = sorted({t.name.removesuffix(".weight") for t in plan.targets
                     if t.name.endswith(".weight") and len(t.shape) == 2 and t.dtype in FLOAT_DTYPES
                     and not _NOT_LINEAR.search(t.name.removesuffix(".weight"))} - packed)
    bits = int(params["bits"])  # type: ignore[call-overload]
    weights = {"dynamic": False, "group_size": group or None, "num_bits": bits,
               "strategy": "group" if group else "channel", "symmetric": symmetric, "type": "int"}
    return {"config_groups": {"group_0": {"format": PACKED_INT, "input_activations": None, "output_activations": None,
                                          "targets": ["Linear"], "weights": weights}},
            "format": PACKED_INT, "global_compression_ratio": None, "ignore": ignore, "kv_cache_scheme": None,
            "moe_sparsity_config": None,
            "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
            "transform_config": {}, "version": CT_VERSION}
