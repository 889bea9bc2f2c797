"""The one place adapters are registered, and the lookups every caller goes through.

:data:`ADAPTERS` lists the model-family adapters (:class:`~.adapter.FamilyAdapter`), :data:`CONVENTIONS` the
source conventions (:class:`~.adapter.Convention`) in the order they are asked whether they recognise a layout; the
HuggingFace convention is last and takes what no other recognises. A new family is one module defining ``ADAPTER``
and one line in :data:`ADAPTERS`; a new convention is one module in ``conventions/`` defining ``CONVENTION`` and one
line in :data:`CONVENTIONS` (see ``docs/adding-a-family.md``). :data:`READER_TABLES` is what the conventions tell
the readers of formats that record no global shapes (the Megatron-Core convention's tensor-parallel table and args
checks), handed to them by the one place that reads a source.
"""

from __future__ import annotations

from ckpttool.errors import ConfigError
from collections.abc import Mapping

from ckpttool.families import (
    deepseek, glm4v, gpt_oss, layers, llama4, llava, mixtral, nemotron_h, qwen2_moe, qwen2_vl, qwen3_5, qwen3_next,
)
from ckpttool.families.adapter import Convention, FamilyAdapter
from ckpttool.families.conventions import deepspeed_moe, hf, megatron_core, megatron_tp, torchtitan
from ckpttool.layout.layout import Layout
from ckpttool.model.description import ModelInfo
from ckpttool.model.reduced import LayerReduction

#: every model family with an adapter of its own; a model type none serves is cut as transformers names it
ADAPTERS: list[FamilyAdapter] = [
    mixtral.ADAPTER,
    qwen3_next.ADAPTER,  # before qwen2_moe, whose experts' rules transformers gives it (its family is qwen2_moe)
    glm4v.ADAPTER,  # before qwen2_moe too: GLM-4V-MoE's family is qwen2_moe, its vision tower is not cut
    qwen2_moe.ADAPTER,
    qwen2_vl.ADAPTER,
    llava.ADAPTER,
    gpt_oss.ADAPTER,
    nemotron_h.ADAPTER,
    qwen3_5.ADAPTER,
    llama4.ADAPTER,
]

#: every source convention, in the order they are asked (:func:`convention_for`); the HuggingFace one last
CONVENTIONS: list[Convention] = [
    megatron_core.CONVENTION,
    deepspeed_moe.CONVENTION,
    torchtitan.CONVENTION,
    hf.CONVENTION,
]


#: every family's layer rule (:mod:`.layers`): a config of these model types is described from one layer of each kind
LAYER_RULES: list[layers.LayerRule] = [
    deepseek.LAYERS,
    qwen2_moe.LAYERS,
    mixtral.LAYERS,
    gpt_oss.LAYERS,
    qwen3_next.LAYERS,
    qwen3_5.LAYERS,
    nemotron_h.LAYERS,
    layers.alike("llama", "mistral", "qwen2", "qwen3"),  # no adapter of their own: all layers alike
]


def reduced_layers(config: Mapping[str, object]) -> LayerReduction | None:
    """``config`` with one decoder layer of each kind, by its model type's rule in :data:`LAYER_RULES`
    (:func:`ckpttool.model.architecture.model_info`'s ``reduce``); None for a model type with no rule, or a
    config its rule does not reduce."""
    rule = next((r for r in LAYER_RULES if config.get("model_type") in r.model_types), None)
    return layers.reduce(rule, config) if rule is not None else None


def adapter_for(info: ModelInfo) -> FamilyAdapter:
    """The family adapter that serves ``info`` (:meth:`~.adapter.FamilyAdapter.serves`), or a plain one named after
    its model type: transformers' names, no rules, the Llama tensor-parallel plan."""
    return next((a for a in ADAPTERS if a.serves(info)), None) or FamilyAdapter(info.model_type)


#: the Megatron-Core convention's table for the Megatron readers, running each family adapter's args checks
MEGATRON_TP = megatron_tp.MegatronTP(family_of=adapter_for)

#: reader format name -> what its source convention tells it (``ckpttool.readers.read_layout``'s ``tables``)
READER_TABLES: dict[str, object] = dict.fromkeys(megatron_core.FORMATS, MEGATRON_TP)


def known_family(info: ModelInfo) -> bool:
    """Whether a registered adapter is named after ``info``'s family or model type (said in the adapter's words)."""
    return any(a.name in (info.family, info.model_type) for a in ADAPTERS)


def convention_for(layout: Layout, info: ModelInfo | None = None) -> Convention | None:
    """The convention ``layout`` is in: the one its reader's format names first (behaviour as before formats were
    one signal among others), else the first whose names it holds (``info``: the model they should fit); None when
    none recognises it (with ``info``: no name is one the model, or any convention, knows)."""
    by_format = next((c for c in CONVENTIONS if layout.format in c.formats), None)
    if by_format is not None:
        return by_format
    return next((c for c in CONVENTIONS if c.holds_names(layout.tensors, info)), None)


def convention_of(layout: Layout) -> str | None:
    """The name of the source convention ``layout``'s tensors are named in (``"Megatron-Core"``), or None for
    transformers' own names. Without an architecture to cut them, a convention's names are not HuggingFace's:
    transformers loads none of them (a merge refuses them unless asked for raw names)."""
    convention = convention_for(layout)
    return None if convention is None or convention.hf_names else convention.name


def unrecognised(layout: Layout, info: ModelInfo | None = None) -> str:
    """Why no convention recognises ``layout``: some of its names, and what each convention looks for."""
    names = list(layout.tensors)
    shown = ", ".join(f"'{n}'" for n in names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    looked = "\n".join(f"  - {c.name}: {c.looks_for}" for c in CONVENTIONS if c.looks_for)
    model = f" of a {info.model_type} model" if info is not None else ""
    return (f"'{layout.root}': no source convention recognises its tensor names{model} ({shown or 'no tensors'}; "
            f"format '{layout.format}'). Looked for:\n{looked}\nIs this the config the model was trained with? A "
            "framework naming tensors its own way needs a convention (docs/adding-a-family.md)")


def recognised(layout: Layout, info: ModelInfo | None = None) -> Convention:
    """:func:`convention_for`, or a refusal naming the names and what was looked for.

    Raises:
        ConfigError: no convention recognises ``layout`` (:func:`unrecognised`).
    """
    convention = convention_for(layout, info)
    if convention is None:
        raise ConfigError(unrecognised(layout, info))
    return convention
