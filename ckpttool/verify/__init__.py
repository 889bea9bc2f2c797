"""``verify``: does the converted model load and run, and does it compute what the reference computes?

Identical-looking weights are not proof: a q/k projection permuted within its heads (as HF <-> Meta RoPE
conversions do) keeps every shape and statistic, and in a small float32 model moves the logits by a few percent
while the top-1 token still agrees almost everywhere. So the verdict rests on the logits themselves: the
largest difference relative to the reference's logit scale, the least cosine similarity per position and the
largest KL divergence per position, against a tolerance that follows the dtypes compared (float32 against
float32 is near-exact; a bfloat16 copy of a float32 model differs by its rounding, well below what a
permutation moves). Top-1 agreement is reported and checked, never the only test.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ckpttool.errors import ArgumentError, SourceError, SourceNotFoundError
from ckpttool.verify.forward import Forward, read_config, run_forward
from ckpttool.verify.guard import check_config, refuse_remote_code
from ckpttool.verify.prompt import MAX_TOKENS, SENTENCE, TEXT_LIMIT, check_text, check_tokens, choose_input

__all__ = ["MAX_TOKENS", "SENTENCE", "TEXT_LIMIT", "Comparison", "Tolerance", "TOLERANCES", "VerifyResult", "compare",
           "tolerance_for", "verify"]

@dataclass(frozen=True, slots=True)
class Tolerance:
    """When two runs count as computing the same thing.

    Attributes:
        max_rel: largest |logit difference| over the largest |reference logit|.
        cosine: largest ``1 - cosine similarity`` of the logits at one position.
        kl: largest KL(reference || output) of the next-token distributions at one position, in nats.
        top1: least share of positions whose top-1 token agrees.
    """

    max_rel: float
    cosine: float
    kl: float
    top1: float

    def to_json(self) -> dict[str, float]:
        return {"max_rel": self.max_rel, "cosine": self.cosine, "kl": self.kl, "top1": self.top1}


#: by the least precise dtype compared; a bfloat16 copy of a tiny float32 Llama: max_rel 1.3e-2, 1-cos 9e-5, KL 6e-6;
#: its q/k permuted within heads: max_rel 6-8e-2, 1-cos 3.5e-3, KL 2.4e-4 (tests/test_verify.py)
TOLERANCES = {
    "float32": Tolerance(max_rel=1e-5, cosine=1e-6, kl=1e-6, top1=1.0),
    "float16": Tolerance(max_rel=5e-3, cosine=1e-4, kl=1e-5, top1=0.75),
    "bfloat16": Tolerance(max_rel=3e-2, cosine=5e-4, kl=5e-5, top1=0.75),
}


def tolerance_for(*dtypes: str) -> Tolerance:
    """The tolerance of the least precise of ``dtypes`` (float32's for any dtype it does not know)."""
    order = ["bfloat16", "float16", "float32"]
    known = [d for d in dtypes if d in order] or ["float32"]
    return TOLERANCES[min(known, key=order.index)]


@dataclass(frozen=True, slots=True)
class Comparison:
    """How the output's logits compare with the reference's on the same input."""

    top1: float
    max_abs: float
    mean_abs: float
    max_rel: float
    cosine: float
    kl: float
    tolerance: Tolerance

    @property
    def failures(self) -> tuple[str, ...]:
        t, out = self.tolerance, []
        if self.max_rel > t.max_rel:
            out.append(f"max |Δlogit| is {self.max_rel:.3g} of the reference's logit scale (tolerance {t.max_rel:g})")
        if 1 - self.cosine > t.cosine:
            out.append(f"least cosine similarity {self.cosine:.9f} (1 - cos = {1 - self.cosine:.3g}, tolerance {t.cosine:g})")
        if self.kl > t.kl:
            out.append(f"largest KL divergence {self.kl:.3g} nats (tolerance {t.kl:g})")
        if self.top1 < t.top1:
            out.append(f"top-1 token agrees at {self.top1:.1%} of positions (tolerance {t.top1:.0%})")
        return tuple(out)

    def to_json(self) -> dict[str, object]:
        return {"top1_agreement": self.top1, "max_abs_diff": self.max_abs, "mean_abs_diff": self.mean_abs,
                "max_rel_diff": self.max_rel, "min_cosine": self.cosine, "max_kl": self.kl,
                "tolerance": self.tolerance.to_json(), "failures": list(self.failures)}


def compare(logits: torch.Tensor, reference: torch.Tensor, tolerance: Tolerance) -> Comparison:
    """Compare ``[positions, vocab]`` logits with the reference's."""
    if logits.shape != reference.shape:
        raise SourceError(f"the logits have shape {list(logits.shape)} and the reference's {list(reference.shape)}: "
                          f"the two models have different vocabularies")
    a, b = reference.double(), logits.double()
    diff = (a - b).abs()
    scale = float(a.abs().max()) or 1.0
    kl = torch.nn.functional.kl_div(b.log_softmax(-1), a.log_softmax(-1), log_target=True, reduction="none").sum(-1)
    return Comparison(
        top1=float((a.argmax(-1) == b.argmax(-1)).double().mean()),
        max_abs=float(diff.max()), mean_abs=float(diff.mean()), max_rel=float(diff.max()) / scale,
        cosine=float(torch.nn.functional.cosine_similarity(a, b, dim=-1).min()), kl=max(0.0, float(kl.max())),
        tolerance=tolerance,
    )


@dataclass(frozen=True, slots=True)
class VerifyResult:
    """The output's forward, and, with a reference, how its logits compare. ``ok`` is the verdict."""

    input_ids: tuple[int, ...]
    input_from: str
    output: Forward
    reference: Forward | None = None
    comparison: Comparison | None = None

    @property
    def problems(self) -> tuple[str, ...]:
        ref = self.reference.problems if self.reference is not None else ()
        differs = self.comparison.failures if self.comparison is not None else ()
        return (*self.output.problems, *(f"reference: {p}" for p in ref), *(f"differs: {f}" for f in differs))

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, object]:
        return {"status": "ok" if self.ok else "failed", "input_ids": list(self.input_ids), "input_from": self.input_from,
                "output": self.output.to_json(),
                "reference": self.reference.to_json() if self.reference is not None else None,
                "comparison": self.comparison.to_json() if self.comparison is not None else None,
                "problems": list(self.problems)}

    def lines(self) -> list[str]:
        """The terminal report: what ran, the measures, and every problem."""
        out = [f"output:    {self.output.path} ({self.output.architecture}, {self.output.dtype})"]
        if self.reference is not None:
            out.append(f"reference: {self.reference.path} ({self.reference.architecture}, {self.reference.dtype})")
        out.append(f"input:     {len(self.input_ids)} tokens ({self.input_from})")
        for note in (*self.output.notes, *(self.reference.notes if self.reference is not None else ())):
            out.append(f"note: {note}")
        c = self.comparison
        if c is not None:
            out.append(f"top-1 agreement {c.top1:.1%}; max |Δlogit| {c.max_abs:.4g} ({c.max_rel:.3g} of scale, "
                       f"tolerance {c.tolerance.max_rel:g}); mean |Δlogit| {c.mean_abs:.4g}; "
                       f"min cosine {c.cosine:.9f}; max KL {c.kl:.3g}")
        out += [f"  - {p}" for p in self.problems]
        if self.ok:
            out.append("verified: equal to the reference within tolerance" if c is not None
                       else "verified: loads strictly; logits finite and informative")
        else:
            out.append(f"failed: {len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}")
        return out


