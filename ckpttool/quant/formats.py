"""The quantized formats as facts: the config that declares them, the tensors that travel together, their shapes.

**FP8 block-scaled** (DeepSeek-V3's convention, which transformers' ``finegrained_fp8`` integration and torch's
``QuantizedHuggingFaceStorageReader`` follow): a weight ``X.weight`` of shape ``[O, I]`` is stored as
``float8_e4m3fn`` and travels with ``X.weight_scale_inv`` of shape ``[ceil(O/B0), ceil(I/B1)]``, one scale per
``B0 x B1`` block, edge blocks cropped (not padded). A value is ``float32(fp8) * scale``. ``B0 x B1`` is the
config's ``weight_block_size``; it is never inferred from shapes (a ``[5, 3]`` scale fits blocks of 16 and of
13 rows alike). Scales are float32, or with ``scale_fmt: "ue8m0"`` powers of two, held as float32, as E8M0
(``F8_E8M0``) or as bytes (``U8``, value ``2 ** (byte - 127)``).

**MXFP4** (gpt-oss): an expert tensor ``X`` is stored as ``X_blocks`` (``uint8 [..., R, G, 16]``: 16 bytes hold
one group of 32 FP4 E2M1 values, two per byte, the low nibble first) and ``X_scales`` (``uint8 [..., R, G]``, one
E8M0 exponent per group, bias 127). The groups run along the input dim of the stored ``[E, out, in]`` matrix,
while transformers names the tensor ``[E, in, out]`` (its MXFP4 loader transposes the last two dims), so the
stored shape of a named ``[E, A, B]`` tensor is ``[E, B, A / 32, 16]``. gpt-oss's ``gate_up_proj`` interleaves
gate (even columns of the named tensor) and up (odd columns).

Everything here is plain data and arithmetic: no torch, no tensor read.
"""

from __future__ import annotations

import functools
import math
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from itertools import compress, repeat
from operator import attrgetter

from ckpttool.errors import ConfigError
from ckpttool.fast.frozen import quick_init
from ckpttool.quant import packed
from ckpttool.quant.packed import PACKED_INT, PACKED_METHODS

Shape = tuple[int, ...]

FP8 = "fp8"
MXFP4 = "mxfp4"
#: FP8 ``fmt`` -> the safetensors dtype of the weights
FP8_FORMATS = {"e4m3": "F8_E4M3", "e5m2": "F8_E5M2"}
#: what transformers' FineGrainedFP8Config uses when a config gives no ``weight_block_size``
DEFAULT_FP8_BLOCK = (128, 128)
#: the largest block size (rows or columns) a ``weight_block_size`` may give: no dim of a released model's weight
#: reaches it (releases use 128), and a config is untrusted input: a size from it is bounded before any buffer
#: is sized by it (a block of 2**40 columns would ask for 4 TiB to spread one scale row)
MAX_FP8_BLOCK = 1 << 16
#: FP8 scale formats: plain floats, or powers of two (E8M0)
SCALE_FORMATS = ("float", "ue8m0")
#: safetensors dtypes an FP8 scale may have (U8 only as E8M0 bytes, with scale_fmt ue8m0)
FP8_SCALE_DTYPES = ("F32", "BF16", "F16", "F8_E8M0", "U8")
#: MXFP4: values per scale, bytes per group, the value of each FP4 E2M1 code (sign bit 8)
MXFP4_GROUP = 32
MXFP4_GROUP_BYTES = 16
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
#: E8M0: an exponent byte with this bias; 0xFF is NaN
E8M0_BIAS = 127
E8M0_NAN = 0xFF

#: gpt-oss's ``gate_up_proj [E, H, 2I]`` interleaves its two halves: (gate columns, up columns). A family whose
#: names hold gate and up apart undoes it; gpt-oss's own names keep it.
GATE_UP_INTERLEAVE = (slice(0, None, 2), slice(1, None, 2))

FP8_SCALE_SUFFIX = "_scale_inv"
BLOCKS_SUFFIX = "_blocks"
SCALES_SUFFIX = "_scales"


