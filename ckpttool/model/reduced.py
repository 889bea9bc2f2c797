"""A model described from a reduced config: one decoder layer of each kind, repeated by layer index.

Building a 61-layer DeepSeek-V3 on the meta device takes seconds; its layers are of three kinds only (dense, MoE,
and the MTP layer transformers builds apart), and every layer of a kind has the same tensors under its own index.
So a family that can say which config keys pick a layer's kind (its rule, :mod:`ckpttool.families.layers`) hands
:func:`ckpttool.model.architecture.model_info` a :class:`LayerReduction`: a config with one layer per kind, and for
each layer of the full model the reduced layer that stands for it. :func:`expand` then repeats the reduced layers'
names and shapes by index, in the order transformers lists them (the embedding, layer 0, layer 1, ..., the rest).

This module knows no family: which layer is of which kind is the rule's; here is only the repeating, which refuses
(None: describe the full config) whatever it cannot repeat faithfully.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from ckpttool.model.description import ModelInfo

#: where transformers keeps a causal LM's decoder layers (``model.layers.3.mlp.gate.weight``)
DECODER_LAYERS = ("model.layers.",)


@dataclass(frozen=True, slots=True)
class LayerReduction:
    """A config with fewer decoder layers that describes the full one.

    Attributes:
        config: the reduced config (one layer of each kind, ``num_hidden_layers`` and the per-layer keys cut to them).
        layer_of: for each layer of the full model, in order, the index of the reduced layer of its kind.
        prefixes: the name prefixes the decoder layers stand under (``model.layers.``), in memory and on disk.
    """

    config: Mapping[str, object]
    layer_of: tuple[int, ...]
    prefixes: tuple[str, ...] = DECODER_LAYERS


def expand(info: ModelInfo, reduction: LayerReduction, config: Mapping[str, object]) -> ModelInfo | None:
    """The description of the full ``config`` from ``info``, the description of ``reduction.config``: each reduced
    layer's names and shapes repeated under the index of every full layer of its kind; None when the reduced
    description does not read as one block of layers ``0..k-1`` under one of ``reduction.prefixes`` (in memory and
    on disk), or ties a name inside a decoder layer: the caller then describes the full config.

    Example:
        names ``model.embed_tokens.weight, model.layers.0.a, model.layers.1.b, model.norm.weight`` with
        ``layer_of=(0, 1, 1)`` become ``model.embed_tokens.weight, model.layers.0.a, model.layers.1.b,
        model.layers.2.b, model.norm.weight``.
    """
    layers = max(reduction.layer_of, default=-1) + 1
    memory = _repeat(info.memory_shapes, reduction, layers)
    disk = _repeat(info.disk_shapes, reduction, layers)
    buffers = _repeat(info.buffers, reduction, layers, required=False)
    if memory is None or disk is None or buffers is None:
        return None
    if any(_index(name, reduction.prefixes) is not None for pair in info.tied.items() for name in pair):
        return None  # a tie inside a layer would have to be repeated with both ends renamed: not worth guessing
    return replace(info, config=dict(config), memory_shapes=memory, disk_shapes=disk, buffers=buffers)


def _index(name: str, prefixes: tuple[str, ...]) -> tuple[str, int, str] | None:
    """``(prefix, layer index, rest)`` of a decoder layer's tensor name, or None for any other name."""
    for prefix in prefixes:
        if name.startswith(prefix):
            index, dot, rest = name[len(prefix):].partition(".")
            if dot and index.isdigit():
                return prefix, int(index), rest
    return None


def _repeat(shapes: Mapping[str, object], reduction: LayerReduction, layers: int,
            required: bool = True) -> dict[str, object] | None:
    """``shapes`` with its block of reduced layers replaced by the full model's; None when the reduced layers are not
    one block, in index order, under one prefix, each holding names (``required``; a map with no layer names at all,
    such as most models' buffers, is returned as it is when not ``required``)."""
    before: dict[str, object] = {}
    after: dict[str, object] = {}
    blocks: dict[int, list[tuple[str, object]]] = {}
    prefixes: set[str] = set()
    last = -1
    for name, shape in shapes.items():
        found = _index(name, reduction.prefixes)
        if found is None:
            (after if blocks else before)[name] = shape
            continue
        prefix, index, rest = found
        if after or index < last:  # a name between layers, or layers out of order: the order cannot be kept
            return None
        last = index
        prefixes.add(prefix)
        blocks.setdefault(index, []).append((rest, shape))
    if not blocks and not required:
        return dict(shapes)
    if len(prefixes) != 1 or sorted(blocks) != list(range(layers)):
        return None
    (prefix,) = prefixes
    full = dict(before)
    for index, kind in enumerate(reduction.layer_of):
        for rest, shape in blocks[kind]:
            full[f"{prefix}{index}.{rest}"] = shape
    full.update(after)
    return full
