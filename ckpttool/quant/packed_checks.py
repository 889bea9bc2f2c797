"""What can be wrong with a packed weight (:mod:`ckpttool.quant.packed`) seen from its headers: the dtypes of the
packed values, scales, zero points and global scales, and the shapes one gives the others. The values of
``weight_shape`` and of the scales are read as the data streams (:mod:`ckpttool.quant.packed_decode`, the audit's
scale checks)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

from ckpttool.quant.packed import (
    FP8_MODELOPT,
    INT_SCALE_DTYPES,
    NVFP4_CT,
    NVFP4_GROUP,
    PACKED_INT,
    SCALE_SUFFIX,
    groups,
    zero_point_shape,
)

Shape = tuple[int, ...]


def packed_scales(found: Iterable[object]) -> set[str]:
    """The scales of the packed links among ``found`` (NVFP4's are F8_E4M3: not FP8 weights without a scale)."""
    return {link.scale for link in found if link.method not in ("fp8", "mxfp4")}  # type: ignore[attr-defined]


def check_packed(weight: str, scale: str, tensors: Mapping[str, tuple[str, Shape]], quant: object) -> list:
    """Every header problem of one packed weight ``weight`` with its scale ``scale`` under ``quant`` (a
    :class:`~ckpttool.quant.formats.Quantization` of a packed method), as ``(code, tensor, message)``
    (:class:`~ckpttool.quant.checks.Problem`'s fields)."""
    Problem = _problem  # noqa: N806 -- read as the class it stands for

    method, label, bits, group = quant.method, quant.label, quant.bits, quant.block[1]  # type: ignore[attr-defined]
    (w_dtype, w_shape), (s_dtype, s_shape) = tensors[weight], tensors[scale]
    base = scale[: -len(SCALE_SUFFIX)]
    problems = []
    if w_dtype != quant.weight_dtype:  # type: ignore[attr-defined]
        problems.append(Problem("quant-config-mismatch", weight, f"'{weight}' is {w_dtype}, but '{label}' declares "
                                f"{quant.describe()}, whose packed values are {quant.weight_dtype}"))  # type: ignore[attr-defined]
    if method == FP8_MODELOPT:
        return problems + _per_tensor(weight, scale, w_shape, tensors[scale], label, Problem)
    scale_dtypes = INT_SCALE_DTYPES if method == PACKED_INT else ("F8_E4M3",)
    if s_dtype not in scale_dtypes:
        problems.append(Problem("quant-scale-dtype", scale, f"'{scale}' is {s_dtype}; the scales of "
                                f"{quant.describe()} ('{label}') are {' or '.join(scale_dtypes)}"))  # type: ignore[attr-defined]
    if len(w_shape) != 2 or len(s_shape) != 2:
        problems.append(Problem("quant-scale-shape", scale, f"'{weight}' has shape {list(w_shape)} and '{scale}' "
                                f"{list(s_shape)}; ckpttool reads packed Linear weights [O, I] with scales [O, G] only"))
        return problems
    per = 32 // bits if method == PACKED_INT else 2  # values per stored element
    widest, narrowest = w_shape[1] * per, max(w_shape[1] * per - per + 1, 0)  # the columns the packing may hold
    lo, hi = (groups(narrowest, group), groups(widest, group)) if method == PACKED_INT else (
        math.ceil(narrowest / NVFP4_GROUP), math.ceil(widest / NVFP4_GROUP))
    if s_shape[0] != w_shape[0] or not lo <= s_shape[1] <= hi:
        what = f"groups of {group}" if group else "one scale per row (channel)"
        problems.append(Problem(
            "quant-scale-shape", scale,
            f"'{scale}' has shape {list(s_shape)}, but '{weight}' {list(w_shape)} holds {w_shape[0]} rows of "
            f"{narrowest if narrowest == widest else f'{narrowest}..{widest}'} values, which in {what} "
            f"('{label}') need [{w_shape[0]}, {lo if lo == hi else f'{lo}..{hi}'}]. Was it quantized with another "
            "group size, or cut by a split?"))
    if method == PACKED_INT or method == NVFP4_CT:
        problems += _companions(weight, base, tensors, quant, (w_shape[0], widest), s_shape, Problem)
    else:
        problems += _global(weight, base + "_scale_2", tensors, label, Problem)
    return problems


def _companions(weight: str, base: str, tensors: Mapping[str, tuple[str, Shape]], quant: object, logical: Shape,
                s_shape: Shape, problem: type) -> list:
    """compressed-tensors' ``weight_shape``, ``weight_zero_point`` (asymmetric int) and ``weight_global_scale``
    (NVFP4)."""
    label = quant.label  # type: ignore[attr-defined]
    found = []
    shape = base + "_shape"
    if shape not in tensors and quant.method == NVFP4_CT:  # type: ignore[attr-defined]
        pass  # compressed-tensors' NVFP4 saves none: two values per byte give the width exactly
    elif shape not in tensors:
        found.append(problem("quant-scale-missing", weight, f"'{weight}' is packed but '{shape}' is not in the "
                             "checkpoint: the packed rows' true width cannot be told. Restore it"))
    elif tensors[shape][0] not in ("I64", "I32") or tensors[shape][1] != (2,):
        found.append(problem("quant-scale-shape", shape, f"'{shape}' is {tensors[shape][0]} {list(tensors[shape][1])}; "
                             "a packed weight's shape is an int tensor [2] ([O, I])"))
    if quant.method == NVFP4_CT:  # type: ignore[attr-defined]
        return found + _global(weight, base + "_global_scale", tensors, label, problem)
    zero = base + "_zero_point"
    if quant.symmetric:  # type: ignore[attr-defined]
        if zero in tensors:
            found.append(problem("quant-config-mismatch", zero, f"'{zero}' is in the checkpoint, but '{label}' declares "
                                 "a symmetric scheme (no zero point): its values would be ignored. Set symmetric: false"))
        return found
    expected = zero_point_shape(logical, quant.bits, quant.block[1])  # type: ignore[attr-defined]
    expected = (expected[0], s_shape[1])
    if zero not in tensors:
        found.append(problem("quant-scale-missing", weight, f"'{weight}' is asymmetric ('{label}': symmetric false) "
                             f"but '{zero}' is not in the checkpoint: its values cannot be dequantized. Restore it"))
    elif tensors[zero] != ("I32", expected):
        found.append(problem(
            "quant-scale-shape", zero,
            f"'{zero}' is {tensors[zero][0]} {list(tensors[zero][1])}, but the zero points of '{weight}' "
            f"({logical[0]} rows, {s_shape[1]} groups) are I32 {list(expected)}: {32 // quant.bits} per int32 "  # type: ignore[attr-defined]
            "along the rows, as compressed-tensors packs them"))
    return found


def _global(weight: str, name: str, tensors: Mapping[str, tuple[str, Shape]], label: str, problem: type) -> list:
    """NVFP4's one float32 global scale per tensor."""
    if name not in tensors:
        return [problem("quant-scale-missing", weight, f"'{weight}' is NVFP4 ('{label}') but '{name}', its global "
                        "scale, is not in the checkpoint: its values cannot be dequantized. Restore it")]
    dtype, shape = tensors[name]
    if dtype != "F32" or math.prod(shape) != 1:
        return [problem("quant-scale-shape", name, f"'{name}' is {dtype} {list(shape)}; an NVFP4 global scale is one "
                        "F32 value")]
    return []


def _per_tensor(weight: str, scale: str, w_shape: Shape, found: tuple[str, Shape], label: str, problem: type) -> list:
    """ModelOpt FP8's one F32 scale for the whole ``[O, I]`` weight."""
    dtype, shape = found
    problems = []
    if len(w_shape) != 2:
        problems.append(problem("quant-scale-shape", weight, f"'{weight}' has shape {list(w_shape)}; ckpttool reads "
                                "ModelOpt FP8 Linear weights [O, I] only"))
    if dtype != "F32" or math.prod(shape) != 1:
        problems.append(problem("quant-scale-shape", scale, f"'{scale}' is {dtype} {list(shape)}; a ModelOpt FP8 "
                                f"weight scale ('{label}': quant_algo FP8, per tensor) is one F32 value"))
    return problems


def _problem(code: str, tensor: str | None, message: str) -> tuple[str, str | None, str]:
    return code, tensor, message