@dataclass(frozen=True, slots=True)
class Quantization:
    """What a config's ``quantization_config`` declares.

    Attributes:
        method: ``"fp8"``, ``"mxfp4"``, or a packed method of :mod:`.packed`.
        block: rows x columns sharing one scale (FP8: ``weight_block_size``; MXFP4: ``(1, 32)``; packed: ``(1,
            group_size)``, ``(1, 0)`` for one scale per row).
        scale_fmt: FP8 ``"float"`` or ``"ue8m0"``; MXFP4 ``"e8m0"``.
        weight_dtype: the safetensors dtype of the stored weights (``F8_E4M3``, ``F8_E5M2``, ``U8``, ``I32``).
        not_converted: ``modules_to_not_convert``, patterns as transformers matches them.
        label: the config it came from, for messages.
    """

    method: str
    block: tuple[int, int]
    scale_fmt: str
    weight_dtype: str
    not_converted: tuple[str, ...] = ()
    label: str = "config.json"
    #: packed formats (:mod:`.packed`): bits per value, and whether values have no zero point
    bits: int = 8
    symmetric: bool = True

    def converts(self, module: str) -> bool:
        """False when ``modules_to_not_convert`` names ``module`` the way transformers matches it: a pattern
        matches from the start up to a module boundary (as a regex: ``layers.*.mlp`` matches ``layers.3.mlp``),
        or as a suffix; compressed-tensors' ``re:`` entries of its ``ignore`` list match as it matches them."""
        if packed.ignored(module, self.not_converted):
            return False
        for pattern in self.not_converted:
            if pattern.startswith("re:"):
                continue
            if module.endswith(pattern):
                return False
            try:
                if re.match(rf"(?:{pattern})(?:(?<=\.)|(?=\.|$))", module):
                    return False
            except re.error:
                continue
        return True

    def describe(self) -> str:
        if self.method == FP8:
            return f"fp8 {self.weight_dtype} with {self.block[0]}x{self.block[1]} blocks ({self.scale_fmt} scales)"
        if self.method == PACKED_INT:
            group = f"groups of {self.block[1]}" if self.block[1] else "one scale per row"
            return (f"compressed-tensors pack-quantized int{self.bits} ({group}, "
                    f"{'symmetric' if self.symmetric else 'asymmetric'})")
        if self.method == packed.FP8_MODELOPT:
            return "ModelOpt fp8 (F8_E4M3, one F32 weight_scale per tensor)"
        if self.method in PACKED_METHODS:
            who = "ModelOpt" if self.method == packed.NVFP4_MODELOPT else "compressed-tensors"
            return f"{who} nvfp4 (groups of {packed.NVFP4_GROUP} values, F8_E4M3 scales)"
        return f"mxfp4 (groups of {MXFP4_GROUP} values, E8M0 scales)"


def read_quantization(config: Mapping[str, object] | None, label: str = "config.json") -> Quantization | None:
    """The quantization a config declares, or None when it has no ``quantization_config``.

    Raises:
        ConfigError: a ``quantization_config`` ckpttool cannot honour: another method, a malformed or
            per-tensor block size, a block size over :data:`MAX_FP8_BLOCK`, an unknown ``fmt`` or ``scale_fmt``,
            static activation scales.
    """
    raw = (config or {}).get("quantization_config")
    if raw is None:
        return None
    where = f"'{label}': quantization_config"
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{where} is {type(raw).__name__}, not an object")
    method = raw.get("quant_method")
    not_converted = raw.get("modules_to_not_convert", raw.get("ignored_layers")) or []
    if not isinstance(not_converted, list) or not all(isinstance(p, str) for p in not_converted):
        raise ConfigError(f"{where}.modules_to_not_convert must be a list of module names, not {not_converted!r}")
    try:
        declared = packed.read_packed(raw, where)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if declared is not None:
        kind, bits, group, symmetric, ignore = declared
        dtype = {PACKED_INT: "I32", packed.FP8_MODELOPT: "F8_E4M3"}.get(kind, "U8")
        scale_fmt = "e4m3" if kind in (packed.NVFP4_CT, packed.NVFP4_MODELOPT) else "float"
        return Quantization(kind, (1, group), scale_fmt, dtype, ignore, label, bits, symmetric)
    if method == MXFP4:
        return Quantization(MXFP4, (1, MXFP4_GROUP), "e8m0", "U8", tuple(not_converted), label)
    if method != FP8:
        raise ConfigError(f"{where} has quant_method {method!r}; ckpttool reads 'fp8' (block-scaled) and 'mxfp4' "
                          "checkpoints only, besides 'compressed-tensors' (pack-quantized, nvfp4-pack-quantized) and "
                          "'modelopt' (NVFP4, FP8)")
    fmt = raw.get("fmt", "e4m3")
    if fmt not in FP8_FORMATS:
        raise ConfigError(f"{where}.fmt is {fmt!r}; FP8 weights are 'e4m3' or 'e5m2'")
    scale_fmt = raw.get("scale_fmt") or "float"
    if scale_fmt not in SCALE_FORMATS:
        raise ConfigError(f"{where}.scale_fmt is {scale_fmt!r}; known: {', '.join(SCALE_FORMATS)}")
    if raw.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"{where}.activation_scheme is {raw.get('activation_scheme')!r}; ckpttool reads FP8 "
                          "checkpoints with dynamic activation scales only (no activation_scale tensors)")
    block = raw.get("weight_block_size", list(DEFAULT_FP8_BLOCK))
    if block is None:
        raise ConfigError(f"{where}.weight_block_size is null (one scale per tensor); ckpttool reads "
                          "block-scaled FP8 only")
    if (not isinstance(block, list | tuple) or len(block) != 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)):
        raise ConfigError(f"{where}.weight_block_size is {block!r}; it must be two positive integers, e.g. [128, 128]")
    if max(block) > MAX_FP8_BLOCK:
        raise ConfigError(f"{where}.weight_block_size is {block!r}; each block size must be at most {MAX_FP8_BLOCK} "
                          f"rows or columns (ckpttool's bound; FP8 releases use [128, 128]). Is the config damaged?")
    return Quantization(FP8, (block[0], block[1]), scale_fmt, FP8_FORMATS[fmt], tuple(not_converted), label)


