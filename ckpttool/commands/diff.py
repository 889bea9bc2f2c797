"""``diff``: are two checkpoints the same model, whatever their formats and shardings?

Both sides are read as HuggingFace tensors (the same planning ``merge`` does, so a DCP of in-memory names and
a HuggingFace directory compare), each tensor's layout-independent fingerprint is computed from its chunks in
constant memory, and only tensors whose fingerprints differ are read again, chunk by chunk side by side, for
the largest difference.

Quantized checkpoints (FP8, MXFP4) compare by their stored bytes by default (values and scales, each a tensor).
With ``dequantize``, both sides are read as a merge given ``dtype="float32"`` reads them: quantized weights
dequantized (streamed), every other floating-point tensor cast to float32 (exact), so two checkpoints holding
the same values in other formats (scales stored as float32 or as E8M0, BF16 against FP8 dequantized) compare
equal, and differ by how far their values are apart.

With ``adapters``, B is fused on the fly with those PEFT LoRA adapters, exactly as ``merge --adapter`` fuses them
(the same plan, the same chunks, the same arithmetic: :mod:`ckpttool.lora`), so a released fused model compares with
the base and adapter it claims to be made of, without writing the fuse first: equal when it is their fuse bit for bit,
and each tensor that is not named with its largest difference.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ckpttool.audit.stats import Fingerprint, blocks, fold
from ckpttool.console.words import counted
from ckpttool.io.dtypes import itemsize
from ckpttool.execute.buffers import CHUNK_BYTES, buffer_sizes, chunks, piece_uses
from ckpttool.execute.reads import Reader
from ckpttool.execute.assembly import build
from ckpttool.plan.plan import Plan, Target
from ckpttool.errors import ConfigError
from ckpttool.families.quantized import ASKS_TO_DEQUANTIZE, OR_KEEP_QUANTIZED
from ckpttool.commands.merge import prepare
from ckpttool.families.registry import adapter_for
from ckpttool.lora.adapter import read_adapter
from ckpttool.lora.attach import attach_to_family

EQUAL, DIFFERENT, ONLY_A, ONLY_B, SHAPE, DTYPE = "equal", "different", "only-a", "only-b", "shape", "dtype"


@dataclass(frozen=True, slots=True)
class TensorDiff:
    """How one tensor compares: ``status`` is one of equal, different, dtype, shape, only-a, only-b."""

    name: str
    status: str
    a: str | None = None
    b: str | None = None
    max_abs_diff: float | None = None
    differing: int | None = None
    numel: int | None = None

    def describe(self) -> str:
        if self.status == ONLY_A:
            return f"only in A ({self.a})"
        if self.status == ONLY_B:
            return f"only in B ({self.b})"
        if self.status == SHAPE:
            return f"shapes differ: A {self.a}, B {self.b}"
        if self.differing == 0 and self.status == DTYPE:
            text = "the values are equal"
        elif self.differing == 0:
            text = "the values compare equal but their bits differ (-0.0 and 0.0, NaN payloads)"
        else:
            text = f"{self.differing} of {self.numel} elements differ, max |A-B| = {self.max_abs_diff:.6g}"
        return f"dtypes differ (A {self.a}, B {self.b}); {text}" if self.status == DTYPE else text

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "status": self.status, "a": self.a, "b": self.b, "max_abs_diff": self.max_abs_diff,
                "differing": self.differing, "numel": self.numel}


@dataclass(frozen=True, slots=True)
class DiffResult:
    """Every tensor of A and B: equal ones with their common fingerprint, the rest with how they differ."""

    a: str
    b: str
    fingerprints: dict[str, str]
    differences: tuple[TensorDiff, ...]
    #: compared as float32 values, quantized weights dequantized (``dequantize=True``), not as stored bytes
    dequantized: bool = False
    #: the LoRA adapters fused into B on the fly, and what each changed, in words (``adapters=``)
    adapters: tuple[str, ...] = ()
    fused: tuple[str, ...] = ()

    @property
    def equal(self) -> bool:
        return not self.differences

    def counts(self) -> dict[str, int]:
        """How many tensors are only in A, only in B, in both and equal, in both and different (shape, dtype or
        values): A holds ``only_a + equal + different`` tensors, B ``only_b + equal + different``."""
        only_a = sum(d.status == ONLY_A for d in self.differences)
        only_b = sum(d.status == ONLY_B for d in self.differences)
        return {"only_a": only_a, "only_b": only_b, "equal": len(self.fingerprints),
                "different": len(self.differences) - only_a - only_b}

    def summary(self) -> str:
        """The verdict line: ``equal: 21 tensors identical``, or every kind of difference with counts that add up
        to each side's tensors."""
        n = self.counts()
        if self.equal:
            return f"equal: {counted(n['equal'], 'tensor')} identical"
        in_both = n["equal"] + n["different"]
        return (f"different: {counted(n['only_a'], 'tensor')} only in A, {n['only_b']} only in B, {n['equal']} in both "
                f"and equal, {n['different']} in both and different (A has {counted(n['only_a'] + in_both, 'tensor')}, "
                f"B {n['only_b'] + in_both})")

    def to_json(self) -> dict[str, object]:
        return {
            "a": self.a, "b": self.b, "equal": self.equal, "dequantized": self.dequantized,
            "adapters": list(self.adapters), "fused": list(self.fused),
            "tensors": len(self.fingerprints) + len(self.differences), "counts": self.counts(),
            "differences": [d.to_json() for d in self.differences],
            "fingerprints": self.fingerprints,
        }


