"""Families: what the tensors of a model family are called, and how they are fused, stacked and cut.

One small adapter per model family, declarative where it can be (:mod:`.rules`: renames and stacked experts cut
per expert, as name templates), and one per *source convention* that names tensors its own way
(:mod:`.megatron_core`: fused QKV with grouped-query heads, SwiGLU ``[gate; up]``, stacked layers and experts).
A convention is chosen by the layout's format name (data the reader records), a family by the model type
transformers resolves from the config. This layer sits above the readers and never imports them; readers never
import it: they describe bytes and boxes, the families give them names.

Entry points: :func:`map_to_hf` (a layout under on-disk HuggingFace names, unchecked, with the adapter used),
:func:`map_from_hf` (the way back, for split: every in-memory tensor as slices of the on-disk ones),
:func:`compare_with_model` (those names and shapes against transformers'), :func:`mtp_absent` and
:func:`mtp_missing_note` (declared MTP layers a source does not hold, :mod:`.mtp`), :func:`keeps_dtype` (targets a
cast leaves alone), :func:`convention_of` (whose names a format holds) and :func:`refusal` (the error a merge raises
for what does not fit). Commands reach them through
:mod:`ckpttool.plan.source`.
Adding a family is one adapter module here and one line in :data:`FAMILIES`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ckpttool.model.architecture import ModelInfo
from ckpttool.plan.diagnose import refusal_advice
from ckpttool.layout.layout import Layout, Shape
from ckpttool.plan.plan import Slice, TargetSpec
from ckpttool.plan.transforms import Transform
from ckpttool.errors import ConfigError
from ckpttool.families.conventions import deepspeed_moe
from ckpttool.families.conventions import megatron_core
from ckpttool.families import mixtral
from ckpttool.families import qwen2_moe
from ckpttool.families.check import Mismatch, compare_with_model
from ckpttool.families.mtp import absent as mtp_absent
from ckpttool.families.mtp import missing_note as mtp_missing_note
from ckpttool.families.rules import Rules, cut, keeps_dtype, memory_slices, stacks_experts

__all__ = [
    "CONVENTIONS", "FAMILIES", "HfMapping", "MemoryTensor", "Mismatch", "compare_with_model", "convention_of",
    "keeps_dtype", "map_from_hf", "map_to_hf", "mtp_absent",
    "mtp_missing_note", "refusal",
]

#: model family (as :attr:`ModelInfo.family` resolves it) -> how its in-memory tensors are saved on disk
FAMILIES: dict[str, Rules] = {mixtral.NAME: mixtral.RULES, qwen2_moe.NAME: qwen2_moe.RULES}

Cut = Callable[[Layout, ModelInfo], tuple[list[TargetSpec], list[str], list[tuple[str, str]]]]
#: layout format -> the source convention (its name, its cut) that names its tensors; formats not named hold
#: transformers' in-memory or on-disk names, cut by the family's rules
CONVENTIONS: dict[str, tuple[str, Cut]] = dict.fromkeys(megatron_core.FORMATS, (megatron_core.NAME, megatron_core.to_hf))
CONVENTIONS.update(dict.fromkeys(deepspeed_moe.FORMATS, (deepspeed_moe.NAME, deepspeed_moe.to_hf)))


def convention_of(layout_format: str) -> str | None:
    """The name of the source convention a format's tensors are named in (``"Megatron-Core"``), or None for a
    format holding transformers' own names. Without an architecture to cut them, a convention's names are not
    HuggingFace's: transformers loads none of them (a merge refuses them unless asked for raw names)."""
    convention = CONVENTIONS.get(layout_format)
    return convention[0] if convention is not None else None


@dataclass(frozen=True, slots=True)
class HfMapping:
    """A layout's tensors under the on-disk HuggingFace names of ``info``'s architecture, not yet checked.

    Attributes:
        specs: the targets, tied weights excluded.
        tied: targets ``save_pretrained`` would drop because they are tied (e.g. ``lm_head.weight``).
        notes: what was done for the user (a stripped wrapper prefix).
        problems: ``(source tensor, message)`` for tensors the family's rules cannot cut.
        adapter: the adapter used, in words (``"qwen2_moe (Megatron-Core convention)"``), for dry runs and audits.
    """

    specs: list[TargetSpec]
    tied: list[TargetSpec]
    notes: list[str]
    problems: list[tuple[str, str]]
    adapter: str


