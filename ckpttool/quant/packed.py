"""Packed 4-bit formats as facts: compressed-tensors ``pack-quantized`` (INT4/INT8) and ``nvfp4-pack-quantized``,
and ModelOpt NVFP4. No torch, no tensor read.

**compressed-tensors pack-quantized** (``quant_method: compressed-tensors``, ``format: pack-quantized``; Kimi K2's
W4A16): a Linear weight ``X.weight [O, I]`` is stored as ``X.weight_packed`` (int32 ``[O, ceil(I*b/32)]``: ``32/b``
values per int32, the first in the lowest bits, each stored as ``q + 2**(b-1)``), ``X.weight_scale`` (``[O, G]``,
the model's float dtype: one scale per ``group_size`` values of a row, ``G = ceil(I / group_size)``; strategy
``channel``: ``[O, 1]``), ``X.weight_shape`` (int ``[2]``: ``[O, I]``) and, when the scheme is not symmetric,
``X.weight_zero_point`` (int32 ``[ceil(O*b/32), G]``: packed along the rows the same way). A value is
``(q - zero_point) * scale`` computed in the scale's dtype (compressed-tensors' ``_dequantize``).

**compressed-tensors nvfp4-pack-quantized**: ``X.weight_packed`` (uint8 ``[O, I/2]``: two FP4 E2M1 codes per
byte, the low nibble first), ``X.weight_scale`` (F8_E4M3 ``[O, I/16]``), ``X.weight_global_scale`` (F32 ``[1]``)
and ``X.input_global_scale``. A value is ``fp4 * (float32(scale) / global_scale)`` in float32.

**ModelOpt NVFP4** (``quant_method: modelopt``, ``quant_algo: NVFP4``; the ``hf_quant_config.json`` layout put
into ``config.json``): ``X.weight`` (uint8 ``[O, I/2]``, as above), ``X.weight_scale`` (F8_E4M3 ``[O, I/16]``),
``X.weight_scale_2`` (F32 ``[]``) and ``X.input_scale``. A value is ``fp4 * (float32(scale) * weight_scale_2)``
in float32 (ModelOpt's ``NVFP4QTensor.dequantize``): one bf16 ulp from compressed-tensors' formula in about a
tenth of the values, so each format follows its own producer.

**ModelOpt FP8 per tensor** (``quant_method: modelopt``, ``quant_algo: FP8``): ``X.weight`` (F8_E4M3 ``[O, I]``),
``X.weight_scale`` (F32 ``[]``, one scale for the whole tensor) and ``X.input_scale``. A value is
``fp8.to(dtype) * scale.to(dtype)`` computed in the output dtype (ModelOpt's ``FP8QTensor.dequantize``: in bfloat16
the scale is rounded to bfloat16 first, and the product once more).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Mapping

Shape = tuple[int, ...]

#: :attr:`ckpttool.quant.formats.Quantization.method` of each format
PACKED_INT = "pack-quantized"
NVFP4_CT = "nvfp4-pack-quantized"
NVFP4_MODELOPT = "modelopt-nvfp4"
FP8_MODELOPT = "modelopt-fp8"
PACKED_METHODS = (PACKED_INT, NVFP4_CT, NVFP4_MODELOPT, FP8_MODELOPT)
#: the link method of each family of names: compressed-tensors' ``weight_packed``, ModelOpt's ``weight_scale_2``
CT_LINK = "compressed-tensors"
MODELOPT_LINK = "modelopt"
#: ModelOpt's per-tensor FP8: ``X.weight`` with a 0-d ``X.weight_scale`` (and no ``X.weight_scale_2``)
MODELOPT_FP8_LINK = "modelopt-fp8"
LINK_OF = {PACKED_INT: CT_LINK, NVFP4_CT: CT_LINK, NVFP4_MODELOPT: MODELOPT_LINK, FP8_MODELOPT: MODELOPT_FP8_LINK}

PACKED_SUFFIX = "_packed"
SCALE_SUFFIX = "_scale"
SCALE_2_SUFFIX = "_scale_2"
#: ModelOpt FP8's per-tensor scale, by its whole last name part (``X.weight_scale`` beside ``X.weight``)
FP8_SCALE_SUFFIX = ".weight" + SCALE_SUFFIX
#: the tensors a compressed-tensors or ModelOpt weight travels with besides its scale, as suffixes of ``X.weight``
#: (``X.input_*`` are the activation scales of the same module)
CT_COMPANIONS = ("_shape", "_zero_point", "_global_scale", "_g_idx")
MODELOPT_COMPANIONS = (SCALE_2_SUFFIX,)
INPUT_SCALES = ("input_global_scale", "input_scale")

#: NVFP4: values per scale
NVFP4_GROUP = 16
#: the largest group a config may give (a bound on an untrusted number, as ``MAX_FP8_BLOCK``)
MAX_GROUP = 1 << 16
#: the scale dtypes compressed-tensors writes for an integer scheme
INT_SCALE_DTYPES = ("BF16", "F16", "F32")


def read_packed(raw: Mapping[str, object], where: str) -> tuple[str, int, int, bool, tuple[str, ...]] | None:
    """What a compressed-tensors or ModelOpt ``quantization_config`` (``raw``) declares: (method, bits, group size
    (0: one scale per row), symmetric, ignore patterns); None when ``raw`` is neither.

    Raises:
        ValueError: a config of either kind that ckpttool does not read, with the key and why (the caller raises
            it as a :class:`~ckpttool.errors.ConfigError`).
    """
    method = raw.get("quant_method")
    if method == "modelopt":
        algo = raw.get("quant_algo", (raw.get("quantization") or {}).get("quant_algo")  # type: ignore[union-attr]
                       if isinstance(raw.get("quantization"), Mapping) else None)
        if algo not in ("NVFP4", "FP8"):
            raise ValueError(f"{where}.quant_algo is {algo!r}; ckpttool reads ModelOpt 'NVFP4' and 'FP8' (per "
                             "tensor) checkpoints only")
        ignore = _patterns(raw.get("exclude_modules", raw.get("ignore")) or [], f"{where}.exclude_modules")
        if algo == "FP8":
            return FP8_MODELOPT, 8, 0, True, ignore
        return NVFP4_MODELOPT, 4, NVFP4_GROUP, True, ignore
    if method != "compressed-tensors":
        return None
    fmt = raw.get("format")
    if fmt not in (PACKED_INT, NVFP4_CT):
        raise ValueError(f"{where}.format is {fmt!r}; ckpttool reads compressed-tensors 'pack-quantized' and "
                         "'nvfp4-pack-quantized' checkpoints only")
    groups = raw.get("config_groups")
    if not isinstance(groups, Mapping) or not groups:
        raise ValueError(f"{where}.config_groups is {groups!r}; a compressed-tensors config has at least one group")
    schemes = set()
    for key, group in groups.items():
        weights = group.get("weights") if isinstance(group, Mapping) else None
        if not isinstance(weights, Mapping):
            raise ValueError(f"{where}.config_groups.{key}.weights is {weights!r}, not an object")
        schemes.add(_scheme(weights, fmt, f"{where}.config_groups.{key}.weights"))
    if len(schemes) > 1:
        raise ValueError(f"{where}.config_groups declare {len(schemes)} different weight schemes "
                         f"{sorted(schemes)}; ckpttool reads one scheme per checkpoint")
    bits, group, symmetric = schemes.pop()
    return fmt, bits, group, symmetric, _patterns(raw.get("ignore") or [], f"{where}.ignore")  # type: ignore[return-value]


def _scheme(weights: Mapping[str, object], fmt: str, where: str) -> tuple[int, int, bool]:
    bits, kind, strategy = weights.get("num_bits"), weights.get("type"), weights.get("strategy")
    group, symmetric = weights.get("group_size"), weights.get("symmetric", True)
    if weights.get("actorder") not in (None, False, "static"):
        raise ValueError(f"{where}.actorder is {weights.get('actorder')!r}; ckpttool reads no activation-ordered "
                         "groups (weight_g_idx)")
    if fmt == NVFP4_CT:
        if (bits, kind, strategy, group) != (4, "float", "tensor_group", NVFP4_GROUP):
            raise ValueError(f"{where} is {{num_bits: {bits}, type: {kind!r}, strategy: {strategy!r}, group_size: "
                             f"{group}}}; nvfp4-pack-quantized is 4-bit float in tensor_group groups of {NVFP4_GROUP}")
        return 4, NVFP4_GROUP, True
    if bits not in (4, 8) or kind != "int":
        raise ValueError(f"{where} is {{num_bits: {bits!r}, type: {kind!r}}}; pack-quantized weights are 4- or 8-bit int")
    if not isinstance(symmetric, bool):
        raise ValueError(f"{where}.symmetric is {symmetric!r}, not true or false")
    if strategy == "channel":
        return bits, 0, symmetric  # type: ignore[return-value]
    if strategy != "group" or not isinstance(group, int) or isinstance(group, bool) or not 0 < group <= MAX_GROUP:
        raise ValueError(f"{where} has strategy {strategy!r} and group_size {group!r}; ckpttool reads 'group' "
                         f"(a group_size of 1..{MAX_GROUP}) and 'channel' strategies")
    return bits, group, symmetric  # type: ignore[return-value]


def _patterns(ignore: object, where: str) -> tuple[str, ...]:
    if not isinstance(ignore, list) or not all(isinstance(p, str) for p in ignore):
        raise ValueError(f"{where} must be a list of module names, not {ignore!r}")
    return tuple(ignore)


def ignored(module: str, patterns: Iterable[str]) -> bool | None:
    """Whether a compressed-tensors ``ignore`` entry names ``module``: ``re:PATTERN`` by ``re.match``, as
    compressed-tensors matches it; None when no entry is of that kind (the caller matches the others)."""
    found = None
    for pattern in patterns:
        if pattern.startswith("re:"):
            found = False
            try:
                if re.match(pattern[3:], module):
                    return True
            except re.error:
                continue
    return found


def packed_links(present: frozenset[str]) -> list[tuple[str, str, str, str]]:
    """The packed weights among ``present``: ``(link method, logical name, stored weight, scale)``, sorted.
    compressed-tensors' ``X.weight_packed`` with ``X.weight_scale``; ModelOpt's ``X.weight`` with ``X.weight_scale``
    and ``X.weight_scale_2`` (NVFP4), or with ``X.weight_scale`` alone (FP8 per tensor)."""
    found = []
    for name in present:
        if name.endswith(PACKED_SUFFIX):
            base = name[: -len(PACKED_SUFFIX)]
            if base + SCALE_SUFFIX in present:
                found.append((CT_LINK, base, name, base + SCALE_SUFFIX))
        elif name.endswith(SCALE_2_SUFFIX):
            base = name[: -len(SCALE_2_SUFFIX)]
            if base in present and base + SCALE_SUFFIX in present:
                found.append((MODELOPT_LINK, base, base, base + SCALE_SUFFIX))
        elif name.endswith(FP8_SCALE_SUFFIX):
            base = name[: -len(SCALE_SUFFIX)]
            if base in present and base + SCALE_2_SUFFIX not in present:
                found.append((MODELOPT_FP8_LINK, base, base, name))
    return sorted(found)


def lonely_packed(present: frozenset[str]) -> list[str]:
    """``X.weight_packed`` tensors without their ``X.weight_scale``."""
    return sorted(n for n in present if n.endswith(PACKED_SUFFIX) and n[: -len(PACKED_SUFFIX)] + SCALE_SUFFIX not in present)


def companions(method: str, logical: str, present: Iterable[str] | Mapping[str, object]) -> list[str]:
    """The tensors besides its weight and scale that a link of ``method`` (a link method) has in ``present``."""
    suffixes = CT_COMPANIONS if method == CT_LINK else MODELOPT_COMPANIONS if method == MODELOPT_LINK else ()
    module = logical.rsplit(".", 1)[0]
    names = [logical + s for s in suffixes] + [f"{module}.{n}" for n in INPUT_SCALES]
    return [n for n in names if n in present]


def groups(columns: int, group: int) -> int:
    """Scales per row: one per ``group`` columns (edge group cropped), or one (``group`` 0: channel strategy)."""
    return 1 if group == 0 else math.ceil(columns / group)


def stored_shapes(method: str, logical: Shape, bits: int, group: int) -> tuple[Shape, Shape] | None:
    """The stored weight's and its scale's shapes for a logical ``[O, I]`` weight; None for another rank."""
    if len(logical) != 2:
        return None
    rows, cols = logical
    if method == FP8_MODELOPT:
        return logical, ()
    if method == PACKED_INT:
        return (rows, math.ceil(cols * bits / 32)), (rows, groups(cols, group))
    return (rows, math.ceil(cols / 2)), (rows, math.ceil(cols / NVFP4_GROUP))


def zero_point_shape(logical: Shape, bits: int, group: int) -> Shape:
    """``weight_zero_point``'s shape: ``[ceil(O*b/32), G]`` (packed along the rows)."""
    return (math.ceil(logical[0] * bits / 32), groups(logical[1], group))


def logical_shape(method: str, stored: Shape, scale: Shape, bits: int, group: int) -> Shape:
    """A weight's ``[O, I]`` from its stored headers (``weight_shape``'s value, read at decode time, must agree):
    the packed columns times the values per column, cut to the groups the scale holds when that is fewer."""
    if method == FP8_MODELOPT:
        return stored
    rows, cols = stored[0], stored[-1]
    per = 32 // bits if method == PACKED_INT else 2
    width = cols * per
    if method == PACKED_INT and group and len(scale) == 2:
        width = min(width, scale[-1] * group)
    return (rows, width)
