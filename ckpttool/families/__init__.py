"""Families: what the tensors of a model family are called, and how they are fused, stacked and cut.

One adapter object per model family (:class:`~.adapter.FamilyAdapter`: its declarative rules, :mod:`.rules`'
renames and stacked experts as name templates, its tensor-parallel placements, its cuts per convention, its
training-args checks) and one per *source convention* (:class:`~.adapter.Convention`: Megatron-Core's fused QKV with
grouped-query heads, SwiGLU ``[gate; up]``, stacked layers and experts; DeepSpeed MoE's wrappers; transformers' own
names), all registered in :mod:`.registry`. A convention is recognised from the layout (its format name, one signal,
and its tensor names), a family by the model type transformers resolves from the config. This layer sits above the
readers and never imports them; readers never import it: they describe bytes and boxes, the families give them names.

Entry points: :func:`map_to_hf` (a layout under on-disk HuggingFace names, unchecked, with the adapter used),
:func:`map_from_hf` (the way back, for split: every in-memory tensor as slices of the on-disk ones),
:func:`compare_with_model` (those names and shapes against transformers'), :func:`mtp_absent` and
:func:`mtp_missing_note` (declared MTP layers a source does not hold, :mod:`.mtp`), :func:`keeps_dtype` (targets a
cast leaves alone), :func:`convention_of` (whose names a format holds) and :func:`refusal` (the error a merge raises
for what does not fit). Commands reach them through
:mod:`ckpttool.families.source` (and :mod:`ckpttool.commands.source`, which reads, telling the readers
:data:`READER_TABLES`: what the conventions know that a format does not record).
Adding a family is one adapter module here and one line in :data:`.registry.ADAPTERS`
(``docs/adding-a-family.md``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ckpttool.model.description import ModelInfo
from ckpttool.plan.diagnose import refusal_advice
from ckpttool.layout.layout import Layout, Shape
from ckpttool.plan.tiling import Slice
from ckpttool.plan.plan import TargetSpec
from ckpttool.plan.transforms import Transform
from ckpttool.errors import ConfigError
from ckpttool.families.adapter import Convention, FamilyAdapter
from ckpttool.families.conventions import hf
from ckpttool.families.registry import ADAPTERS, CONVENTIONS, adapter_for, convention_for, convention_of, known_family
from ckpttool.families.registry import READER_TABLES, recognised, reduced_layers, unrecognised
from ckpttool.families.check import Mismatch, compare_with_model
from ckpttool.families.mtp import absent as mtp_absent
from ckpttool.families.mtp import missing_note as mtp_missing_note
from ckpttool.families.rules import keeps_dtype, memory_slices, stacks_experts

__all__ = [
    "ADAPTERS", "CONVENTIONS", "READER_TABLES", "Convention", "FamilyAdapter", "HfMapping", "MemoryTensor", "Mismatch", "adapter_for",
    "compare_with_model", "convention_for", "convention_of", "keeps_dtype", "map_from_hf", "map_to_hf", "mtp_absent",
    "mtp_missing_note", "recognised", "reduced_layers", "refusal", "tied_on_disk", "unrecognised",
]


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


def tied_on_disk(info: ModelInfo) -> dict[str, str]:
    """``info``'s tied tensors (:attr:`ModelInfo.tied`, in-memory names) under the on-disk names the family's rules
    give them, each with its partner's on-disk name, and under their in-memory names too (the two are one name for
    most families). Gemma 3 with vision: ``language_model.lm_head.weight`` (and ``lm_head.weight``) ->
    ``language_model.model.embed_tokens.weight``; save_pretrained writes neither head."""
    rules = adapter_for(info).rules
    shapes = info.memory_shapes

    def on_disk(name: str) -> str:  # a tied tensor is renamed, never cut: its one slice names it
        slices = memory_slices(name, shapes[name], rules) if name in shapes else []
        return slices[0].source if slices else name

    tied = {name: on_disk(partner) for name, partner in info.tied.items()}
    tied.update({on_disk(name): on_disk(partner) for name, partner in info.tied.items()})
    return tied


def map_to_hf(layout: Layout, info: ModelInfo) -> HfMapping:
    """The layout's tensors under on-disk HuggingFace names: cut by the convention that recognises the layout
    (:func:`~.registry.convention_for`, e.g. Megatron-Core's fused QKV) for the family adapter that serves ``info``
    (:func:`~.registry.adapter_for`); a layout no convention recognises is cut as transformers' names are (its names
    then show up as mismatches, and a refusal says no convention recognised them)."""
    convention = convention_for(layout, info) or hf.CONVENTION
    family = adapter_for(info)
    specs, notes, problems = convention.to_hf(layout, info, family)
    adapter = convention.describe(info, family, known_family(info))
    tied_names = tied_on_disk(info)
    tied = [s for s in specs if s.name in tied_names]
    return HfMapping([s for s in specs if s.name not in tied_names], tied, notes, problems, adapter)


@dataclass(frozen=True, slots=True)
class MemoryTensor:
    """A tensor of the model's in-memory state dict (what FSDP, DTensor TP and DCP hold) and the on-disk
    HuggingFace tensors it is made of: each :attr:`Slice.source` is an on-disk name (a tied tensor names the
    one it shares, e.g. ``lm_head.weight`` is ``model.embed_tokens.weight``). ``stacked``: experts stacked on
    dim 0 (an ``Unstack`` rule of the family cuts it per expert, or the family declares it stacked on disk too:
    :attr:`FamilyAdapter.stacked_experts`). ``transform``: the tensor is that transform
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
    adapter = adapter_for(info)
    rules = adapter.rules
    tied = tied_on_disk(info)
    tensors = []
    for name, shape in info.memory_shapes.items():
        slices = [replace(sl, source=tied.get(sl.source, sl.source)) for sl in memory_slices(name, shape, rules)]
        stacked = stacks_experts(name, rules) or any(re.search(p, name) for p in adapter.stacked_experts)
        tensors.append(MemoryTensor(name, tuple(shape), tuple(slices), stacked))
    return tensors


def refusal(layout: Layout, info: ModelInfo, problems: list[str], mismatches: list[Mismatch]) -> ConfigError:
    """The error for a checkpoint that does not fit its config: every problem (tensors the adapter cannot
    place, then mismatches against transformers), listed, with the likely cause; when no convention recognises the
    layout's names, what each looks for (:func:`~.registry.unrecognised`)."""
    problems = [*problems, *(m.message() for m in mismatches)]
    if convention_for(layout, info) is None:
        return ConfigError(unrecognised(layout, info))
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
