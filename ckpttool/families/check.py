"""A checkpoint's HuggingFace tensors against what transformers expects for its config: missing, unexpected and
wrongly shaped tensors, each wrong shape with a diagnosis in numbers (:mod:`ckpttool.diagnose`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..architecture import ModelInfo
from ..diagnose import Diagnosis, diagnose
from ..engine.layout import Shape


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One difference between a checkpoint's tensors and the architecture.

    ``kind`` is ``"missing"`` (expected, not there), ``"unexpected"`` (there, not expected) or ``"shape"``;
    ``diagnosis`` explains a wrong shape.
    """

    kind: str
    name: str
    shape: Shape | None
    expected: Shape | None
    model_type: str
    diagnosis: Diagnosis | None = None

    def message(self) -> str:
        if self.kind == "missing":
            return f"'{self.name}': expected by the config but not in the checkpoint"
        if self.kind == "unexpected":
            return f"'{self.name}': not a tensor of a {self.model_type} model built from this config"
        assert self.shape is not None and self.expected is not None and self.diagnosis is not None
        return (
            f"'{self.name}': shape {list(self.shape)}, but the config gives {list(self.expected)} "
            f"({self.diagnosis.text})"
        )


def compare_with_model(shapes: Mapping[str, Shape], info: ModelInfo) -> list[Mismatch]:
    """Every tensor of ``shapes`` (on-disk names) that the architecture does not expect, or expects with
    another shape, then every expected tensor that is missing; wrong shapes come with a diagnosis."""
    vocab = info.config.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) else None
    vocab_rows = {
        name: shapes[name][0] for name, expected in info.disk_shapes.items()
        if vocab and expected and expected[0] == vocab and name in shapes and shapes[name]
    }
    found: list[Mismatch] = []
    for name, shape in shapes.items():
        expected = info.disk_shapes.get(name)
        if expected is None:
            found.append(Mismatch("unexpected", name, tuple(shape), None, info.model_type))
        elif tuple(expected) != tuple(shape):
            why = diagnose(name, tuple(shape), tuple(expected), vocab, vocab_rows)
            found.append(Mismatch("shape", name, tuple(shape), tuple(expected), info.model_type, why))
    found.extend(
        Mismatch("missing", name, None, tuple(expected), info.model_type)
        for name, expected in info.disk_shapes.items() if name not in shapes
    )
    return found
