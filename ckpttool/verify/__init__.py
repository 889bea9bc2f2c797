"""``verify``: does the converted model load and run, and does it compute what the reference computes?

Identical-looking weights are not proof: a q/k projection permuted within its heads (as HF <-> Meta RoPE
conversions do) keeps every shape and statistic, and in a small float32 model moves the logits by a few percent
while the top-1 token still agrees almost everywhere. So the verdict rests on the logits themselves: the
largest difference relative to the reference's logit scale, the least cosine similarity per position and the
largest KL divergence per position, against a tolerance that follows the dtypes compared (float32 against
float32 is near-exact; a bfloat16 copy of a float32 model differs by its rounding, well below what a
permutation moves). Top-1 agreement is reported and checked, never the only test.

This package is the check: the forward (:mod:`.forward`), the configs refused before it (:mod:`.guard`), the input
(:mod:`.prompt`), the tolerances and the comparison (here). The ``verify`` command that runs it, paths first and a
sharded reference merged, is :func:`ckpttool.commands.verify.verify` (``ckpttool.verify()``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ckpttool.errors import SourceError
from ckpttool.verify.forward import Forward
from ckpttool.verify.prompt import MAX_TOKENS, SENTENCE, TEXT_LIMIT

__all__ = ["MAX_TOKENS", "SENTENCE", "TEXT_LIMIT", "Comparison", "Tolerance", "TOLERANCES", "VerifyResult", "compare",
           "tolerance_for"]

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
    #: a vision-language model's second input, with an image (how it was made), and that forward's comparison
    image_from: str | None = None
    image_comparison: Comparison | None = None

    @property
    def problems(self) -> tuple[str, ...]:
        ref = self.reference.problems if self.reference is not None else ()
        differs = self.comparison.failures if self.comparison is not None else ()
        image = self.image_comparison.failures if self.image_comparison is not None else ()
        return (*self.output.problems, *(f"reference: {p}" for p in ref), *(f"differs: {f}" for f in differs),
                *(f"differs with an image: {f}" for f in image))

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_json(self) -> dict[str, object]:
        return {"status": "ok" if self.ok else "failed", "input_ids": list(self.input_ids), "input_from": self.input_from,
                "output": self.output.to_json(),
                "reference": self.reference.to_json() if self.reference is not None else None,
                "comparison": self.comparison.to_json() if self.comparison is not None else None,
                "image_from": self.image_from,
                "image_comparison": self.image_comparison.to_json() if self.image_comparison is not None else None,
                "problems": list(self.problems)}

    def lines(self) -> list[str]:
        """The terminal report: what ran, the measures, and every problem."""
        out = [f"output:    {self.output.path} ({self.output.architecture}, {self.output.dtype})"]
        if self.reference is not None:
            out.append(f"reference: {self.reference.path} ({self.reference.architecture}, {self.reference.dtype})")
        out.append(f"input:     {len(self.input_ids)} tokens ({self.input_from})")
        if self.image_from is not None:
            out.append(f"image:     {self.image_from}")
        for note in (*self.output.notes, *(self.reference.notes if self.reference is not None else ())):
            out.append(f"note: {note}")
        c = self.comparison
        if c is not None:
            out.append(f"top-1 agreement {c.top1:.1%}; max |Δlogit| {c.max_abs:.4g} ({c.max_rel:.3g} of scale, "
                       f"tolerance {c.tolerance.max_rel:g}); mean |Δlogit| {c.mean_abs:.4g}; "
                       f"min cosine {c.cosine:.9f}; max KL {c.kl:.3g}")
        seen = self.image_comparison
        if seen is not None:
            out.append(f"with the image: top-1 agreement {seen.top1:.1%}; max |Δlogit| {seen.max_abs:.4g} "
                       f"({seen.max_rel:.3g} of scale); min cosine {seen.cosine:.9f}; max KL {seen.kl:.3g}")
        out += [f"  - {p}" for p in self.problems]
        if self.ok:
            out.append("verified: equal to the reference within tolerance" if c is not None
                       else "verified: loads strictly; logits finite and informative")
        else:
            out.append(f"failed: {len(self.problems)} problem{'s' if len(self.problems) != 1 else ''}")
        return out
