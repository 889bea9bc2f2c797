"""A merge plan with adapters: each LoRA module's delta attached to the target it changes, checked before any
byte is read (the module is in the base, its weight has the shape A and B make, and can be fused as PEFT fuses it).

The targets are the output's HuggingFace names, whatever the source's convention: a source that stores Q, K and
V fused (Megatron-Core's ``linear_qkv``) or gate and up fused gives its ``q_proj`` / ``gate_proj`` targets as
slices of those, and the delta is added to the target's rows after they are gathered, so fused sources need
nothing more. An adapter trained on a fused module of the HF model itself (Phi-3's ``qkv_proj``) names that
target and is fused into it the same way.

PEFT names a module as transformers holds it in memory; the output holds the names ``save_pretrained`` writes.
Where a family renames one (Mixtral's router ``mlp.gate`` is saved as ``block_sparse_moe.gate``), its
:class:`~ckpttool.families.rules.Rename` rules map the adapter's name to the output's.

LoRA on a stacked expert parameter (``mlp.experts.gate_up_proj`` ``(E, 2I, H)``, saved per expert as ``w1`` and
``w3``) goes to every expert's tensors by the family's :class:`~ckpttool.families.rules.Unstack` rule: expert ``e``'s
part ``i`` takes rows ``i*n ..`` of that expert's delta. PEFT's keys do not say which parameter a pair is, so the
one parameter whose per-expert tensors have the shapes A and B make is it (gate_up: A ``(r*E, H)``, B
``(2I, r*E)``; down: A ``(r*E, I)``, B ``(H, r*E)``: never both).

A stacked expert parameter that stays stacked on disk (gpt-oss's ``mlp.experts.gate_up_proj`` ``(E, H, 2I)`` and
``down_proj`` ``(E, I, H)``, no :class:`~ckpttool.families.rules.Unstack` rule) takes the delta whole, expert by
expert (:attr:`~ckpttool.plan.lora.LoraDelta.stacked`). Its orientation is the family's (transformers'
``is_transposed`` experts, stored ``(E, in, out)``, which PEFT does not swap; ``(E, out, in)`` otherwise), given as
``transposed``, the family's :attr:`~ckpttool.families.adapter.FamilyAdapter.transposed_experts`: gpt-oss's
``down_proj`` is square in the release (2880 x 2880), so the shapes cannot tell.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Sequence
from dataclasses import replace
from typing import TYPE_CHECKING

from ckpttool.errors import SourceError
from ckpttool.families.rules import Rename, Rules, Unstack
from ckpttool.io.dtypes import FLOAT_DTYPES
from ckpttool.lora.adapter import Adapter
from ckpttool.plan.lora import LoraDelta
from ckpttool.plan.plan import Plan, Target

if TYPE_CHECKING:
    from ckpttool.families.adapter import FamilyAdapter


def attach_adapters(plan: Plan, adapters: Sequence[Adapter], rules: Rules = (),
                    transposed: Sequence[str] = ()) -> Plan:
    """``plan`` with every adapter's deltas on the targets they change (in the order given), and a note per adapter.
    ``rules``: the family's in-memory to on-disk names (:attr:`~ckpttool.families.adapter.FamilyAdapter.rules`);
    ``transposed``: its patterns of experts stacked on disk as ``(E, in, out)``
    (:attr:`~ckpttool.families.adapter.FamilyAdapter.transposed_experts`).

    Raises:
        SourceError: a module the adapter changes is not in the base, its weight's shape is not what A and B make,
            or it is a tensor ckpttool does not fuse into (a quantized weight); every problem is listed, naming the
            adapter's weights file and its tensors.
    """
    if not adapters:
        return plan
    targets = {t.name: t for t in plan.targets}
    added: dict[str, list] = {}
    problems: list[str] = []
    notes: list[str] = []
    for adapter in adapters:
        fused = 0
        for module, delta in adapter.deltas.items():
            if delta.parameters:
                placed = (stacked_target(delta, targets, rules, transposed)
                          or unstacked(delta, targets, rules, transposed))
                if isinstance(placed, str):
                    problems.append(placed)
                    continue
                for name, one in placed:
                    if targets[name].dequant is not None or targets[name].source_dtype not in FLOAT_DTYPES:
                        problems.append(_not_float(delta, targets[name]))
                        break
                    added.setdefault(name, []).append(one)
                else:
                    fused += len(placed)
                continue
            name = disk_name(f"{module}.weight", rules)
            target = targets.get(name)
            if target is None:
                near = difflib.get_close_matches(name, list(targets), n=1)
                problems.append(f"'{delta.a.key}': the adapter changes '{module}', but the base has no '{name}'"
                                + (f" (the nearest is '{near[0]}')" if near else ""))
                continue
            out, rows = delta.b.shape[0], delta.a.shape[1]
            expected = (rows, out) if delta.fan_in_fan_out else (out, rows)
            if target.shape != expected:
                problems.append(f"'{delta.a.key}' {list(delta.a.shape)} and '{delta.b.key}' {list(delta.b.shape)} "
                                f"make a delta of {list(expected)}, but the base's '{name}' is {list(target.shape)}"
                                + (" (fan_in_fan_out)" if delta.fan_in_fan_out else ""))
                continue
            if target.dequant is not None or target.source_dtype not in FLOAT_DTYPES:
                problems.append(_not_float(delta, target))
                continue
            added.setdefault(name, []).append(delta)
            fused += 1
        ranks = sorted({d.rank for d in adapter.deltas.values()})
        scalings = sorted({d.scaling for d in adapter.deltas.values()})
        notes.append(f"LoRA adapter '{adapter.root}' fused into {fused} tensors (rank {'/'.join(map(str, ranks))}, "
                     f"scaling {'/'.join(f'{s:g}' for s in scalings)})")
    if problems:
        first = adapters[0].weights if len(adapters) == 1 else "the adapters"
        raise SourceError(f"'{first}': {len(problems)} LoRA module{'s' if len(problems) > 1 else ''} cannot be fused "
                          "into the base:\n" + "\n".join(f"  - {p}" for p in problems))
    fused_targets = tuple(_fused(t, added[t.name]) if t.name in added else t for t in plan.targets)
    return replace(plan, targets=fused_targets, notes=(*plan.notes, *notes))


def attach_to_family(plan: Plan, adapters: Sequence[Adapter], family: FamilyAdapter | None) -> Plan:
    """:func:`attach_adapters` with ``family``'s rules and transposed experts (none for a generic plan: None).

    Raises:
        SourceError: as :func:`attach_adapters`.
    """
    if family is None:
        return attach_adapters(plan, adapters)
    return attach_adapters(plan, adapters, family.rules, family.transposed_experts)


def disk_name(name: str, rules: Rules) -> str:
    """The name ``save_pretrained`` writes for in-memory weight ``name``: the first matching rename applied."""
    for rule in rules:
        if isinstance(rule, Rename) and re.match(rule.pattern, name):
            return re.sub(rule.pattern, rule.replacement, name)
    return name


def stacked_target(delta: LoraDelta, targets: dict[str, Target], rules: Rules,
                   transposed: Sequence[str]) -> list[tuple[str, LoraDelta]] | None:
    """Where a stacked expert parameter's ``delta`` goes when the parameter stays stacked on disk: the one of
    ``delta.parameters`` that is a target of shape ``(E, in, out)`` (a name ``transposed`` matches) or
    ``(E, out, in)`` (else), as A and B make; None when none is."""
    out, cols, experts = delta.b.shape[0], delta.a.shape[1], delta.experts
    for parameter in delta.parameters:
        target = targets.get(disk_name(parameter, rules))
        flipped = any(re.search(p, parameter) for p in transposed)
        if target is not None and target.shape == ((experts, cols, out) if flipped else (experts, out, cols)):
            return [(target.name, replace(delta, stacked="e i o" if flipped else "e o i"))]
    return None


def unstacked(delta: LoraDelta, targets: dict[str, Target], rules: Rules,
              transposed: Sequence[str] = ()) -> list[tuple[str, LoraDelta]] | str:
    """Where a stacked expert parameter's ``delta`` goes: per expert and part, the target's name and the delta
    of its rows (:attr:`~ckpttool.plan.lora.LoraDelta.expert`, ``row_offset``), for the one parameter of
    ``delta.parameters`` whose per-expert targets (by ``rules``' :class:`Unstack`) have the shapes A and B make;
    or, when none has, what is wrong (a line naming the adapter's tensors and what the base holds)."""
    out, cols, experts = delta.b.shape[0], delta.a.shape[1], delta.experts
    seen = []
    for parameter in delta.parameters:
        rule = next((r for r in rules if isinstance(r, Unstack) and re.match(r.pattern, parameter)), None)
        if rule is None:
            held = targets.get(disk_name(parameter, rules))
            if held is None:
                seen.append(f"no rule of the family saves '{parameter}' per expert")
            else:  # stacked on disk, but not as A and B make it (stacked_target did not take it)
                flipped = any(re.search(p, parameter) for p in transposed)
                seen.append(f"the base holds '{held.name}' stacked, {list(held.shape)}, where they make "
                            f"{[experts, cols, out] if flipped else [experts, out, cols]} "
                            f"({'(E, in, out)' if flipped else '(E, out, in)'}, as the family stores it)")
            continue
        prefix = re.match(rule.pattern, parameter).group(1)  # type: ignore[union-attr]
        names = [[n.format(prefix=prefix, expert=e) for n in rule.names] for e in range(experts + 1)]
        parts = len(rule.names)
        shape = (out // parts, cols)
        first = targets.get(names[0][0])
        fits = (out % parts == 0 and names[experts][0] not in targets
                and all(targets.get(n) is not None and targets[n].shape == shape for e in names[:experts] for n in e))
        if fits:
            return [(name, replace(delta, expert=e, row_offset=i * shape[0]))
                    for e in range(experts) for i, name in enumerate(names[e])]
        seen.append(f"'{parameter}' is saved as {parts * experts} tensors like '{names[0][0]}' "
                    f"({list(first.shape) if first is not None else 'not in the base'})"
                    + ("" if names[experts][0] not in targets else f" for more than {experts} experts"))
    return (f"'{delta.a.key}' {list(delta.a.shape)} and '{delta.b.key}' {list(delta.b.shape)} ({experts} experts of "
            f"rank {delta.rank}) fit none of the stacked parameters they may be on: {'; '.join(seen)}")


def _not_float(delta: LoraDelta, target: Target) -> str:
    return (f"'{delta.a.key}': the base's '{target.name}' is stored {target.source_dtype}"
            f"{' and quantized' if target.dequant is not None else ''}; ckpttool fuses LoRA into "
            "floating-point weights only (PEFT's merge into a quantized base differs)")


def _fused(target: Target, deltas: list) -> Target:
    return replace(target, lora=(*target.lora, *deltas))
