"""The proof of a fuse: the output of ``merge --adapter`` read back against its base and adapters, on sampled rows.

For every fused target, the first block of :data:`~ckpttool.plan.lora.ROW_ALIGN` rows and the block holding its last
row are rebuilt from the source (the base's rows, plus each adapter's ``scaling * B @ A``, as the executor computes
them) and must equal the written bytes exactly; every other target's first and last rows must equal the source's.
An adapter whose ``lora_B`` weights are all zero was never trained (PEFT starts B at zero): the fuse changed nothing,
the release would silently be the base (verl #7285, LLaMA-Factory #9051). Each is a finding with a code of its own.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

from ckpttool.execute.buffers import Chunk, piece_uses
from ckpttool.execute.reads import Reader
from ckpttool.execute.assembly import build
from ckpttool.fast.deferred import torch
from ckpttool.findings import Finding, finding
from ckpttool.io.dtypes import torch_dtype
from ckpttool.io.safetensors_format import read_header
from ckpttool.plan.lora import ROW_ALIGN, AdapterTensor, LoraDelta, fuse_rows
from ckpttool.plan.plan import Plan, Target


def fuse_findings(plan: Plan, output: str | Path, files: Mapping[str, str]) -> list[Finding]:
    """What is wrong with the fuse that wrote ``output`` from ``plan`` (its targets carrying their LoRA deltas).

    Args:
        plan: the merge's plan.
        output: the directory written (the staging directory, before it is published).
        files: per target name, the output file holding it.

    Returns:
        ``lora-untrained``, ``lora-delta-mismatch`` and ``lora-untargeted-changed`` findings; none for a good fuse.
    """
    found = _untrained(plan)
    root = Path(output)
    headers = {name: read_header(root / name, name) for name in set(files.values())}
    reader = Reader(plan.root, piece_uses([]))
    try:
        for target in plan.targets:
            if target.name not in files or target.dequant is not None or not target.shape:
                continue
            entry = headers[files[target.name]].entries[target.name]
            written = AdapterTensor(str(root / files[target.name]), target.name, entry.shape, entry.dtype, entry.begin)
            found.extend(_check(target, written, reader))
    finally:
        reader.close()
    return found


def _untrained(plan: Plan) -> list[Finding]:
    """One ``lora-untrained`` finding per adapter whose every ``lora_B`` is zero."""
    deltas: dict[str, list[LoraDelta]] = {}
    seen = set()
    for target in plan.targets:
        for delta in target.lora:  # a stacked expert pair is on 2E targets: its B is read once
            if (delta.b.file, delta.b.key) not in seen:
                seen.add((delta.b.file, delta.b.key))
                deltas.setdefault(delta.adapter, []).append(delta)
    found = []
    for adapter, listed in deltas.items():
        if all(not delta.b.read_rows(0, delta.b.shape[0]).any() for delta in listed):
            found.append(finding("lora-untrained", f"'{adapter}': every lora_B of the adapter is zero ({len(listed)} "
                                 "modules): it was never trained, and the fused output equals the base. Is it the "
                                 "adapter of the last step?", file=listed[0].b.file))
    return found


def _check(target: Target, written: AdapterTensor, reader: Reader) -> list[Finding]:
    rows = target.shape[0]
    if target.lora:
        blocks = sorted({(0, min(ROW_ALIGN, rows)), ((rows - 1) // ROW_ALIGN * ROW_ALIGN, rows)})
    else:
        blocks = sorted({(0, 1), (rows - 1, rows)}) if rows else []
    plain = replace(target, lora=(), dtype=target.source_dtype)
    for start, stop in blocks:
        base = build(Chunk(plain, start, stop, 0, 0), reader).clone()
        expected = fuse_rows(base, target.lora, start, stop) if target.lora else base
        if target.dtype != target.source_dtype:
            expected = expected.to(torch_dtype(target.dtype))
        got = written.read_rows(start, stop)
        if not torch.equal(got.view(torch.uint8), expected.contiguous().view(torch.uint8)):
            if target.lora:
                adapters = ", ".join(f"'{d.adapter}'" for d in target.lora)
                return [finding("lora-delta-mismatch", f"'{target.name}': rows {start}..{stop} are not the base's plus "
                                f"scaling * B @ A of {adapters}", tensor=target.name, file=Path(written.file).name)]
            return [finding("lora-untargeted-changed", f"'{target.name}': row {start} differs from the base's, and no "
                            "adapter targets it", tensor=target.name, file=Path(written.file).name)]
    return []
