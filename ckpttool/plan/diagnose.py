"""Why a tensor has the wrong shape: the arithmetic of tensor parallelism and vocab padding, in words.

A wrong shape is rarely random. A dimension that is ``expected / k`` is one of ``k`` TP pieces; an embedding
with more rows than the vocab kept its padding; one with ``padded / k`` rows is a single piece of a padded
vocab. :func:`diagnose` tries these explanations in order and returns the first that fits exactly, with a
stable code, so both ``merge`` (in its error) and ``audit`` (as a finding) say the same thing.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

Shape = tuple[int, ...]

#: vocab padding multiples tried, largest first (Megatron's make_vocab_size_divisible_by is 128 by default)
PAD_MULTIPLES = (128, 64, 32, 16, 8, 4, 2)
#: tensor-parallel degrees tried
MAX_TP = 1024


@dataclass(frozen=True, slots=True)
class Diagnosis:
    """A likely cause: ``code`` is stable (a finding code), ``text`` explains it with the numbers."""

    code: str
    text: str


def diagnose(name: str, got: Shape, expected: Shape, vocab_size: int | None = None,
             vocab_rows: Mapping[str, int] | None = None) -> Diagnosis:
    """The likely cause of ``got`` where ``expected`` was due.

    Args:
        name: the tensor, for the text.
        got, expected: the shapes.
        vocab_size: the config's ``vocab_size``; rows of vocab tensors are checked against padding rules.
        vocab_rows: rows of every vocab-sized tensor present (embedding, lm_head), to tell a wrong config
            from a wrong tensor.
    """
    got, expected = tuple(got), tuple(expected)
    if vocab_size and len(got) == len(expected) >= 1 and got[1:] == expected[1:] and expected[0] == vocab_size:
        found = _vocab(got[0], vocab_size, vocab_rows or {})
        if found is not None:
            return found
    if len(got) == 2 and got == expected[::-1]:
        return Diagnosis("shape-transposed", f"transposed: {list(got)} is {list(expected)} with its dims swapped")
    if len(got) == len(expected):
        differ = [d for d in range(len(got)) if got[d] != expected[d]]
        if len(differ) == 1:
            d = differ[0]
            k = _pieces(got[d], expected[d])
            if k is not None:
                return Diagnosis(
                    "shape-tp-piece",
                    f"dim {d} has {got[d]} of {expected[d]} ({_dim_word(d)}): one of {k} TP pieces; {_others(k)}",
                )
            if got[d] > expected[d] and got[d] % expected[d] == 0:
                k = got[d] // expected[d]
                return Diagnosis(
                    "shape-mismatch",
                    f"dim {d} is {k}x the expected {expected[d]}: pieces concatenated {k} times, or a fused tensor "
                    "that was not split",
                )
    return Diagnosis("shape-mismatch", f"{list(got)} instead of {list(expected)}")


#: diagnoses that say a tensor is wrong as saved, whatever the config: a merge without a config would publish it so
DAMAGED = ("vocab-tp-piece", "shape-tp-piece", "vocab-padding-not-stripped", "vocab-padding-doubled", "shape-transposed")


def refusal_advice(codes: Iterable[str]) -> str:
    """What to do about a merge refused for tensors that do not match the config. A merge without a config is
    offered only when no tensor is diagnosed as damaged: it would publish a damaged tensor unchanged (the seed
    incident: one TP piece of a padded vocab saved as the whole embedding)."""
    damaged = [code for code in DAMAGED if code in set(codes)]
    if not damaged:
        return "Pass the config the model was trained with (--config), or no config for a generic merge."
    return (
        f"A tensor above is wrong as saved ({', '.join(damaged)}): a merge without a config would publish it "
        "unchanged, so do not drop the config. Save the checkpoint again with every piece, or pass the config the "
        "model was trained with (--config) if this one is not it."
    )


def padded(n: int, multiple: int) -> int:
    """``n`` rounded up to a multiple of ``multiple``."""
    return math.ceil(n / multiple) * multiple


def _vocab(rows: int, vocab: int, vocab_rows: Mapping[str, int]) -> Diagnosis | None:
    if rows < vocab:
        k = _pieces(rows, vocab)
        if k is not None:
            return Diagnosis(
                "vocab-tp-piece",
                f"{rows} rows is one of {k} TP pieces of the {vocab}-row vocab; {_others(k)}" + _or_config(rows, vocab_rows),
            )
        for k in range(2, MAX_TP + 1):
            if rows * k < vocab:
                continue
            if rows * k >= vocab + k * PAD_MULTIPLES[0]:
                break
            for m in PAD_MULTIPLES:
                if padded(vocab, m * k) == rows * k:
                    return Diagnosis(
                        "vocab-tp-piece",
                        f"{rows} rows is one of {k} TP pieces of a vocab padded to {rows * k} "
                        f"(multiple of {m}x{k}); {_others(k)}",
                    )
    if rows > vocab:
        multiple = _padding_multiple(vocab, rows)
        if multiple is not None:
            return Diagnosis(
                "vocab-padding-not-stripped",
                f"vocab padding not stripped: {rows} rows is vocab_size {vocab} padded to a multiple of {multiple}; "
                f"rows {vocab}..{rows} are padding",
            )
        extra = rows - vocab
        if extra % 2 == 0 and _padding_multiple(vocab, vocab + extra // 2) is not None:
            return Diagnosis(
                "vocab-padding-doubled",
                f"vocab padding applied twice: {rows} = {vocab} + 2x{extra // 2} rows; padded once it would be "
                f"{vocab + extra // 2}",
            )
    others = set(vocab_rows.values())
    if len(vocab_rows) >= 1 and others == {rows} and rows != vocab:
        names = " and ".join(sorted(vocab_rows))
        return Diagnosis(
            "config-vocab-size",
            f"{names} {'both have' if len(vocab_rows) > 1 else 'has'} {rows} rows: the config's vocab_size {vocab} "
            "looks wrong",
        )
    if rows > vocab:
        return Diagnosis("shape-mismatch", f"{rows - vocab} rows beyond vocab_size {vocab}")
    return None


def _padding_multiple(vocab: int, rows: int) -> int | None:
    """The smallest multiple ``q`` (a padding multiple times a TP degree) with ``rows == padded(vocab, q)``."""
    if rows <= vocab:
        return None
    candidates = sorted({m * k for m in PAD_MULTIPLES for k in (1, 2, 4, 8, 16, 32, 64)})
    return next((q for q in candidates if padded(vocab, q) == rows), None)


def _pieces(part: int, whole: int) -> int | None:
    """``k`` when ``part`` is one piece of ``whole`` split ``k`` ways (evenly, or as torch splits unevenly)."""
    if part <= 0 or part >= whole:
        return None
    for k in range(2, min(MAX_TP, whole) + 1):
        if part in (math.ceil(whole / k), whole // k) or (whole % k and part == whole - (k - 1) * math.ceil(whole / k)):
            return k
        if math.ceil(whole / k) < part:
            break
    return None


def _others(k: int) -> str:
    return "the other piece is missing" if k == 2 else f"the other {k - 1} are missing"


def _or_config(rows: int, vocab_rows: Mapping[str, int]) -> str:
    if len(vocab_rows) > 1 and set(vocab_rows.values()) == {rows}:
        return f"; or, as {' and '.join(sorted(vocab_rows))} agree on {rows} rows, the config's vocab_size is wrong"
    return ""


def _dim_word(d: int) -> str:
    return {0: "rows: a column-parallel split", 1: "columns: a row-parallel split"}.get(d, f"dim {d}")