def diff(
    a: str | Path,
    b: str | Path,
    *,
    config: str | Path | None = None,
    config_b: str | Path | None = None,
    format_a: str | None = None,
    format_b: str | None = None,
    progress: Callable[[int, int], None] | None = None,
    dequantize: bool = False,
    adapters: Sequence[str | Path] = (),
) -> DiffResult:
    """Compare two checkpoints tensor by tensor through layout-independent fingerprints.

    Args:
        a, b: checkpoint directories of any readable format and sharding.
        config: config for A (and for B unless ``config_b``); each side finds its own when None.
        format_a, format_b: reader names; detected when None.
        progress: called as ``progress(bytes_just_read, total_bytes)``.
        dequantize: compare float32 values, quantized weights dequantized, instead of the stored bytes.
        adapters: PEFT LoRA adapter folders fused into B on the fly, in order, as ``merge(adapters=...)`` fuses
            them (streamed, nothing written): is A the fuse of base B and these adapters?

    Raises:
        CkptError: either side cannot be read or is not covered exactly once.
        SourceError: an adapter cannot be read or fused into B (as ``merge`` refuses it), naming its file and tensor.

    Example:
        >>> diff("fixtures/llama_fsdp2_dcp/checkpoint", "fixtures/llama_tp2_dcp/checkpoint").equal  # doctest: +SKIP
        True
        >>> diff("fixtures/lora_llama/reference", "fixtures/lora_llama/checkpoint",  # doctest: +SKIP
        ...      adapters=["fixtures/lora_llama/adapter"]).equal
        True
    """
    plan_a = _plan(a, format_a, config, dequantize)
    plan_b = _plan(b, format_b, config_b if config_b is not None else config, dequantize, adapters)
    fused = plan_b.notes[len(plan_b.notes) - len(adapters):] if adapters else ()
    total = plan_a.nbytes + plan_b.nbytes
    tick = (lambda n: progress(n, total)) if progress else (lambda n: None)
    prints_a, prints_b = _fingerprints(plan_a, tick), _fingerprints(plan_b, tick)
    targets_a = {t.name: t for t in plan_a.targets}
    targets_b = {t.name: t for t in plan_b.targets}
    equal: dict[str, str] = {}
    differences: list[TensorDiff] = []
    compare: list[str] = []
    for name in sorted(targets_a.keys() | targets_b.keys()):
        ta, tb = targets_a.get(name), targets_b.get(name)
        if tb is None:
            differences.append(TensorDiff(name, ONLY_A, a=_describe(ta)))
        elif ta is None:
            differences.append(TensorDiff(name, ONLY_B, b=_describe(tb)))
        elif ta.shape != tb.shape:
            differences.append(TensorDiff(name, SHAPE, a=_describe(ta), b=_describe(tb)))
        elif prints_a[name] == prints_b[name]:
            equal[name] = prints_a[name]
        else:
            compare.append(name)
    if compare:
        differences.extend(_compare(plan_a, plan_b, compare))
    order = {n: i for i, n in enumerate(sorted(targets_a.keys() | targets_b.keys()))}
    return DiffResult(str(a), str(b), equal, tuple(sorted(differences, key=lambda d: order[d.name])), dequantize,
                      tuple(map(str, adapters)), tuple(fused))


