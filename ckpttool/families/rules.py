"""The declarative transforms of a family's adapter: renames, and stacked experts cut into per-expert tensors.

A family's in-memory (DCP, FSDP, transformers) tensors and its on-disk HuggingFace tensors differ by a few
named transforms; each is data here, applied as boxes (no tensor is materialised), and every plan made with
them is checked against transformers' on-disk names and shapes, so a wrong rule is an error, never a
silently wrong checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..engine.layout import Box, TensorLayout
from ..engine.plan import Slice, TargetSpec, tensor_specs
from ..errors import ConfigError


@dataclass(frozen=True, slots=True)
class Rename:
    """An in-memory name that ``save_pretrained`` writes under another name."""

    pattern: str
    replacement: str


@dataclass(frozen=True, slots=True)
class Unstack:
    """A stacked expert tensor ``(E, k*n, ...)`` saved as ``k`` tensors ``(n, ...)`` per expert.

    ``names`` are templates with ``{prefix}`` (the pattern's first group) and ``{expert}``; part ``i`` of an
    expert is rows ``i*n .. (i+1)*n`` of that expert's slab (e.g. ``gate_up_proj`` = [gate; up]).
    """

    pattern: str
    names: tuple[str, ...]


#: the transforms of one family, tried in order; the first whose pattern matches a name applies
Rules = tuple[Rename | Unstack, ...]


def cut(tensor: TensorLayout, name: str, rules: Rules) -> list[TargetSpec]:
    """The on-disk targets of ``tensor`` (called ``name`` once a wrapper prefix is stripped) under ``rules``.

    Raises:
        ConfigError: a stacked tensor cannot be split as its rule says.
    """
    for rule in rules:
        match = re.match(rule.pattern, name)
        if match is None:
            continue
        if isinstance(rule, Rename):
            return tensor_specs(tensor, match.expand(rule.replacement))
        return _unstack(tensor, match.group(1), rule)
    return tensor_specs(tensor, name)


def _unstack(tensor: TensorLayout, prefix: str, rule: Unstack) -> list[TargetSpec]:
    shape = tensor.true_shape
    parts = len(rule.names)
    if len(shape) < 2 or shape[1] % parts:
        raise ConfigError(
            f"'{tensor.fqn}': shape {list(shape)} cannot be split into {parts} per-expert parts along dim 1"
        )
    experts, rows, rest = shape[0], shape[1], shape[2:]
    n = rows // parts
    specs = []
    for e in range(experts):
        for i, template in enumerate(rule.names):
            src = Box((e, i * n, *(0 for _ in rest)), (1, n, *rest))
            out_shape = (n, *rest)
            name = template.format(prefix=prefix, expert=e)
            specs.append(TargetSpec(name, out_shape, (Slice(tensor.fqn, src, Box.whole(out_shape)),)))
    return specs
