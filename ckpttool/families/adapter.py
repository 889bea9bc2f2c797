"""The two kinds of adapter the families layer is made of: a :class:`Convention` (how a training framework names,
fuses and stacks a model's tensors) and a :class:`FamilyAdapter` (what one model family's tensors are called and how
they are cut, per convention). Both are registered in one place, :mod:`.registry`; callers ask the registry, never a
convention module or a family module by name.

How they meet: a layout is *recognised* by one convention (:meth:`Convention.recognises`: its format name, one
signal, or its tensor names), the model's family adapter is found from the config (:meth:`FamilyAdapter.serves`),
and the convention cuts the layout into HuggingFace targets with what the family says
(:meth:`Convention.to_hf`): the family's own cut for that convention when it has one (:attr:`FamilyAdapter.cuts`),
else the convention's cut, which reads the family's declarative parts (its :attr:`FamilyAdapter.rules`).

The declarative parts stay data: renames and stacked experts are :mod:`.rules`' ``Rename``/``Unstack``,
tensor-parallel placements are ``(regex, Placement)`` tables, a convention's own tables sit in its module. An
adapter only groups them and answers for them.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from typing import Any

from ckpttool.families.rules import Rules
from ckpttool.layout.layout import Layout
from ckpttool.layout.placements import Placement
from ckpttool.model.description import ModelInfo
from ckpttool.plan.plan import TargetSpec

#: what a cut into HuggingFace names gives: the targets, notes for the user, and ``(source tensor, message)`` for
#: every tensor it cannot place
CutResult = tuple[list[TargetSpec], list[str], list[tuple[str, str]]]
#: a cut of a layout into the on-disk HuggingFace tensors of a model
Cut = Callable[[Layout, ModelInfo], CutResult]
#: a training-args check: ``(args, info) -> problems`` (each a line of the refusal; none: the args fit)
ArgsCheck = Callable[[Any, ModelInfo], list[str]]
#: tensor name (regex, searched) -> its tensor-parallel placement; the first match applies
PlacementRules = tuple[tuple[str, Placement], ...]

SHARD0, SHARD1, REPLICATE = Placement("shard", 0), Placement("shard", 1), Placement("replicate")

#: the tensor-parallel placements of transformers' in-memory names, as torch's and transformers' Llama/Mixtral plans
#: place them (``split --to dcp``): ``ColwiseParallel`` q/k/v/gate/up ``Shard(0)`` (their biases too),
#: ``RowwiseParallel`` o/down ``Shard(1)`` (their biases replicated), embeddings and ``lm_head`` ``Shard(0)`` (the
#: vocab), norms, routers and experts replicated (``ep`` shards experts; where transformers' own plan cuts stacked experts,
#: :mod:`ckpttool.families.expert_tp` places them before these rules); a vision-language model's vision tower and
#: projector replicated (transformers' plans cut only the language model, Llama 4's aside), so a VLM no adapter serves
#: (Qwen3-VL, dense and MoE) splits its language model as a Llama's
HF_TP_RULES: PlacementRules = (
    (r"^model\.(visual|vision_tower|multi_modal_projector)\.", REPLICATE),  # first: a tower's q_proj is not cut
    (r"(^|\.)embed_tokens\.weight$", SHARD0),  # RowwiseParallel on an nn.Embedding: vocab rows
    (r"(^|\.)lm_head\.weight$", SHARD0),  # ColwiseParallel: vocab rows
    (r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.(weight|bias)$", SHARD0),  # ColwiseParallel
    (r"\.(o_proj|down_proj)\.weight$", SHARD1),  # RowwiseParallel
    (r"\.(o_proj|down_proj)\.bias$", REPLICATE),
    (r"norm\.weight$", REPLICATE),
    (r"\.mlp\.gate\.(weight|e_score_correction_bias)$", REPLICATE),  # MoE router
    (r"\.mlp\.experts\.", REPLICATE),  # stacked experts: not tensor-parallel, ep shards them
    (r"\.shared_expert_gate\.weight$", REPLICATE),
)


def placement_of(name: str, rules: PlacementRules) -> Placement | None:
    """The placement the first rule whose pattern is found in ``name`` gives, or None when no rule knows it."""
    return next((p for pattern, p in rules if re.search(pattern, name)), None)


@dataclass(frozen=True, slots=True)
class FamilyAdapter:
    """One model family: what its tensors are called and how they are cut, for every source convention.

    A new family adapter is one module in ``ckpttool/families/`` defining ``ADAPTER = FamilyAdapter(...)`` and one
    line in :data:`ckpttool.families.registry.ADAPTERS`. It must define:

    - ``name``: the family as :attr:`ModelInfo.family` resolves it (transformers' conversion alias, else the
      model type, e.g. ``"mixtral"``, ``"qwen2_moe"``), the name it is looked up by;

    and may define, each defaulting to "as transformers names a Llama":

    - ``model_types``: more model types it serves when the config's family is not ``name``;
    - ``rules``: the HuggingFace in-memory convention: :class:`~.rules.Rename` / :class:`~.rules.Unstack` from
      transformers' in-memory names (DCP, FSDP, DTensor TP) to the on-disk ones ``save_pretrained`` writes; run
      forwards by merge and backwards by split (:func:`~.rules.memory_slices`), so the directions cannot disagree;
    - ``tp_rules``: tensor-parallel placements of the in-memory names (``split --to dcp``), first match applies;
    - ``stacked_experts``: patterns of in-memory names that hold experts stacked on dim 0 with no
      :class:`~.rules.Unstack` (stacked on disk too, e.g. gpt-oss's ``mlp.experts.gate_up_proj``): ``split --ep``
      shards their dim 0 over the expert-parallel ranks;
    - ``transposed_experts``: those of them stored ``(E, in, out)`` (transformers' ``is_transposed`` experts), whose
      PEFT LoRA delta is ``einsum(... -> "e i o")`` (:mod:`ckpttool.lora.attach`); ``(E, out, in)`` otherwise;
    - ``cuts``: ``(convention name, cut)`` for a convention whose generic cut does not fit this family (e.g. a
      Megatron-Core cut of its own); the convention's cut is used otherwise;
    - ``args_checks``: checks of a source's training args against the config, each returning problem lines (run
      by the conventions that record args, e.g. Megatron's, before anything is planned);
    - ``carried``: patterns (searched) of on-disk names a release holds beside the model that transformers' class
      ignores on load (its ``_keys_to_ignore_on_load_unexpected``, e.g. Qwen3-Next's MTP module ``^mtp\\.``):
      carried to the output as they are, unchecked, with a note, instead of refused as unexpected.

    Example:
        >>> from ckpttool.families.rules import Rename
        >>> FamilyAdapter("toy", rules=(Rename(r"^(.*)\\.mlp\\.gate\\.weight$", r"\\1.moe.router.weight"),)).name
        'toy'
    """

    name: str
    model_types: tuple[str, ...] = ()
    rules: Rules = ()
    tp_rules: PlacementRules = HF_TP_RULES
    stacked_experts: tuple[str, ...] = ()
    transposed_experts: tuple[str, ...] = ()
    cuts: tuple[tuple[str, Cut], ...] = ()
    args_checks: tuple[ArgsCheck, ...] = ()
    carried: tuple[str, ...] = ()

    def serves(self, info: ModelInfo) -> bool:
        """Whether this adapter cuts ``info``'s tensors: its family (:attr:`ModelInfo.family`) is :attr:`name`, or
        its model type is one of :attr:`model_types`."""
        return info.family == self.name or info.model_type in self.model_types

    def cut_for(self, convention: str) -> Cut | None:
        """This family's own cut for ``convention`` (a convention's name), or None: the convention's applies."""
        return next((cut for name, cut in self.cuts if name == convention), None)

    def tp_placement(self, name: str) -> Placement | None:
        """The tensor-parallel placement of in-memory tensor ``name``, or None when no rule knows it."""
        return placement_of(name, self.tp_rules)

    def carries(self, name: str) -> bool:
        """Whether on-disk tensor ``name`` is one this family carries unchecked (:attr:`carried`)."""
        return any(re.search(pattern, name) for pattern in self.carried)

    def check_args(self, args: Any, info: ModelInfo) -> list[str]:
        """Every problem of the training ``args`` against ``info``'s config that this family's checks find."""
        return [problem for check in self.args_checks for problem in check(args, info)]


class Convention:
    """A source convention: how a framework names, fuses and stacks a model's tensors, and the cut of a layout in it
    into HuggingFace tensors.

    A new convention is one module in ``ckpttool/families/conventions/`` defining a subclass and ``CONVENTION =
    TheSubclass()``, and one line in :data:`ckpttool.families.registry.CONVENTIONS` (before the HuggingFace one,
    which takes every layout no other convention recognises). A subclass must define:

    - ``name``: the convention in words (``"Megatron-Core"``), shown in dry runs, audits and refusals;
    - ``formats``: the reader format names whose layouts are always in this convention (one signal; may be empty);
    - :meth:`holds_names`: whether a layout's tensor names are this convention's, whatever reader built it;
    - :meth:`cut`: the layout under HuggingFace on-disk names, for a family adapter (its rules or tables);

    and may redefine :attr:`hf_names` (True only for a convention whose names transformers loads as they are),
    :attr:`looks_for` (what :meth:`holds_names` looks for, in words, for the refusal of an unrecognised layout) and
    :meth:`describe`.
    """

    name: str = ""
    formats: tuple[str, ...] = ()
    #: whether transformers loads these names under no architecture (only the HuggingFace convention's)
    hf_names: bool = False
    #: what :meth:`holds_names` looks for, in words
    looks_for: str = ""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r}>"

    def recognises(self, layout: Layout, info: ModelInfo | None = None) -> bool:
        """Whether ``layout`` is in this convention: its reader's format is one of :attr:`formats`, or its tensor
        names are this convention's (:meth:`holds_names`; ``info``, when given, is the model they should fit)."""
        return layout.format in self.formats or self.holds_names(layout.tensors, info)

    def holds_names(self, names: Collection[str], info: ModelInfo | None) -> bool:
        """Whether ``names`` (a layout's tensors) are named in this convention."""
        return False

    def cut(self, layout: Layout, info: ModelInfo, family: FamilyAdapter) -> CutResult:
        """The layout's tensors under on-disk HuggingFace names, cut as ``family`` is in this convention."""
        raise NotImplementedError(f"{type(self).__name__} defines no cut")

    def to_hf(self, layout: Layout, info: ModelInfo, family: FamilyAdapter) -> CutResult:
        """The family's own cut for this convention when it has one (:meth:`FamilyAdapter.cut_for`), else :meth:`cut`."""
        own = family.cut_for(self.name)
        return own(layout, info) if own is not None else self.cut(layout, info, family)

    def describe(self, info: ModelInfo, family: FamilyAdapter, known: bool) -> str:
        """The adapter used, in words, for dry runs and audits (``"qwen2_moe (Megatron-Core convention)"``);
        ``known``: whether a registered family adapter serves ``info``."""
        return f"{info.model_type} ({self.name} convention)"


def by_name(items: Collection[FamilyAdapter]) -> Mapping[str, FamilyAdapter]:
    """Family adapters by :attr:`FamilyAdapter.name`."""
    return {item.name: item for item in items}
