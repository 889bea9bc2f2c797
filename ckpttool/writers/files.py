"""The output's files as planned: which targets each safetensors file holds, in write order."""

from __future__ import annotations

from dataclasses import dataclass

from ckpttool.plan.plan import Target, target_sizes


@dataclass(frozen=True, slots=True)
class OutputFile:
    """One safetensors file of the output: its name and the targets it holds, in write order."""

    name: str
    targets: tuple[Target, ...]

    @property
    def nbytes(self) -> int:
        return sum(target_sizes(self.targets))
