"""What can be wrong with a quantized checkpoint, seen from its headers and its config (no tensor data).

Each problem carries the audit's finding code (:data:`ckpttool.findings.CODES`); a merge refuses the same
problems before writing anything (:mod:`ckpttool.families.source`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from itertools import compress
from operator import attrgetter, itemgetter

from ckpttool.quant.formats import (
    BLOCKS_SUFFIX,
    FP8_FORMATS,
    FP8_SCALE_DTYPES,
    MXFP4,
    MXFP4_GROUP_BYTES,
    SCALES_SUFFIX,
    Quantization,
    Shape,
    fp8_scale_name,
    fp8_scale_shape,
    links,
)
from ckpttool.quant.packed import LINK_OF, PACKED_METHODS
from ckpttool.quant.packed_checks import check_packed, packed_scales

#: the stored weight dtypes that mean "FP8"
FP8_DTYPES = frozenset(FP8_FORMATS.values())


@dataclass(frozen=True, slots=True)
class Problem:
    """One defect: the audit's finding ``code``, the tensor concerned (if one), and why, in numbers."""

    code: str
    tensor: str | None
    message: str


def check_tensors(tensors: Mapping[str, tuple[str, Shape]], quant: Quantization | None, *, has_config: bool) -> list[Problem]:
    """Every quantization problem of a checkpoint whose tensors are ``{name: (dtype, shape)}``.

    ``quant`` is what the config declares (None: no ``quantization_config``); ``has_config`` says whether there is
    a config at all (without one, only the pairs of tensors are checked).
    """
    found, lonely, orphans = links(tensors)
    problems = [_orphan(name, tensors) for name in orphans]
    problems += [Problem("quant-scale-missing", name, f"'{name}' holds MXFP4 blocks but '{name[:-len(BLOCKS_SUFFIX)]}"
                         f"{SCALES_SUFFIX}' is not in the checkpoint: its values cannot be decoded. Restore the scales")
                 for name in lonely]
    scaled = {link.weight for link in found}
    scaled_by = packed_scales(found)  # NVFP4's F8_E4M3 scales are scales, not FP8 weights
    fp8 = list(compress(tensors, map(FP8_DTYPES.__contains__, map(_FIRST, tensors.values()))))  # at C speed
    for name in [] if scaled.issuperset(fp8) else sorted(set(fp8) - scaled - scaled_by):
        problems.append(Problem(
            "quant-scale-missing", name,
            f"'{name}' is {tensors[name][0]} (FP8) but '{fp8_scale_name(name)}' is not in the checkpoint: its values "
            "cannot be dequantized (transformers would use them without a scale). Restore the scale tensor",
        ))
    quantized = scaled.union(fp8, lonely)  # tensors_quantized(tensors), from what is known here
    if quant is None:
        if has_config and quantized:
            problems.append(Problem(
                "quant-config-missing", None,
                f"{len(quantized)} tensors are quantized ({_some(sorted(quantized))}) but the config has no "
                "quantization_config: transformers would load the stored values as plain weights, without their "
                "scales. Add the release's quantization_config to config.json",
            ))
        return problems
    if not quantized:
        problems.append(Problem(
            "quant-config-mismatch", None,
            f"'{quant.label}' declares {quant.describe()} (quantization_config) but no tensor is quantized: "
            "transformers would build quantized layers and find no scales. Remove quantization_config",
        ))
    # _check_link reads a link's method and its two tensors' dtypes and shapes (and names, for its messages):
    # each such key is checked once, under stand-in names, and the links of a key it finds nothing wrong with
    # are sound; the others are checked again under their names, in order
    get = tensors.__getitem__
    try:
        keys = set(zip(map(_METHOD, found), map(get, map(_WEIGHT, found)), map(get, map(_SCALE, found))))
    except TypeError:  # a shape given as a list (no caller does): every link checked on its own
        keys, sound = {None}, set()
    else:
        sound = {key for key in keys if not _check_link(key[0], "w", "s", {"w": key[1], "s": key[2]}, quant)}
    if len(sound) < len(keys):
        for link in found:
            if not sound or (link.method, tensors[link.weight], tensors[link.scale]) not in sound:
                problems.extend(_check_link(link.method, link.weight, link.scale, tensors, quant))
    for name in sorted(quantized) if quant.not_converted else ():  # with no modules_to_not_convert, each is converted
        module = name.removesuffix(BLOCKS_SUFFIX).rsplit(".", 1)[0]
        if not quant.converts(module):
            problems.append(Problem(
                "quant-not-converted", name,
                f"'{name}' is quantized, but modules_to_not_convert in '{quant.label}' names '{module}': transformers "
                "would load its stored values as a plain weight, without the scales. Remove it from the list",
            ))
    return problems


_FIRST = itemgetter(0)
_METHOD, _WEIGHT, _SCALE = attrgetter("method"), attrgetter("weight"), attrgetter("scale")


