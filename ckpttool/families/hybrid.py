"""Hybrid models: decoder layers of more than one kind (gated DeltaNet linear attention or a Mamba-2 mixer beside
full attention), as the config declares them.

Which layer is which is only in the config: Qwen3-Next's and Qwen3.5's ``layer_types`` (``linear_attention`` /
``full_attention``), Nemotron-H's ``layers_block_type`` (transformers 5; ``linear_attention`` is its Mamba-2 mixer,
``full_attention``, ``mlp``, ``moe``) or, in releases written before it, ``hybrid_override_pattern`` (one character
a layer: ``M`` Mamba-2, ``*`` attention, ``-`` MLP, ``E`` MoE). transformers builds each layer's mixer from it, so
the tensors a layer must hold follow from its kind: the audit names a layer kind whose mixer is missing as one root
cause (a converter that knows only attention drops every linear-attention mixer without a word).

Falcon-H1 declares no kinds: every one of its layers holds a Mamba-2 mixer (``mamba``) beside its attention
(``self_attn``), so a missing mixer is one cause across all its layers (:data:`SIDE_BY_SIDE`).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

#: ``hybrid_override_pattern``'s characters, as transformers' ``NemotronHConfig._pattern_to_list`` reads them
PATTERN_KINDS = {"M": "linear_attention", "*": "full_attention", "-": "mlp", "E": "moe"}
#: legacy layer kinds transformers renames (``remap_legacy_layer_types``)
_LEGACY = {"mamba": "linear_attention", "attention": "full_attention"}
#: the gated DeltaNet models (Qwen3-Next, Qwen3.5's language model, dense or MoE): the same layers and names
_DELTANET_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
#: the module holding a layer's mixer, per model type (Nemotron-H names every layer's mixer ``mixer``)
MIXER_MODULES: Mapping[str, Mapping[str, str]] = {
    **dict.fromkeys(_DELTANET_TYPES, {"linear_attention": "linear_attn", "full_attention": "self_attn"}),
    "nemotron_h": {"linear_attention": "mixer", "full_attention": "mixer", "mlp": "mixer", "moe": "mixer"},
}
#: a layer kind in words, per model type
_KIND_WORDS: Mapping[str, Mapping[str, str]] = {
    **dict.fromkeys(_DELTANET_TYPES, {"linear_attention": "gated DeltaNet linear-attention",
                                      "full_attention": "gated full-attention"}),
    "nemotron_h": {"linear_attention": "Mamba-2", "full_attention": "attention", "mlp": "MLP", "moe": "MoE"},
}
#: models whose every layer holds each of these mixers side by side (no layer kinds): module -> the mixer in words
SIDE_BY_SIDE: Mapping[str, Mapping[str, str]] = {
    "falcon_h1": {"mamba": "Mamba-2", "self_attn": "attention"},
}
#: a layer tensor's name: prefix, layer, the module under the layer, the rest
_LAYER_MODULE = re.compile(r"^(?P<prefix>.*?\.layers)\.(?P<index>\d+)\.(?P<module>[^.]+)\.(?P<rest>.+)$")


def layer_kinds(config: Mapping[str, object]) -> list[str] | None:
    """The kind of every decoder layer the config declares (``layer_types``, ``layers_block_type`` or
    ``hybrid_override_pattern``, legacy kinds renamed as transformers does), or None when it declares none.

    Example:
        >>> layer_kinds({"hybrid_override_pattern": "M*M-"})
        ['linear_attention', 'full_attention', 'linear_attention', 'mlp']
    """
    for key in ("layer_types", "layers_block_type"):
        kinds = config.get(key)
        if isinstance(kinds, list) and kinds and all(isinstance(k, str) for k in kinds):
            return [_LEGACY.get(k, k) for k in kinds]
    pattern = config.get("hybrid_override_pattern")
    if isinstance(pattern, str) and pattern and all(c in PATTERN_KINDS for c in pattern):
        return [PATTERN_KINDS[c] for c in pattern]
    return None


def kind_key(config: Mapping[str, object]) -> str:
    """The config key the layer kinds were read from, for messages."""
    for key in ("layer_types", "layers_block_type", "hybrid_override_pattern"):
        if config.get(key):
            return key
    return "layer_types"


def missing_mixer_cause(name: str, model_type: str, config: Mapping[str, object]) -> str | None:
    """The root cause of a missing on-disk tensor ``name`` of a hybrid model when it belongs to a layer's mixer, in
    words that name the mixer module (with ``{L}`` for the layer, so that one cause gathers every layer of a kind)
    and the kind the config gives the layer; None for another tensor or a model that is not hybrid.

    Example:
        >>> missing_mixer_cause("model.layers.1.linear_attn.A_log", "qwen3_next",
        ...                     {"layer_types": ["linear_attention", "linear_attention"]})
        "the gated DeltaNet linear-attention mixer 'model.layers.{L}.linear_attn' is missing (config layer_types: 'linear_attention')"
    """
    modules = MIXER_MODULES.get(model_type)
    kinds = layer_kinds(config)
    match = _LAYER_MODULE.match(name)
    side_by_side = SIDE_BY_SIDE.get(model_type, {})
    if match is not None and match["module"] in side_by_side:
        return (f"the {side_by_side[match['module']]} mixer '{match['prefix']}.{{L}}.{match['module']}' is missing "
                f"({model_type}: every layer holds one)")
    if modules is None or kinds is None or match is None:
        return None
    layer = int(match["index"])
    kind = kinds[layer] if layer < len(kinds) else None
    if kind is None or modules.get(kind) != match["module"]:
        return None
    words = _KIND_WORDS.get(model_type, {}).get(kind, kind)
    return (f"the {words} mixer '{match['prefix']}.{{L}}.{match['module']}' is missing "
            f"(config {kind_key(config)}: {kind!r})")


def layer_kinds_in_words(indices: list[int], model_type: str, config: Mapping[str, object]) -> str:
    """The kinds of layers ``indices`` of a hybrid model (``" (linear_attention, full_attention)"``), or "" for a
    model that is not hybrid (a Gemma's or gpt-oss's ``layer_types`` say sliding or full attention: one mixer) or a
    config that declares none."""
    kinds = layer_kinds(config) if model_type in MIXER_MODULES else None
    if kinds is None:
        return ""
    named = sorted({kinds[i] for i in indices if i < len(kinds)})
    return f" ({', '.join(named)})" if named else ""


#: Qwen3-Next's projections whose rows are grouped per key head (its q, k, v, z rows; its b, a rows)
_GROUPED = re.compile(r"\.linear_attn\.(?P<proj>in_proj_qkvz|in_proj_ba)\.weight$")


def grouped_rows_note(name: str, got: tuple[int, ...], expected: tuple[int, ...],
                      config: Mapping[str, object]) -> str:
    """What a wrong row count of a gated DeltaNet's grouped projection (``in_proj_qkvz``, ``in_proj_ba``) means,
    in words (``""`` for another tensor or shape): rows are grouped per key head, so a tensor-parallel rank's piece is
    whole key-head groups, and a count that cuts a group was not cut by key heads at all.

    Example:
        >>> grouped_rows_note("model.layers.0.linear_attn.in_proj_qkvz.weight", (48, 32), (96, 32),
        ...                   {"linear_num_key_heads": 2})
        '; its rows are grouped per key head (2 groups of 48: q, k, v, z of one key head each), and these 48 are 1 whole group: one tensor-parallel rank of 2 saved as the whole tensor'
    """
    match = _GROUPED.search(name)
    heads = config.get("linear_num_key_heads")
    if (match is None or not isinstance(heads, int) or heads <= 0 or len(got) != 2 or len(expected) != 2
            or got[1] != expected[1] or got[0] >= expected[0] or expected[0] % heads):
        return ""
    per_group = expected[0] // heads
    parts = "q, k, v, z" if match["proj"] == "in_proj_qkvz" else "b, a"
    grouped = f"; its rows are grouped per key head ({heads} groups of {per_group}: {parts} of one key head each)"
    if got[0] % per_group:
        return f"{grouped}, and {got[0]} rows cut a group: not a cut by key heads (the q/k/v/z of a head are split)"
    whole = got[0] // per_group
    ranks = f" of {heads // whole}" if heads % whole == 0 else ""
    return (f"{grouped}, and these {got[0]} are {whole} whole group{'s' if whole > 1 else ''}: one tensor-parallel "
            f"rank{ranks} saved as the whole tensor")
