"""Findings and the report: stable codes, severities, and the one JSON document ``audit`` prints.

Every code is listed in :data:`CODES` with its severity and what it means; the README's table is generated
from the same list in spirit (a test checks they agree), so users can gate CI on codes.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from ckpttool.console.words import counted

ERROR, WARNING, INFO = "error", "warning", "info"
SEVERITIES = (ERROR, WARNING, INFO)

#: code -> (severity, what it means)
CODES: dict[str, tuple[str, str]] = {
    # files and index of a HuggingFace directory
    "header-invalid": (ERROR, "a weights file cannot be read: a safetensors file truncated, with a bad header, offsets "
                                "outside the file, a key twice, bytes between or after the tensors (the safetensors "
                                "library refuses it); a .bin file that is no torch.save state dict, or whose pickle asks "
                                "for a class that is not a tensor (refused unread)"),
    "index-invalid": (ERROR, "model.safetensors.index.json (or pytorch_model.bin.index.json) is not valid JSON or has "
                             "no weight_map"),
    "index-outside": (ERROR, "the index names a file outside the directory (../, an absolute path, a symlink out)"),
    "index-missing-file": (ERROR, "the index names a file that does not exist"),
    "index-wrong-file": (ERROR, "the index puts a tensor in a file that does not hold it"),
    "index-total-size": (ERROR, "metadata.total_size is not the sum of the tensors' bytes"),
    "tensor-duplicated": (ERROR, "a tensor is stored in two files"),
    "file-unreferenced": (WARNING, "a safetensors (or pytorch_model*.bin) file the index does not name, or beside "
                                   "model.safetensors without an index (transformers ignores it)"),
    "index-shadowed": (ERROR, "model.safetensors beside an index that does not name it: transformers loads it and "
                              "ignores the index"),
    "tensor-unlisted": (WARNING, "a tensor in a file but not in the index (transformers will not load it)"),
    "no-weights": (ERROR, "no tensors at all"),
    # sharded sources
    "coverage": (ERROR, "a tensor is not covered exactly once by the source's pieces (missing rank file, overlap)"),
    "padding-recorded": (INFO, "the source recorded padding that a merge strips"),
    "replica-divergence": (ERROR, "copies of a replicated tensor (e.g. a layer norm on every TP rank) differ"),
    "source-note": (INFO, "what the reader skipped or assumed (optimizer state, generic names)"),
    # names and shapes against the config
    "no-config": (INFO, "no config.json: names and shapes are not checked against an architecture"),
    "config-missing": (WARNING, "a HuggingFace directory without config.json: transformers cannot load it"),
    "config-invalid": (ERROR, "transformers cannot load config.json: a key it rejects (vocab_size not an integer) or "
                              "a model_type it does not know (and no auto_map to custom code)"),
    "tensor-missing": (ERROR, "the architecture expects a tensor that is not there"),
    "layers-missing": (ERROR, "every tensor of a range of layers is missing (a pipeline stage not merged)"),
    "expert-missing": (ERROR, "every tensor of an expert is missing"),
    "mtp-missing": (WARNING, "the config declares MTP layers (num_nextn_predict_layers) the checkpoint does not hold"),
    "mtp-untrained": (WARNING, "an MTP layer at its initialisation (norms exactly 1, projections at initializer_range) "
                               "or a copy of a main layer: never trained (transformers ignores it)"),
    "tensor-unexpected": (WARNING, "a tensor the architecture does not have (transformers ignores it)"),
    "shape-mismatch": (ERROR, "a tensor has another shape than the architecture gives"),
    "shape-tp-piece": (ERROR, "a tensor is one tensor-parallel piece of the expected one"),
    "shape-transposed": (ERROR, "a 2-D tensor is stored transposed"),
    "vocab-tp-piece": (ERROR, "the embedding or head is one TP piece of the vocab (padded or not)"),
    "vocab-padding-not-stripped": (ERROR, "the embedding or head still has the vocab padding rows"),
    "vocab-padding-doubled": (ERROR, "the vocab padding was applied twice"),
    "config-vocab-size": (ERROR, "embedding and head agree on a row count that is not the config's vocab_size"),
    # config consistency
    "tie-mismatch": (ERROR, "tie_word_embeddings contradicts lm_head (missing while untied, different while tied)"),
    "tied-copy": (INFO, "lm_head is saved although tied; it equals the embedding, transformers ignores it"),
    "tokenizer-vocab": (ERROR, "the tokenizer has token ids beyond the config's vocab_size"),
    "tokenizer-invalid": (WARNING, "tokenizer.json cannot be read as a tokenizer with a vocab"),
    "file-link-outside": (WARNING, "a tokenizer or generation file is a symlink out of the checkpoint: not read, not copied"),
    "vocab-rows-copied": (ERROR, "rows of the embedding or head past the tokenizer's ids repeat real rows: not padding "
                                 "(rows assembled from the wrong pieces)"),
    "tokenizer-smaller": (INFO, "the tokenizer has fewer tokens than vocab_size (usual with padded vocabs)"),
    "dtype-mix": (ERROR, "a floating-point tensor in another dtype than the rest of the model"),
    "config-dtype": (WARNING, "the config's dtype is not the dtype of the weights"),
    # quantized checkpoints (FP8 block-scaled, MXFP4)
    "quant-scale-missing": (ERROR, "a quantized weight without its scale tensor"),
    "quant-scale-orphan": (ERROR, "a scale tensor without its weight"),
    "quant-scale-shape": (ERROR, "a scale's shape is not the one its weight's shape and the block size give"),
    "quant-scale-dtype": (ERROR, "a scale or a quantized weight in a dtype its format does not use"),
    "quant-scale-invalid": (ERROR, "NaN, infinite, zero or negative scales (the blocks they scale are lost)"),
    "quant-config-missing": (ERROR, "quantized tensors but no quantization_config in config.json"),
    "quant-config-mismatch": (ERROR, "quantization_config disagrees with the tensors (method, format, or nothing quantized)"),
    "quant-not-converted": (ERROR, "modules_to_not_convert names a module whose weight is quantized"),
    "quant-split": (ERROR, "a quantized weight's pieces (TP/FSDP ranks) are cut off its block boundaries"),
    # data
    "nan": (ERROR, "the tensor holds NaN values"),
    "inf": (ERROR, "the tensor holds infinite values"),
    "zero-tensor": (ERROR, "a weight that is all zeros (a dead expert, a zero-filled missing piece)"),
    "zero-bias": (INFO, "a bias that is all zeros (normal in an untrained model)"),
    "constant-tensor": (WARNING, "a matrix whose every element has the same non-zero value"),
    "constant-vector": (INFO, "a vector whose every element is equal (norm weights at their initial value)"),
    "experts-identical": (ERROR, "two experts of a layer hold identical weights"),
    "norm-outlier": (WARNING, "a layer's tensor whose RMS is far from the same tensor in the other layers"),
    "norm-convention": (ERROR, "norm weights centred on the other convention than the model type's (zero-centred "
                               "1 + w as in Gemma, or plain w as in Llama): every norm scales by about 2, or 0"),
    # a LoRA fuse (merge --adapter): the output against its base and adapters (ckpttool.lora.audit)
    "lora-untrained": (ERROR, "a fused LoRA adapter whose lora_B weights are all zero (never trained): the fuse left "
                       "the base unchanged"),
    "lora-delta-mismatch": (ERROR, "a fused tensor whose sampled rows are not the base's plus scaling * B @ A"),
    "lora-untargeted-changed": (ERROR, "a tensor no adapter targets whose sampled rows differ from the base's"),
}


@dataclass(frozen=True, slots=True)
class Finding:
    """One thing the audit found: a stable ``code``, its severity, the tensor and file concerned, and why."""

    code: str
    severity: str
    message: str
    tensor: str | None = None
    file: str | None = None
    #: what the check knows of the cause beyond the tensor and file, e.g. ``(("missing_file", "__1_0.distcp"),)``
    #: or ``(("reference", "__0_0.distcp"),)``: the grouping into causes reads it (:mod:`ckpttool.audit.causes`)
    detail: tuple[tuple[str, str], ...] = ()

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {"code": self.code, "severity": self.severity, "tensor": self.tensor,
                                  "file": self.file, "message": self.message}
        if self.detail:
            doc["detail"] = dict(self.detail)
        return doc


def finding(code: str, message: str, *, tensor: str | None = None, file: str | None = None,
            severity: str | None = None, detail: tuple[tuple[str, str], ...] = ()) -> Finding:
    """A finding with the code's registered severity (or ``severity`` to lower it, e.g. without data)."""
    return Finding(code, severity or CODES[code][0], message, tensor, file, detail)