def verify(
    out: str | Path,
    *,
    against: str | Path | None = None,
    tokens: int | None = None,
    text: str | Path | None = None,
    tolerance: Tolerance | float | None = None,
    stream: bool = True,
) -> VerifyResult:
    """Load ``out`` as transformers will and run a forward; with ``against``, compare with the reference.

    Args:
        out: a HuggingFace directory (``config.json`` + safetensors), e.g. what ``merge`` wrote.
        against: the reference, in any format ckpttool reads; a sharded one is merged to a temporary directory.
        tokens: feed this many fixed token ids (below the vocab size) instead of the tokenizer's sentence.
        text: a text file to tokenize with the checkpoint's tokenizer and feed instead.
        tolerance: when the logits count as equal; by default :func:`tolerance_for` the dtypes compared; a float
            replaces that default's ``max_rel`` (the largest |Δlogit| relative to the reference's logit scale).
        stream: load one module at a time from disk (bounded memory); False loads each model whole.

    Returns:
        A :class:`VerifyResult`; ``result.ok`` is False when loading was not strict, the logits are not finite or
        carry no information, or they differ from the reference's beyond the tolerance.

    Every path is checked first (``out``, ``against``, ``text``), then each directory's configs, before a
    reference is merged or transformers reads a file. A directory whose configs name code to import
    (``auto_map``) is refused: verify never runs code shipped in a checkpoint, and never reads stdin.

    Raises:
        ArgumentError: both ``tokens`` and ``text``, or ``tokens`` outside 1..:data:`MAX_TOKENS`.
        SourceNotFoundError: ``out`` or ``against`` does not exist.
        ConfigError: a config names code to import (``auto_map``), or holds a value transformers cannot load
            (a ``pad_token_id`` outside the vocab, an unknown ``quantization_config.quant_method``, a kernel
            other than torch's, a non-positive size, fewer ``max_position_embeddings`` than tokens fed).
        SourceError: ``text`` is larger than :data:`TEXT_LIMIT` bytes or encodes to more than
            :data:`MAX_TOKENS` tokens; a model cannot be read or loaded.

    Example:
        >>> ckpttool.verify("out/llama", against="ckpt/").ok  # doctest: +SKIP
    """
    if tokens is not None and text is not None:
        raise ArgumentError("tokens= and text= both given: feed fixed token ids or a text, not both")
    if tokens is not None:
        check_tokens(tokens)
    path = Path(out)
    _check_paths(path, Path(against) if against is not None else None, text)
    config = _checked_config(path, tokens)
    if against is not None and Path(against).is_dir():
        refuse_remote_code(Path(against))  # a sharded reference's own configs, before merge copies them
    with tempfile.TemporaryDirectory(prefix="ckpttool-verify-ref-") as scratch:
        ref = _as_hf(Path(against), Path(scratch)) if against is not None else None
        ref_config = _checked_config(ref, tokens) if ref is not None else None
        ids, source = choose_input(path, ref, config, ref_config, tokens, text)
        output = run_forward(path, ids, stream=stream)
        if ref is None:
            return VerifyResult(tuple(ids), source, output)
        reference = run_forward(ref, ids, stream=stream)
    reference = _labelled(reference, str(against))
    chosen = tolerance_for(output.dtype, reference.dtype)
    if isinstance(tolerance, Tolerance):
        chosen = tolerance
    elif tolerance is not None:
        chosen = replace(chosen, max_rel=float(tolerance))
    comparison = None
    if output.logits.numel() and reference.logits.numel():
        comparison = compare(output.logits, reference.logits, chosen)
    return VerifyResult(tuple(ids), source, output, reference, comparison)