def map_to_hf(layout: Layout, info: ModelInfo) -> HfMapping:
    """The layout's tensors under on-disk HuggingFace names: cut by the source convention of its format when it
    has one (:data:`CONVENTIONS`, e.g. Megatron-Core's fused QKV); else in-memory names (DCP, FSDP, transformers
    distributed) cut by the family's rules (:data:`FAMILIES`), on-disk names passed through, and a wrapper
    prefix (``model.``/``module.``) stripped."""
    convention = CONVENTIONS.get(layout.format)
    family = info.family if info.family in FAMILIES else info.model_type
    if convention is not None:
        specs, notes, problems = convention[1](layout, info)
        adapter = f"{info.model_type} ({convention[0]} convention)"
    else:
        specs, notes, problems = _generic_cut(layout, info)
        rules = "its rules" if family in FAMILIES else "names as transformers saves them"
        adapter = f"{family} ({rules})" if family == info.model_type else f"{info.model_type} as {family} ({rules})"
    tied = [s for s in specs if s.name in info.tied]
    return HfMapping([s for s in specs if s.name not in info.tied], tied, notes, problems, adapter)


@dataclass(frozen=True, slots=True)
class MemoryTensor:
    """A tensor of the model's in-memory state dict (what FSDP, DTensor TP and DCP hold) and the on-disk
    HuggingFace tensors it is made of: each :attr:`Slice.source` is an on-disk name (a tied tensor names the
    one it shares, e.g. ``lm_head.weight`` is ``model.embed_tokens.weight``). ``stacked``: experts stacked on
    dim 0 (an ``Unstack`` rule of the family cuts it per expert). ``transform``: the tensor is that transform
    (:mod:`ckpttool.plan.transforms`) of what its slices make (e.g. HF's RoPE halves back to Meta's pairs)."""

    name: str
    shape: Shape
    slices: tuple[Slice, ...]
    stacked: bool = False
    transform: Transform | None = None


def map_from_hf(info: ModelInfo) -> list[MemoryTensor]:
    """Every tensor of ``info``'s in-memory state dict, in its order, as slices of the on-disk tensors: the
    family's rules run backwards (:func:`.rules.memory_slices`), not a second table.

    Raises:
        ConfigError: a stacked tensor the family's rules cannot cut (its shape does not split into the parts).
    """
    rules = FAMILIES.get(info.family or "", ())
    tensors = []
    for name, shape in info.memory_shapes.items():
        slices = [replace(sl, source=info.tied.get(sl.source, sl.source)) for sl in memory_slices(name, shape, rules)]
        tensors.append(MemoryTensor(name, tuple(shape), tuple(slices), stacks_experts(name, rules)))
    return tensors


def _generic_cut(layout: Layout, info: ModelInfo) -> tuple[list[TargetSpec], list[str], list[tuple[str, str]]]:
    notes: list[str] = []
    prefix = _wrapper_prefix(layout, info)
    if prefix:
        notes.append(f"stripped the prefix '{prefix}' the training loop put before every tensor name")
    rules = FAMILIES.get(info.family or "", ())
    specs: list[TargetSpec] = []
    problems: list[tuple[str, str]] = []
    for tensor in layout.tensors.values():
        try:
            specs.extend(cut(tensor, tensor.fqn[len(prefix):], rules))
        except ConfigError as e:
            problems.append((tensor.fqn, str(e)))
    return specs, notes, problems


def refusal(layout: Layout, info: ModelInfo, problems: list[str], mismatches: list[Mismatch]) -> ConfigError:
    """The error for a checkpoint that does not fit its config: every problem (tensors the adapter cannot
    place, then mismatches against transformers), listed, with the likely cause."""
    problems = [*problems, *(m.message() for m in mismatches)]
    padded = any(m.diagnosis is not None and m.diagnosis.code.startswith("vocab-padding") for m in mismatches)
    return ConfigError(
        f"the checkpoint in '{layout.root}' does not match its {info.model_type} config "
        f"({len(problems)} problem{'s' if len(problems) != 1 else ''}):\n"
        + "\n".join(f"  - {p}" for p in problems[:40])
        + (f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else "")
        + "\n" + refusal_advice(m.diagnosis.code for m in mismatches if m.diagnosis is not None)
        + (" ckpttool strips padding the source recorded (sidecar 'padding') and never guesses it."
           if padded else "")
    )


def _wrapper_prefix(layout: Layout, info: ModelInfo) -> str:
    """'' normally; 'model.' when a loop saved ``{"model": state_dict}`` and every name carries it."""
    known = set(info.memory_shapes) | set(info.disk_shapes)
    names = list(layout.tensors)
    if not names or any(n in known for n in names):
        return ""
    for prefix in ("model.", "module."):
        if all(n.startswith(prefix) for n in names) and any(n[len(prefix):] in known for n in names):
            return prefix
    return ""