@quick_init  # built 90k times in a plan: see ckpttool.fast.frozen
@dataclass(frozen=True, slots=True)
class Link:
    """A quantized tensor's stored values and scales, and the name of the tensor they make once dequantized."""

    method: str
    logical: str
    weight: str
    scale: str


def fp8_scale_name(weight: str) -> str:
    """``X.weight`` -> ``X.weight_scale_inv`` (transformers names a scale of another tensor ``Y_scale_inv``)."""
    return weight + FP8_SCALE_SUFFIX


def links(names: Iterable[str]) -> tuple[list[Link], list[str], list[str]]:
    """The quantized tensors among ``names``: complete links, then stored weights without their scales
    (``X_blocks`` without ``X_scales``), then scales without their weights.

    An FP8 weight is recognised by its scale, not by its name alone, so an FP8 weight whose scale is missing
    is found by its dtype (see :func:`check_tensors`).
    """
    found, lonely, orphans = _links(frozenset(names))
    return list(found), list(lonely), list(orphans)


@functools.lru_cache(maxsize=4)  # merge, its audit and its checks ask about the same names (90k of them) a dozen times
def _links(present: frozenset[str]) -> tuple[tuple[Link, ...], tuple[str, ...], tuple[str, ...]]:
    found: list[Link] = []
    orphans: list[str] = []
    lonely: list[str] = []
    # only names with one of the suffixes count (found at C speed: a checkpoint holds 90k names), in sorted order
    for name in sorted(compress(present, map(str.endswith, present, repeat(_SUFFIXES)))):
        if name.endswith(FP8_SCALE_SUFFIX):
            weight = name[: -len(FP8_SCALE_SUFFIX)]
            if weight in present:
                found.append(Link(FP8, weight, weight, name))
            else:
                orphans.append(name)
        elif name.endswith(SCALES_SUFFIX):
            base = name[: -len(SCALES_SUFFIX)]
            if base + BLOCKS_SUFFIX in present:
                found.append(Link(MXFP4, base, base + BLOCKS_SUFFIX, name))
            else:
                orphans.append(name)
        elif name.endswith(BLOCKS_SUFFIX) and name[: -len(BLOCKS_SUFFIX)] + SCALES_SUFFIX not in present:
            lonely.append(name)
    if any(map(str.endswith, present, repeat(_PACKED_SUFFIXES))):  # compressed-tensors or ModelOpt names
        found.extend(Link(*link) for link in packed.packed_links(present))
        lonely.extend(packed.lonely_packed(present))
    return tuple(found), tuple(lonely), tuple(orphans)


_SUFFIXES = (FP8_SCALE_SUFFIX, SCALES_SUFFIX, BLOCKS_SUFFIX)
_PACKED_SUFFIXES = (packed.PACKED_SUFFIX, packed.SCALE_2_SUFFIX, packed.FP8_SCALE_SUFFIX)
_SCALE, _WEIGHT = attrgetter("scale"), attrgetter("weight")


