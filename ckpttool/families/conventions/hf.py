"""The HuggingFace convention: transformers' own names, in memory (DCP, FSDP, DTensor TP, transformers' distributed
saves) or on disk (``save_pretrained``). In-memory tensors are cut by the family adapter's rules
(:attr:`~ckpttool.families.adapter.FamilyAdapter.rules`: renames, stacked experts cut per expert), on-disk names pass
through, and a wrapper prefix a training loop put before every name (``model.``/``module.``) is stripped.

It takes every layout no other convention recognises (it is last in the registry), so what it does with names
it does not know is left to the check against transformers: each becomes an "unexpected" mismatch.
"""

from __future__ import annotations

from collections.abc import Collection

from ckpttool.errors import ConfigError
from ckpttool.families.adapter import Convention, CutResult, FamilyAdapter
from ckpttool.families.rules import cut
from ckpttool.layout.layout import Layout
from ckpttool.model.description import ModelInfo
from ckpttool.plan.plan import TargetSpec

NAME = "HuggingFace"


class HfConvention(Convention):
    """transformers' in-memory and on-disk names (see the module docstring)."""

    name = NAME
    hf_names = True
    looks_for = "the model's in-memory or on-disk HuggingFace names (with a config)"

    def holds_names(self, names: Collection[str], info: ModelInfo | None) -> bool:
        """With a model: some name, a wrapper prefix aside, is one of its in-memory or on-disk names. Without one:
        any names (nothing tells them from another convention's but the other conventions' own signals)."""
        if info is None:
            return True
        known = set(info.memory_shapes) | set(info.disk_shapes)
        prefix = wrapper_prefix(names, info)
        return any(name[len(prefix):] in known for name in names)

    def cut(self, layout: Layout, info: ModelInfo, family: FamilyAdapter) -> CutResult:
        notes: list[str] = []
        prefix = wrapper_prefix(layout.tensors, info)
        if prefix:
            notes.append(f"stripped the prefix '{prefix}' the training loop put before every tensor name")
        specs: list[TargetSpec] = []
        problems: list[tuple[str, str]] = []
        for tensor in layout.tensors.values():
            try:
                specs.extend(cut(tensor, tensor.fqn[len(prefix):], family.rules))
            except ConfigError as e:
                problems.append((tensor.fqn, str(e)))
        return specs, notes, problems

    def describe(self, info: ModelInfo, family: FamilyAdapter, known: bool) -> str:
        name = family.name
        rules = "its rules" if known else "names as transformers saves them"
        return f"{name} ({rules})" if name == info.model_type else f"{info.model_type} as {name} ({rules})"


def wrapper_prefix(names: Collection[str], info: ModelInfo) -> str:
    """'' normally; 'model.' when a loop saved ``{"model": state_dict}`` and every name carries it."""
    known = set(info.memory_shapes) | set(info.disk_shapes)
    names = list(names)
    if not names or any(n in known for n in names):
        return ""
    for prefix in ("model.", "module."):
        if all(n.startswith(prefix) for n in names) and any(n[len(prefix):] in known for n in names):
            return prefix
    return ""


CONVENTION = HfConvention()
