"""Layer rules: which config keys pick a decoder layer's kind, and how to shrink a config to one layer of each kind.

Describing a model means building it with transformers on the meta device (:mod:`ckpttool.model.architecture`),
seconds for a 61-layer DeepSeek-V3 on a first run. Its layers are of few kinds, and the description of a config
with one layer of each kind, repeated by layer index (:mod:`ckpttool.model.reduced`), is the full one. Which layer
is of which kind is the family's to say: DeepSeek's ``first_k_dense_replace``, Qwen-MoE's ``mlp_only_layers`` and
``decoder_sparse_step``, Nemotron-H's ``hybrid_override_pattern``, transformers' ``layer_types``. Each family declares
a :class:`LayerRule` beside its adapter; ``registry.LAYER_RULES`` lists them, ``registry.reduced_layers`` applies
them. A model type with no rule is described in full, as is a config its rule cannot read.

A rule is checked twice: here, the reduced config must give back the kinds it was cut to (else the config is
described in full); in ``tests/test_reduced_describe.py``, the reduced description of every rule's configs, tiny and
real-size, must equal the full description exactly (names, shapes, order).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Hashable, Mapping, Sequence
from dataclasses import dataclass

from ckpttool.model.reduced import DECODER_LAYERS, LayerReduction

log = logging.getLogger(__name__)

#: per-layer lists transformers reads by layer index whatever the family (``sliding_attention`` or
#: ``full_attention``...): part of every layer's kind, and cut with the layers
PER_LAYER_KEYS = ("layer_types", "mlp_layer_types")

Config = Mapping[str, object]


@dataclass(frozen=True, slots=True)
class LayerRule:
    """How a family's config says which decoder layer is of which kind.

    Attributes:
        model_types: the ``model_type`` values the rule reads.
        kinds: each decoder layer's kind, in order (any hashable: ``"dense"``, ``"moe"``), from the config; raises
            KeyError, TypeError or ValueError for a config it cannot read (then described in full).
        shrink: the config with only the given layers (indices of the full model, ascending), so that its layer
            ``j`` is of the kind of the full model's ``layers[j]``: ``num_hidden_layers`` and the family's keys cut
            (the keys of :data:`PER_LAYER_KEYS` are cut for it).
        prefixes: where the decoder layers' tensors are named (``model.layers.``).
    """

    model_types: tuple[str, ...]
    kinds: Callable[[Config], Sequence[Hashable]]
    shrink: Callable[[Config, list[int]], dict[str, object]]
    prefixes: tuple[str, ...] = DECODER_LAYERS


def layer_count(config: Config) -> int:
    """``num_hidden_layers``; KeyError or TypeError when the config has no such whole number."""
    count = config["num_hidden_layers"]
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise TypeError(f"num_hidden_layers is {count!r}")
    return count


def alike(*model_types: str) -> LayerRule:
    """The rule of a family whose decoder layers are all of one kind (Llama, Mixtral, gpt-oss): only the
    :data:`PER_LAYER_KEYS` tell them apart.

    Example:
        >>> alike("llama").kinds({"num_hidden_layers": 3})
        ['layer', 'layer', 'layer']
    """
    return LayerRule(model_types, kinds=lambda config: ["layer"] * layer_count(config), shrink=shrink_count)


def shrink_count(config: Config, layers: list[int]) -> dict[str, object]:
    """``config`` with ``num_hidden_layers`` set to ``len(layers)``: the shrink of a rule with no keys of its own."""
    return {**config, "num_hidden_layers": len(layers)}


def reduce(rule: LayerRule, config: Config) -> LayerReduction | None:
    """The reduction of ``config`` by ``rule``: one layer of each kind, in the order of their first layer; None when
    it would not be smaller, the rule cannot read the config, or the reduced config does not give back the kinds it
    was cut to."""
    try:
        kinds = _kinds(rule, config)
        if len(set(kinds)) == len(kinds):
            return None
        first: dict[Hashable, int] = {}
        for index, kind in enumerate(kinds):
            first.setdefault(kind, index)
        layers = sorted(first.values())
        reduced = _shrink(rule, config, layers)
        if _kinds(rule, reduced) != [kinds[i] for i in layers]:
            log.info("%s: the reduced config's layers are not the kinds it was cut to: described in full",
                     config.get("model_type"))
            return None
    except (KeyError, TypeError, ValueError, IndexError) as e:
        log.info("%s: the layer rule cannot read this config (%s): described in full", config.get("model_type"), e)
        return None
    slot = {kinds[i]: j for j, i in enumerate(layers)}
    return LayerReduction(reduced, tuple(slot[kind] for kind in kinds), rule.prefixes)


def _kinds(rule: LayerRule, config: Config) -> list[Hashable]:
    """The rule's kinds with each layer's entries of the :data:`PER_LAYER_KEYS` lists the config holds."""
    kinds = list(rule.kinds(config))
    lists = [config[key] for key in PER_LAYER_KEYS if config.get(key) is not None]
    for values in lists:
        if not isinstance(values, list) or len(values) != len(kinds):
            raise ValueError(f"a per-layer list of {len(values)} for {len(kinds)} layers")
    return [(kind, *(str(values[i]) for values in lists)) for i, kind in enumerate(kinds)]


def _shrink(rule: LayerRule, config: Config, layers: list[int]) -> dict[str, object]:
    """The rule's shrink with the :data:`PER_LAYER_KEYS` lists cut to ``layers``."""
    reduced = rule.shrink(config, layers)
    for key in PER_LAYER_KEYS:
        values = config.get(key)
        if isinstance(values, list):
            reduced[key] = [values[i] for i in layers]
    return reduced