def fp8_scale_shape(shape: Shape, block: tuple[int, int]) -> Shape:
    """One scale per ``block`` of the last two dims, edge blocks cropped: ``[O, I]`` -> ``[ceil(O/B0), ceil(I/B1)]``
    (leading dims, e.g. stacked experts, kept)."""
    if len(shape) < 2:
        raise ValueError(f"an FP8 block-scaled tensor has at least 2 dims, not shape {list(shape)}")
    *lead, rows, cols = shape
    return (*lead, math.ceil(rows / block[0]), math.ceil(cols / block[1]))


def mxfp4_stored_shapes(logical: Shape) -> tuple[Shape, Shape] | None:
    """The ``_blocks`` and ``_scales`` shapes of a named ``[..., A, B]`` MXFP4 tensor: ``[..., B, A/32, 16]`` and
    ``[..., B, A/32]``; None when ``A`` is not a multiple of 32 (no MXFP4 tensor has that shape)."""
    if len(logical) < 2 or logical[-2] % MXFP4_GROUP:
        return None
    *lead, cols, rows = logical
    groups = cols // MXFP4_GROUP
    return (*lead, rows, groups, MXFP4_GROUP_BYTES), (*lead, rows, groups)


def mxfp4_logical_shape(blocks: Shape) -> Shape:
    """The named shape of an MXFP4 tensor from its ``_blocks`` shape ``[..., R, G, 16]``: ``[..., G*32, R]``."""
    *lead, rows, groups, _ = blocks
    return (*lead, groups * MXFP4_GROUP, rows)


def expected_shapes(disk: Mapping[str, Shape], present: Mapping[str, Shape], quant: Quantization | None) -> dict[str, Shape]:
    """The architecture's on-disk tensors (``disk``, from transformers) as a quantized checkpoint stores them:
    each scale of ``present`` whose weight the architecture has, and each MXFP4 tensor as its ``_blocks`` and
    ``_scales``. A scale is expected with the shape it has: whether that is the shape the config's block size
    gives its weight is :func:`ckpttool.quant.checks.check_tensors`' question, which says why in its numbers
    (a generic shape diagnosis would call a scale of the wrong block size "one TP piece")."""
    expected = dict(disk)
    if quant is None:
        return expected
    found, lonely, _ = links(present)
    if quant.method == FP8:  # the scales of the FP8 weights the architecture has, in order, at C speed (30k)
        fp8 = [link for link in found if link.method == FP8]
        scales = list(compress(map(_SCALE, fp8), map(disk.__contains__, map(_WEIGHT, fp8))))
        expected.update(zip(scales, map(present.__getitem__, scales)))
    else:
        for link in found:
            if link.method == MXFP4 and quant.method == MXFP4 and link.logical in disk:
                shapes = mxfp4_stored_shapes(disk[link.logical])
                if shapes is not None:
                    del expected[link.logical]
                    expected[link.weight], expected[link.scale] = shapes[0], present[link.scale]
    if quant.method in PACKED_METHODS:
        return _expected_packed(expected, disk, present, quant, found)
    for name in lonely:  # a _blocks without its _scales is named by check_tensors, not as unexpected
        base = name.removesuffix(BLOCKS_SUFFIX)
        shapes = mxfp4_stored_shapes(disk[base]) if quant.method == MXFP4 and base in expected else None
        if shapes is not None:
            del expected[base]
            expected[name] = shapes[0]
    return expected


def _expected_packed(expected: dict[str, Shape], disk: Mapping[str, Shape], present: Mapping[str, Shape],
                     quant: Quantization, found: Iterable[Link]) -> dict[str, Shape]:
    """:func:`expected_shapes` of a packed format: each packed weight the architecture has, at the shape its
    ``[O, I]`` gives it, with its scale and companions as they are (whether the scale fits is
    :func:`ckpttool.quant.checks.check_tensors`' question)."""
    for link in found:
        if link.method != packed.LINK_OF[quant.method] or link.logical not in disk:
            continue
        shapes = packed.stored_shapes(quant.method, disk[link.logical], quant.bits, quant.block[1])
        del expected[link.logical]
        expected[link.weight] = shapes[0] if shapes is not None else present[link.weight]
        for name in (link.scale, *packed.companions(link.method, link.logical, present)):
            expected[name] = present[name]
    return expected