def tensors_quantized(tensors: Mapping[str, tuple[str, Shape]]) -> set[str]:
    """The stored quantized tensors among ``{name: (dtype, shape)}``: FP8 weights (by their scale or their dtype)
    and MXFP4 ``_blocks``."""
    found, lonely, _ = links(tensors)
    fp8 = {n for n, (d, _) in tensors.items() if d in FP8_DTYPES} - packed_scales(found)
    return {link.weight for link in found} | fp8 | set(lonely)


def _orphan(name: str, tensors: Mapping[str, tuple[str, Shape]]) -> Problem:
    fp8 = name.endswith("_scale_inv")
    weight = name.removesuffix("_scale_inv") if fp8 else name.removesuffix(SCALES_SUFFIX) + BLOCKS_SUFFIX
    return Problem("quant-scale-orphan", name, f"'{name}' is a scale, but its weight '{weight}' is not in the checkpoint "
                   f"({len(tensors)} tensors). Restore the weight, or drop the scale")


def _check_link(method: str, weight: str, scale: str, tensors: Mapping[str, tuple[str, Shape]],
                quant: Quantization) -> list[Problem]:
    (w_dtype, w_shape), (s_dtype, s_shape) = tensors[weight], tensors[scale]
    if method != LINK_OF.get(quant.method, quant.method):
        return [Problem("quant-config-mismatch", weight,
                        f"'{weight}' and '{scale}' are {method} tensors, but '{quant.label}' declares {quant.describe()}")]
    if quant.method in PACKED_METHODS:
        return [Problem(*p) for p in check_packed(weight, scale, tensors, quant)]
    if method == MXFP4:
        return _check_mxfp4(weight, scale, w_dtype, w_shape, s_dtype, s_shape, quant.label)
    problems = []
    if w_dtype != quant.weight_dtype:
        problems.append(Problem("quant-config-mismatch", weight,
                                f"'{weight}' is {w_dtype}, but '{quant.label}' declares {quant.describe()}"))
    if s_dtype not in FP8_SCALE_DTYPES or (s_dtype == "U8" and quant.scale_fmt != "ue8m0"):
        problems.append(Problem(
            "quant-scale-dtype", scale,
            f"'{scale}' is {s_dtype}; FP8 scales are F32, BF16, F16 or F8_E8M0 (U8 only as E8M0 bytes, with scale_fmt "
            f"\"ue8m0\"; '{quant.label}' says {quant.scale_fmt!r}): a scale of dtype {s_dtype} contradicts "
            f"quantization_config.quant_method 'fp8' with quantization_config.scale_fmt {quant.scale_fmt!r} in "
            f"'{quant.label}', and its values would be read as something they are not. Store the scales as the "
            "release did, or give the release's config",
        ))
    if len(w_shape) < 2:
        problems.append(Problem("quant-scale-shape", scale, f"'{weight}' has shape {list(w_shape)}; a block-scaled FP8 "
                                "weight has at least 2 dims"))
        return problems
    expected = fp8_scale_shape(w_shape, quant.block)
    if s_shape != expected:
        rows, cols = quant.block
        floor = (*w_shape[:-2], w_shape[-2] // rows, w_shape[-1] // cols)
        why = " (rounded down: the cropped edge blocks have no scale)" if s_shape == floor else ""
        problems.append(Problem(
            "quant-scale-shape", scale,
            f"'{scale}' has shape {list(s_shape)}, but '{weight}' {list(w_shape)} in {rows}x{cols} blocks "
            f"(weight_block_size in '{quant.label}') needs {list(expected)}{why}: one scale per block, edge blocks "
            "cropped. Was it quantized with another block size, or cut by a split?",
        ))
    return problems


def _check_mxfp4(blocks: str, scales: str, b_dtype: str, b_shape: Shape, s_dtype: str, s_shape: Shape,
                 label: str) -> list[Problem]:
    problems = []
    if b_dtype != "U8" or s_dtype != "U8":
        # transformers' gpt-oss loader reads the scales as exponent bytes (``scales.to(int32) - 127``): any other
        # dtype, F8_E8M0 included, would be read as its values
        problems.append(Problem(
            "quant-scale-dtype", scales if s_dtype != "U8" else blocks,
            f"'{blocks}' is {b_dtype} and '{scales}' is {s_dtype}; MXFP4 blocks and scales are both U8 (scales: E8M0 "
            f"exponent bytes): it contradicts quantization_config.quant_method 'mxfp4' in '{label}'. Store them as "
            "the release did, or give the release's config",
        ))
    if len(b_shape) < 3 or b_shape[-1] != MXFP4_GROUP_BYTES or s_shape != b_shape[:-1]:
        problems.append(Problem(
            "quant-scale-shape", scales,
            f"'{scales}' has shape {list(s_shape)} and '{blocks}' {list(b_shape)}; MXFP4 stores [..., R, G, "
            f"{MXFP4_GROUP_BYTES}] blocks with [..., R, G] scales (one per {MXFP4_GROUP_BYTES} bytes)",
        ))
    return problems


def _some(names: list[str]) -> str:
    shown = ", ".join(f"'{n}'" for n in names[:3])
    return shown + (f" and {len(names) - 3} more" if len(names) > 3 else "")
