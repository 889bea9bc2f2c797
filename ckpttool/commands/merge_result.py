"""What a merge did (or, with a dry run, would do): :class:`MergeResult`, as the CLI shows it and its JSON gives it."""

from __future__ import annotations

from dataclasses import dataclass, field

from ckpttool.findings import Report
from ckpttool.plan.plan import Plan
from ckpttool.quant.encode import RoundTrip
from ckpttool.writers.files import OutputFile
from ckpttool.writers.hf import predict_peak_bytes

__all__ = ["MergeResult"]


@dataclass(frozen=True, slots=True)
class MergeResult:
    """What :func:`~ckpttool.commands.merge.merge` did (or, with ``dry_run``, would do)."""

    source: str
    #: the destination; None for a dry run given none
    output: str | None
    format: str
    plan: Plan
    files: tuple[OutputFile, ...]
    extras: tuple[str, ...]
    config: str | None
    dry_run: bool
    audit: Report | None = None
    kept_files: int = 0
    workers: int = 1
    parallel: dict[str, int] = field(default_factory=dict)
    #: an earlier output that a killed run had moved aside, put back before this merge (see ckpttool.writers.staging)
    restored: str | None = None
    #: no architecture was mapped (no config, or one transformers has no causal LM for): names kept as recorded
    generic: bool = False
    #: the family adapter that named the tensors, in words (see ckpttool.families)
    adapter: str = ""
    #: a generic merge of a source named in a convention of its own: that convention (``"Megatron-Core"``), whose
    #: names were written as they are (transformers loads none of them); None otherwise (see merge's raw_names)
    raw_names: str | None = None
    #: quantize="fp8", "mxfp4" or "int4": per quantized weight this process wrote, its round trip against the source
    round_trips: dict[str, RoundTrip] = field(default_factory=dict)
    #: the source held a LoRA adapter saved with the base, fused by default: what was fused, in words; else None
    embedded: str | None = None

    def worst_round_trip(self) -> tuple[str, RoundTrip] | None:
        """The quantized weight whose dequantized values are furthest from the source (relative RMS error)."""
        return max(self.round_trips.items(), key=lambda item: item[1].relative_error, default=None)

    def to_json(self) -> dict[str, object]:
        return {
            "status": "ok",
            "dry_run": self.dry_run,
            "source": self.source,
            "output": self.output,
            "format": self.format,
            "parallel": self.parallel,
            "config": self.config,
            "generic": self.generic,
            "adapter": self.adapter,
            "raw_names": self.raw_names,
            "coverage": "every target tensor is covered exactly once",
            "tensors": len(self.plan.targets),
            "total_bytes": self.plan.nbytes,
            "largest_tensor_bytes": self.plan.largest_target_bytes(),
            "workers": self.workers,
            "predicted_peak_bytes": predict_peak_bytes(self.plan, self.workers),
            "files": [{"name": f.name, "bytes": f.nbytes, "tensors": len(f.targets)} for f in self.files],
            "extras": list(self.extras),
            "notes": list(self.plan.notes),
            "targets": [
                {"name": t.name, "shape": list(t.shape), "dtype": t.dtype, "pieces": len(t.copies), "sources": list(t.sources),
                 **({"transform": t.transform.name} if t.transform is not None else {}),
                 **({"lora": [{"adapter": d.adapter, "rank": d.rank, "scaling": d.scaling} for d in t.lora]}
                    if t.lora else {})}
                for t in self.plan.targets
            ],
            "audit": self.audit.to_json() if self.audit is not None else None,
            "quantization": self._quantization_json(),
            "kept_files": self.kept_files,
            "restored": self.restored,
            "embedded_adapter": self.embedded,
        }


    def _quantization_json(self) -> dict[str, object] | None:
        worst = self.worst_round_trip()
        if worst is None:
            return None
        return {"tensors": len(self.round_trips), "worst": {"name": worst[0], **worst[1].to_json()},
                "round_trips": {name: r.to_json() for name, r in sorted(self.round_trips.items())}}