def _check_paths(out: Path, against: Path | None, text: str | Path | None) -> None:
    """Every path argument exists (and the text is small enough) before anything is read or merged."""
    if not out.is_dir():
        raise SourceNotFoundError(f"'{out}': no such directory")
    if against is not None and not against.exists():
        raise SourceNotFoundError(f"reference '{against}': no such file or directory")
    if text is not None:
        check_text(text)


def _checked_config(path: Path, tokens: int | None) -> dict[str, object]:
    """The config of the HF directory ``path``, refused when it names code to run or values transformers
    cannot load (the length of a text or sentence is checked once it is tokenized)."""
    config = read_config(path)
    refuse_remote_code(path)
    check_config(path, config, tokens)
    return config


def _labelled(forward: Forward, path: str) -> Forward:
    return Forward(path, forward.architecture, forward.dtype, forward.problems, forward.notes, forward.logits)


def _as_hf(ref: Path, scratch: Path) -> Path:
    """The reference as an HF directory: itself when it is one of safetensors, else merged (unaudited) into
    ``scratch``; ``.bin`` weights too, which transformers would unpickle and ckpttool reads without running a pickle."""
    from ckpttool.commands.merge import merge
    from ckpttool.readers import detect_format, hf

    if not ref.exists():
        raise SourceNotFoundError(f"reference '{ref}': no such file or directory")
    if detect_format(ref) == "hf" and hf.SAFETENSORS.present(ref) and (ref / "config.json").is_file():
        return ref
    merged = scratch / "reference"
    merge(ref, merged, audit=False)
    return merged
