"""Re-packing on merge with a release's own scales (``quantize="int4"`` / ``"nvfp4"`` with ``scales_from=``):
which targets a merged model's weights become, so that values on the release's grid give the release's bytes.

The release decides everything its own packing decided: which weights are packed (its packed tensors, whatever
its ``ignore`` / ``exclude_modules`` say), their format and names (compressed-tensors ``X.weight_packed``, or
ModelOpt's ``X.weight`` as U8), their scales, zero points, global and input scales (copied from it), and the
``quantization_config`` written (its own, as it is). Only the codes are computed from the merged values
(:mod:`ckpttool.quant.on_grid`), and a value off the grid is refused. What the merged model holds besides is
written as it is.

The release is read by the command (:class:`Release`: its config and where each tensor's bytes lie); this module
only plans.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ckpttool.errors import ArgumentError, ConfigError
from ckpttool.io.dtypes import FLOAT_DTYPES
from ckpttool.plan.plan import Dequantize, Plan, TargetSpec
from ckpttool.quant import packed
from ckpttool.quant.formats import Quantization, links
from ckpttool.quant.on_grid import GRID_INT, GRID_NVFP4, RELEASE_ROWS, ReleaseTensor


@dataclass(frozen=True, slots=True)
class Release:
    """A packed release read for its scales: its folder (``root``), what its config declares (``quant``), its
    ``quantization_config`` as JSON text (written as it is), and where each of its tensors lies."""

    root: str
    quant: Quantization
    config: str
    tensors: Mapping[str, ReleaseTensor] = field(default_factory=dict, compare=False)


def check_method(method: str, group: int | None, release: Release) -> None:
    """Refuse a ``quantize=`` method (and ``group``) that is not the release's packing.

    Raises:
        ArgumentError: ``int4`` for an NVFP4 release or the other way round, ``int4`` for an asymmetric one (or
            ``int4-asym`` for a symmetric one), a ``group`` other than the release's.
    """
    quant = release.quant
    nvfp4 = quant.method in (packed.NVFP4_CT, packed.NVFP4_MODELOPT)
    wanted = "nvfp4" if nvfp4 else "int4" if quant.symmetric else "int4-asym"
    if method != wanted:
        raise ArgumentError(f"quantize={method!r} with scales_from='{release.root}': the release is {quant.describe()}; "
                            f"re-packing with its scales writes its own format: give quantize={wanted!r}")
    if group is not None and (nvfp4 or group != quant.block[1]):
        raise ArgumentError(f"group={group!r} with scales_from='{release.root}': the release's groups are "
                            f"{quant.block[1] or 'one per row'}; give no group (the release's is used)")


def release_specs(specs: Sequence[TargetSpec], dtypes: Mapping[str, str | None], release: Release, *,
                  source: str) -> list[TargetSpec]:
    """Each weight the release packs, as the release's tensors (codes computed, the rest copied); the other
    targets as they are.

    Raises:
        ConfigError: a weight the release packs that the merged model lacks, or holds in another shape or in no
            floating-point dtype; a release that packs nothing.
    """
    found = [link for link in links(release.tensors)[0] if link.method == packed.LINK_OF.get(release.quant.method)]
    if not found:
        raise ConfigError(f"scales_from='{release.root}': the release holds no packed weight of its "
                          f"{release.quant.describe()} config: nothing to take scales from")
    by_name = {link.logical: link for link in found}
    have = {s.name for s in specs}
    missing = sorted(set(by_name) - have)
    if missing:
        raise ConfigError(f"scales_from='{release.root}': the release packs {len(missing)} weights the merged model "
                          f"'{source}' does not hold ('{missing[0]}', ...): is it the release this model came from?")
    out: list[TargetSpec] = []
    for spec in specs:
        link = by_name.get(spec.name)
        if link is None:
            out.append(spec)
            continue
        out.extend(_packed_targets(spec, link.weight, link.scale, dtypes.get(spec.name), release))
    return out


def _packed_targets(spec: TargetSpec, weight: str, scale: str, dtype: str | None, release: Release) -> list[TargetSpec]:
    """A packed weight's release tensors: its codes (computed) and its companions (copied)."""
    tensors, quant = release.tensors, release.quant
    stored = tensors[weight]
    shapes = packed.stored_shapes(quant.method, spec.shape, quant.bits, quant.block[1])
    if dtype not in FLOAT_DTYPES or shapes is None or shapes[0] != stored.shape or shapes[1] != tensors[scale].shape:
        raise ConfigError(
            f"scales_from='{release.root}': '{spec.name}' is {list(spec.shape)} {dtype} here, but the release "
            f"holds '{weight}' {list(stored.shape)} with '{scale}' {list(tensors[scale].shape)} "
            f"({quant.describe()}): not this weight's packing. Is it the release this model came from?")
    logical = spec.name
    companions = packed.companions(packed.LINK_OF[quant.method], logical, tensors)
    common = (("name", logical), ("release", release.root), ("scale", tensors[scale]), ("config", release.config))
    if quant.method == packed.PACKED_INT:
        zero = tensors.get(logical + "_zero_point")
        params = (*common, ("bits", quant.bits), ("group", quant.block[1]), ("zero", zero))
        method = GRID_INT
    else:
        glob = "_global_scale" if quant.method == packed.NVFP4_CT else packed.SCALE_2_SUFFIX
        if logical + glob not in tensors:
            raise ConfigError(f"scales_from='{release.root}': the release's '{weight}' has no '{logical + glob}', "
                              "the global scale its values need. Is the release complete?")
        params = (*common, ("divide", quant.method == packed.NVFP4_CT), ("glob", tensors[logical + glob]),
                  ("packed", stored))
        method = GRID_NVFP4
    out = [TargetSpec(weight, stored.shape, spec.slices, Dequantize(method, params, spec.shape, None, stored.dtype),
                      spec.transform)]
    for name in (scale, *companions):
        copied = Dequantize(RELEASE_ROWS, (("tensor", tensors[name]),), spec.shape, None, tensors[name].dtype)
        out.append(TargetSpec(name, tensors[name].shape, spec.slices, copied, spec.transform))
    return out


def release_config(plan: Plan) -> dict[str, object] | None:
    """The release's ``quantization_config``, as it is, when ``plan`` re-packs with its scales; else None."""
    for target in plan.targets:
        if target.dequant is not None and target.dequant.method in (GRID_INT, GRID_NVFP4):
            return json.loads(str(dict(target.dequant.params)["config"]))
    return None