def _plan(src: str | Path, format: str | None, config: str | Path | None, dequantize: bool,
          adapters: Sequence[str | Path] = ()) -> Plan:
    """One side's plan: as a merge given ``dtype="float32"`` plans it when ``dequantize``, whose refusal of a
    quantized checkpoint without a config is worded for the diff's own ``dequantize=True``; with ``adapters``
    attached as a merge given them attaches them (each fused target's chunks then carry the deltas)."""
    try:
        prepared = prepare(src, format=format, config=config, dtype="float32" if dequantize else None)
        if not adapters:
            return prepared.plan
        family = adapter_for(prepared.model) if prepared.model is not None else None
        return attach_to_family(prepared.plan, [read_adapter(path) for path in adapters], family)
    except ConfigError as e:
        if not dequantize or ASKS_TO_DEQUANTIZE not in str(e):
            raise
        raise ConfigError(str(e).replace(ASKS_TO_DEQUANTIZE, "dequantize=True asks to compare dequantized values")
                          .replace(OR_KEEP_QUANTIZED, "diff without dequantize=True to compare the stored bytes")) from None


def _fingerprints(plan: Plan, tick: Callable[[int], None]) -> dict[str, str]:
    return dict(zip((t.name for t in plan.targets), fold(plan, Fingerprint, tick)))


def _compare(plan_a: Plan, plan_b: Plan, names: list[str]) -> list[TensorDiff]:
    """Read the differing tensors of both sides again, chunk by chunk side by side, for the size of the difference."""
    targets_a = {t.name: t for t in plan_a.targets}
    targets_b = {t.name: t for t in plan_b.targets}
    pairs = []
    for name in names:
        ta, tb = targets_a[name], targets_b[name]
        row = math.prod(ta.shape[1:]) * max(itemsize(ta.dtype), itemsize(tb.dtype))
        rows = max(1, CHUNK_BYTES // row) if row else None  # the same rows per chunk on both sides
        pairs.append((ta, tb, chunks(ta, 0, rows=rows), chunks(tb, 0, rows=rows)))
    every_a = [c for _, _, ca, _ in pairs for c in ca]
    every_b = [c for _, _, _, cb in pairs for c in cb]
    reader_a = Reader(plan_a.root, piece_uses(every_a), buffer_sizes(every_a))
    reader_b = Reader(plan_b.root, piece_uses(every_b), buffer_sizes(every_b))
    out = []
    try:
        for ta, tb, chunks_a, chunks_b in pairs:
            largest, differing = 0.0, 0
            for ca, cb in zip(chunks_a, chunks_b):
                for block_a, block_b in zip(blocks(build(ca, reader_a)), blocks(build(cb, reader_b))):
                    da, db = block_a.double(), block_b.double()
                    unequal = ~((da == db) | (torch.isnan(da) & torch.isnan(db)))
                    differing += int(unequal.sum())
                    if unequal.any():
                        largest = max(largest, float((da[unequal] - db[unequal]).abs().max()))
            status = DTYPE if ta.dtype != tb.dtype else DIFFERENT
            out.append(TensorDiff(ta.name, status, a=_describe(ta), b=_describe(tb), max_abs_diff=largest,
                                  differing=differing, numel=math.prod(ta.shape)))
    finally:
        reader_a.close()
        reader_b.close()
    return out


def _describe(target: Target | None) -> str | None:
    return None if target is None else f"{target.dtype} {list(target.shape)}"
