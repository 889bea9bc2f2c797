"""The declarative transforms of a family's adapter: renames, and stacked experts cut into per-expert tensors.

A family's in-memory (DCP, FSDP, transformers) tensors and its on-disk HuggingFace tensors differ by a few
named transforms; each is data here, applied as boxes (no tensor is materialised), and every plan made with
them is checked against transformers' on-disk names and shapes, so a wrong rule is an error, never a
silently wrong checkpoint.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass

from ckpttool.layout.layout import Box, Shape, TensorLayout
from ckpttool.plan.tiling import Slice
from ckpttool.plan.plan import TargetSpec, tensor_specs
from ckpttool.errors import ConfigError


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

#: on-disk names of tensors never cast, whatever ``--dtype`` says: the router bias of DeepSeek-V3 and GLM-4.5
#: (``mlp.gate.e_score_correction_bias``) is FP32 in their releases, in transformers (its
#: ``_keep_in_fp32_modules_strict``) and in Megatron-Core (``router.expert_bias``), and its small corrections to the
#: routing scores do not survive bfloat16
KEEP_DTYPE: tuple[str, ...] = (r"(^|\.)e_score_correction_bias$",)


def keeps_dtype(name: str) -> bool:
    """Whether the target ``name`` (on-disk) keeps its source's dtype when a merge casts (:data:`KEEP_DTYPE`)."""
    return any(re.search(pattern, name) for pattern in KEEP_DTYPE)


def cut(tensor: TensorLayout, name: str, rules: Rules) -> list[TargetSpec]:
    """The on-disk targets of ``tensor`` (called ``name`` once a wrapper prefix is stripped) under ``rules``.

    Raises:
        ConfigError: a stacked tensor cannot be split as its rule says.
    """
    if rules and _filter(rules).match(name) is None:  # no rule applies: one match, not one per rule
        return tensor_specs(tensor, name)
    for rule in rules:
        match = _compiled(rule.pattern).match(name)
        if match is None:
            continue
        if isinstance(rule, Rename):
            return tensor_specs(tensor, match.expand(rule.replacement))
        return _unstack(tensor, match.group(1), rule)
    return tensor_specs(tensor, name)


#: a rule's pattern, compiled once (re.match looks it up in re's own cache at every call: 90k names, each rule)
_compiled = functools.cache(re.compile)


def _filter(rules: Rules) -> re.Pattern[str]:
    """:func:`_any_rule` of ``rules``, the last one asked for found by identity (hashing a family's rules, frozen
    dataclasses, takes longer than the match it saves)."""
    global _last_filter
    last = _last_filter  # one tuple, replaced whole: threads planning apart never see half of another's
    if last[0] is rules:
        return last[1]
    pattern = _any_rule(tuple(rules))
    _last_filter = (rules, pattern)
    return pattern


_last_filter: tuple[object, re.Pattern[str]] = (None, re.compile(""))


@functools.cache
def _any_rule(rules: Rules) -> re.Pattern[str]:
    """A pattern that matches a name where some rule's pattern matches it: their alternation, when each pattern
    is plain enough to stand in one (no backreference, conditional or inline flag that the others' groups would
    change); else one that matches every name, so that each rule is tried."""
    patterns = [rule.pattern for rule in rules]
    if not any(re.search(r"\\\d|\(\?P=|\(\?\(|\(\?[aiLmsux]", p) for p in patterns):
        try:
            return re.compile("|".join(f"(?:{p})" for p in patterns))
        except re.error:
            pass
    return re.compile("")


def memory_slices(name: str, shape: Shape, rules: Rules) -> list[Slice]:
    """The way back (split): in-memory tensor ``name`` of ``shape`` as slices of the on-disk tensors
    ``save_pretrained`` writes for it (each :attr:`Slice.source` an on-disk name). It is :func:`cut` run on the
    name and shape with every slice turned around, so the two directions cannot disagree.

    Example:
        >>> from ckpttool.families import mixtral
        >>> [(s.source, s.dst.offsets) for s in memory_slices("m.mlp.experts.down_proj", (2, 8, 4), mixtral.RULES)]
        [('m.block_sparse_moe.experts.0.w2.weight', (0, 0, 0)), ('m.block_sparse_moe.experts.1.w2.weight', (1, 0, 0))]
    """
    tensor = TensorLayout(name, tuple(shape), "", ())
    return [Slice(spec.name, sl.dst, sl.src) for spec in cut(tensor, name, rules) for sl in spec.slices]


def stacks_experts(name: str, rules: Rules) -> bool:
    """Whether in-memory tensor ``name`` holds stacked experts (dim 0 counts them): an :class:`Unstack` cuts it."""
    rule = next((r for r in rules if re.match(r.pattern, name)), None)
    return isinstance(rule, Unstack)


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