@dataclass(frozen=True, slots=True)
class Cause:
    """One root cause and the per-tensor findings it explains (a missing rank file and its 29 uncovered tensors).

    Attributes:
        code: the code its findings share.
        severity: the most severe of its findings'.
        cause: one line saying what is wrong, with layer and rank ranges compressed ("layers 0-60").
        tensors: the tensors concerned, in the findings' order, each once.
        findings: the per-tensor findings, as :attr:`Report.findings` lists them too.
    """

    code: str
    severity: str
    cause: str
    tensors: tuple[str, ...]
    findings: tuple[Finding, ...]

    def to_json(self) -> dict[str, object]:
        """The cause without its findings, which the report's ``findings`` list holds once."""
        return {"code": self.code, "severity": self.severity, "cause": self.cause, "count": self.count,
                "tensors": list(self.tensors)}

    @property
    def count(self) -> int:
        """How many tensors it concerns (how many findings when they name no tensor)."""
        return len(self.tensors) or len(self.findings)


@dataclass(frozen=True, slots=True)
class TensorStats:
    """Per-tensor statistics of a data check (float stats are None for integer tensors)."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    fingerprint: str
    rms: float | None = None
    mean: float | None = None
    min: float | None = None
    max: float | None = None
    nan: int = 0
    inf: int = 0

    def to_json(self) -> dict[str, object]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype, "fingerprint": self.fingerprint,
                "rms": self.rms, "mean": self.mean, "min": self.min, "max": self.max, "nan": self.nan, "inf": self.inf}


@dataclass(frozen=True, slots=True)
class Report:
    """What :func:`ckpttool.audit` found.

    Attributes:
        source: the audited directory.
        format: the reader used.
        config: the config.json used, if any.
        model_type: the architecture checked against, if any.
        data_checked: whether tensor data was read (False with ``--no-data``).
        tensors: how many tensors the checkpoint holds (after mapping to HuggingFace names).
        findings: errors first, then warnings, then info.
        stats: per-tensor statistics, when data was checked.
        adapter: the family adapter that named the tensors (:mod:`ckpttool.families`), in words.
        causes: the findings grouped by root cause (:mod:`ckpttool.audit.causes`), errors first.
        expected: the on-disk names the architecture declares (empty without a config), so that the HTML report
            draws a missing layer or expert as missing rather than leaving it out.
    """

    source: str
    format: str
    config: str | None
    model_type: str | None
    data_checked: bool
    tensors: int
    findings: tuple[Finding, ...]
    stats: tuple[TensorStats, ...] = field(default=())
    adapter: str | None = None
    causes: tuple[Cause, ...] = ()
    expected: tuple[str, ...] = field(default=(), repr=False)

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == ERROR)

    @property
    def ok(self) -> bool:
        return not self.errors

    def strict(self) -> Report:
        """The same report with every warning promoted to an error (``--strict``)."""
        def promote(f: Finding) -> Finding:
            return replace(f, severity=ERROR) if f.severity == WARNING else f

        causes = tuple(replace(c, severity=ERROR if c.severity == WARNING else c.severity,
                               findings=tuple(map(promote, c.findings))) for c in self.causes)
        return replace(self, findings=sort_findings([promote(f) for f in self.findings]),
                       causes=tuple(sorted(causes, key=_severity_order)))

    def counts(self) -> str:
        """The findings counted by severity, in words, as the terminal and the HTML report print them:
        ``1 error, 2 warnings, 0 info``."""
        found = Counter(f.severity for f in self.findings)
        return (f"{counted(found[ERROR], 'error')}, {counted(found[WARNING], 'warning')}, "
                f"{counted(found[INFO], 'info', 'info')}")

    def summary(self) -> dict[str, object]:
        counts = Counter(f.severity for f in self.findings)
        return {
            "source": self.source,
            "format": self.format,
            "config": self.config,
            "model_type": self.model_type,
            "adapter": self.adapter,
            "data_checked": self.data_checked,
            "tensors": self.tensors,
            "errors": counts[ERROR],
            "warnings": counts[WARNING],
            "info": counts[INFO],
            "causes": len(self.causes),
            "verdict": "pass" if self.ok else "fail",
        }

    def to_json(self) -> dict[str, object]:
        doc: dict[str, object] = {"findings": [f.to_json() for f in self.findings],
                                  "causes": [c.to_json() for c in self.causes], "summary": self.summary()}
        if self.stats:
            doc["tensors"] = [s.to_json() for s in self.stats]
        return doc


def sort_findings(findings: list[Finding] | tuple[Finding, ...]) -> tuple[Finding, ...]:
    return tuple(sorted(findings, key=_severity_order))


def _severity_order(item: Finding | Cause) -> int:
    return SEVERITIES.index(item.severity)
