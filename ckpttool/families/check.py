"""A checkpoint's HuggingFace tensors against what transformers expects for its config: missing, unexpected and
wrongly shaped tensors, each wrong shape with a diagnosis in numbers (:mod:`ckpttool.plan.diagnose`). The MTP layers a
config declares (:mod:`.mtp`) are expected when the checkpoint holds any of them, and no mismatch when it holds none
(:func:`.mtp.absent` says which)."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import filterfalse
from dataclasses import dataclass

from ckpttool.console.terminal import quoted
from ckpttool.model.description import ModelInfo
from ckpttool.plan.diagnose import Diagnosis, diagnose
from ckpttool.layout.layout import Shape
from ckpttool.families import mtp


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One difference between a checkpoint's tensors and the architecture.

    ``kind`` is ``"missing"`` (expected, not there), ``"unexpected"`` (there, not expected) or ``"shape"``;
    ``diagnosis`` explains a wrong shape; ``context`` says why a missing tensor is expected, where it is not
    the plain architecture (an MTP layer held in part).
    """

    kind: str
    name: str
    shape: Shape | None
    expected: Shape | None
    model_type: str
    diagnosis: Diagnosis | None = None
    context: str | None = None

    def message(self) -> str:
        if self.kind == "missing":
            why = f" ({self.context})" if self.context else ""
            return f"{quoted(self.name)}: expected by the config but not in the checkpoint{why}"
        if self.kind == "unexpected":
            return f"{quoted(self.name)}: not a tensor of a {self.model_type} model built from this config"
        assert self.shape is not None and self.expected is not None and self.diagnosis is not None
        return (
            f"{quoted(self.name)}: shape {list(self.shape)}, but the config gives {list(self.expected)} "
            f"({self.diagnosis.text})"
        )


def compare_with_model(shapes: Mapping[str, Shape], info: ModelInfo) -> list[Mismatch]:
    """Every tensor of ``shapes`` (on-disk names) that the architecture does not expect, or expects with
    another shape, then every expected tensor that is missing; wrong shapes come with a diagnosis. Of the MTP
    layers the config declares, those ``shapes`` holds any tensor of are expected whole; the others are not
    expected (:func:`.mtp.absent`), so their tensors are no mismatch."""
    layers = mtp.expected(info)
    extra = {name: (shape, n) for n in mtp.held(shapes, layers) for name, shape in layers[n].items()}
    expected_shapes = {**info.disk_shapes, **{name: shape for name, (shape, _) in extra.items()}}
    vocab = info.config.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) else None
    vocab_rows = {
        name: shapes[name][0] for name, expected in info.disk_shapes.items()
        if vocab and expected and expected[0] == vocab and name in shapes and shapes[name]
    }
    found: list[Mismatch] = []
    for name, shape in shapes.items():
        expected = expected_shapes.get(name)
        if expected is None:
            found.append(Mismatch("unexpected", name, tuple(shape), None, info.model_type))
        elif expected != shape and tuple(expected) != tuple(shape):  # equal tuples (most): no copies made
            why = diagnose(name, tuple(shape), tuple(expected), vocab, vocab_rows)
            found.append(Mismatch("shape", name, tuple(shape), tuple(expected), info.model_type, why))
    missing = list(filterfalse(shapes.__contains__, expected_shapes))  # found at C speed: most are there
    found.extend(
        Mismatch("missing", name, None, tuple(expected_shapes[name]), info.model_type,
                 context=mtp.partly_held(extra[name][1]) if name in extra else None)
        for name in missing
    )
    return found
