"""The Megatron-Core source convention: its global GPT tensors cut into HuggingFace Llama, Mistral, Qwen2,
Mixtral/Qwen2-MoE and DeepSeek-V3 tensors, as boxes.

Both Megatron readers describe a checkpoint with Megatron-Core's own *global* tensors (see
:mod:`ckpttool.readers.megatron.common`): per-layer tensors stacked with a leading layer axis or named per global
layer, experts stacked or per global expert; ``linear_qkv`` rows grouped by query group (``heads/G`` query
heads, one key head, one value head per group); a SwiGLU ``linear_fc1`` as ``[gate; up]``; vocab padding
recorded by the reader, stripped here once. Which HuggingFace name a tensor gets is taken from the names
transformers writes for the configured model (Mixtral's ``block_sparse_moe`` or Qwen's ``mlp.experts``).
Multi-latent attention, the router's expert bias and MTP layers (DeepSeek-V3) are :mod:`.megatron_mla`'s tables.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

from ckpttool.model.description import ModelInfo
from ckpttool.model.architecture import config_value
from ckpttool.layout.layout import Box, Layout
from ckpttool.plan.tiling import Slice
from ckpttool.plan.plan import TargetSpec
from ckpttool.errors import ConfigError
from ckpttool.families.adapter import Convention, CutResult, FamilyAdapter
from ckpttool.families.conventions import megatron_mla as mla
from ckpttool.families import mtp

NAME = "Megatron-Core"
#: the layout formats written in this convention
FORMATS = ("megatron-dist", "megatron-legacy")

#: every name of a Megatron-Core GPT model starts so (a layout named so is in this convention, whatever its reader);
#: LLaVAModel's towers too, to be refused by name (:data:`_UNCUT`)
_NAMES = re.compile(r"^(?:embedding\.|decoder\.|output_layer\.|mtp\.layers\.|vision_model\.|vision_projection\.|"
                    r"language_model\.(?:embedding|decoder|output_layer)\.)")
#: Megatron-Core models whose tensors are not cut, by a name only they hold: megatron-core 0.16.1 builds neither on a
#: CPU as it ships (docs/formats.md, "Megatron-Core hybrid and vision-language models"), so no cut could be proven
#: against the producer
_UNCUT = (
    (re.compile(r"^(?:vision_model|vision_projection|language_model)\."),
     "LLaVAModel (vision encoder, projector and language model)"),
    (re.compile(r"\.self_attention\.(?:in_proj\.weight\.(?:query|key|value|z|beta|alpha)$|conv1d\.(?:weight|bias)\."
                r"(?:query|key|value)$|A_log$|dt_bias$|out_norm\.)"),
     "GPTModel with gated DeltaNet layers (experimental_attention_variant 'gated_delta_net', Qwen3-Next style)"),
)
_LAYER = re.compile(r"^decoder\.layers\.(?:(\d+)\.)?(.+)$")
#: SequentialMLP in 0.16 saves ``mlp.experts.experts.linear_fc1.weight`` (L, E, ...): its prefix plus "experts."
_EXPERT = re.compile(r"^mlp\.experts\.(?:experts\.)?(?:(\d+)\.)?(linear_fc1|linear_fc2)\.weight(_w|_v)?$")
#: SharedExpertMLP (``moe_shared_expert_intermediate_size``): a dense MLP inside the MoE layer, TP-split like the
#: dense one (``linear_fc1`` SwiGLU ``[gate; up]``, ``linear_fc2`` row-parallel), and with ``moe_shared_expert_gate``
#: a replicated ``gate_weight (1, H)`` whose sigmoid scales its output
_SHARED = re.compile(r"^mlp\.shared_experts\.(linear_fc1\.weight(_w|_v)?|linear_fc2\.weight|gate_weight)$")
_TOP = {
    "embedding.word_embeddings.weight": "model.embed_tokens.weight",
    "output_layer.weight": "lm_head.weight",
    "decoder.final_layernorm.weight": "model.norm.weight",
}
_RENAMES = {
    "input_layernorm.weight": "input_layernorm.weight",
    "self_attention.linear_qkv.layer_norm_weight": "input_layernorm.weight",
    "pre_mlp_layernorm.weight": "post_attention_layernorm.weight",
    "mlp.linear_fc1.layer_norm_weight": "post_attention_layernorm.weight",
    "self_attention.linear_proj.weight": "self_attn.o_proj.weight",
    "self_attention.q_layernorm.weight": "self_attn.q_norm.weight",
    "self_attention.k_layernorm.weight": "self_attn.k_norm.weight",
    "mlp.linear_fc2.weight": "mlp.down_proj.weight",
}


class _Cut:
    """Collects target specs; each ``put`` is one box of a source tensor filling a whole target."""

    def __init__(self, info: ModelInfo) -> None:
        self.info = info
        # the MTP layers' names too: pick() chooses among names transformers writes for the model
        self.known = {*info.disk_shapes, *(n for layer in mtp.expected(info).values() for n in layer)}
        self.specs: dict[str, list[Slice]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def put(self, name: str, source: str, lead: tuple[int, ...], start: int, rows: int, rest: tuple[int, ...],
            dst_start: int = 0, total: int | None = None) -> None:
        """Rows ``start..start+rows`` of ``source`` (after the leading indices ``lead``) fill rows
        ``dst_start..`` of target ``name`` (``total`` rows in all)."""
        src = Box((*lead, start, *(0 for _ in rest)), (*(1 for _ in lead), rows, *rest))
        shape = (total if total is not None else rows, *rest)
        dst = Box((dst_start, *(0 for _ in rest)), (rows, *rest))
        self.shapes[name] = shape
        self.specs.setdefault(name, []).append(Slice(source, src, dst))

    def whole(self, name: str, source: str, lead: tuple[int, ...], shape: tuple[int, ...]) -> None:
        if not shape:
            self.shapes[name] = ()
            self.specs.setdefault(name, []).append(Slice(source, Box((*lead,), (*(1 for _ in lead),)), Box((), ())))
            return
        self.put(name, source, lead, 0, shape[0], shape[1:])

    def pick(self, *candidates: str) -> str:
        """The first candidate name transformers writes on disk for this model (else the first)."""
        return next((c for c in candidates if c in self.known), candidates[0])

    def result(self) -> list[TargetSpec]:
        return [TargetSpec(name, self.shapes[name], tuple(slices)) for name, slices in self.specs.items()]


class MegatronCoreConvention(Convention):
    """Megatron-Core's global GPT tensors (see the module docstring), from either Megatron reader or any reader of a
    layout named so (a DCP or sidecar source holding ``decoder.layers.*``)."""

    name = NAME
    formats = FORMATS
    looks_for = "embedding.*, decoder.layers.*, output_layer.*, mtp.layers.* (Megatron-Core's GPT names)"

    def holds_names(self, names: Collection[str], info: ModelInfo | None) -> bool:
        """Every name is a Megatron-Core GPT name and some are its decoder layers'."""
        return (any(name.startswith(("decoder.layers.", "language_model.decoder.layers.")) for name in names)
                and all(_NAMES.match(name) for name in names))

    def cut(self, layout: Layout, info: ModelInfo, family: FamilyAdapter) -> CutResult:
        """:func:`to_hf` (the HuggingFace names it writes are chosen from those transformers writes for ``info``)."""
        return to_hf(layout, info)


CONVENTION = MegatronCoreConvention()


def to_hf(layout: Layout, info: ModelInfo) -> tuple[list[TargetSpec], list[str], list[tuple[str, str]]]:
    """Megatron-Core global tensors (either reader) -> HuggingFace on-disk tensors, as boxes.

    Returns:
        ``(specs, notes, problems)``; a problem is ``(source tensor, message)`` for a tensor with no HF place or
        with a shape the config contradicts.
    """
    uncut = refused_model(layout.tensors)
    if uncut is not None:
        return [], [], [uncut]
    cut = _Cut(info)
    problems: list[tuple[str, str]] = []
    notes = [
        f"stripped vocab padding: rows {t.padding[0].true_size}..{t.global_shape[0]} of '{t.fqn}'"
        for t in layout.tensors.values() if t.padding
    ]
    config = info.config
    heads = int(config.get("num_attention_heads") or 0)
    groups = int(config.get("num_key_value_heads") or heads)
    hidden = int(config.get("hidden_size") or 0)
    head_dim = int(config.get("head_dim") or (hidden // heads if heads else 0))
    # a stacked tensor holds at most every layer (expert) of the config: its leading size is not trusted to loop on
    most = {"layers": _config_count(config, "num_hidden_layers"),
            "experts": _config_count(config, "num_local_experts", "num_experts", "n_routed_experts")}
    dims = (heads, groups, head_dim, most["experts"])
    mtp_layers: dict[int, int] = {}  # MTP layer -> its model.layers index
    undeclared: dict[int, list[str]] = {}  # MTP layers the config does not declare -> their tensors
    for tensor in layout.tensors.values():
        fqn = tensor.fqn
        shape = tensor.true_shape
        if fqn in _TOP:
            cut.whole(_TOP[fqn], fqn, (), shape)
            continue
        if (m := mla.MTP_LAYER.match(fqn)) is not None:
            layer = mla.mtp_layer(int(m[1]), config)
            if layer is None:
                undeclared.setdefault(int(m[1]), []).append(fqn)
                continue
            try:
                _cut_mtp(cut, fqn, m[2], layer, shape, dims)
                mtp_layers[int(m[1])] = layer
            except ConfigError as e:
                problems.append((fqn, str(e)))
            continue
        match = _LAYER.match(fqn)
        if match is None:
            problems.append(
                (fqn, f"'{fqn}': not a Megatron-Core GPT tensor ckpttool can place in a {info.model_type} model")
            )
            continue
        stacked = match.group(1) is None
        if stacked and (not shape or shape[0] > most["layers"]):
            problems.append((fqn, f"'{fqn}': {shape[0] if shape else 'no'} stacked layers, expected at most "
                                  f"{most['layers']} (the config's num_hidden_layers)"))
            continue
        layers = range(shape[0]) if stacked else (int(match.group(1)),)
        inner = shape[1:] if stacked else shape
        for layer in layers:
            lead = (layer,) if stacked else ()
            try:
                _cut_layer(cut, fqn, match.group(2), layer, lead, inner, *dims)
            except ConfigError as e:
                problems.append((fqn, str(e)))
                break
    problems += [(names[0], mla.undeclared(i, names, config, info.model_type))
                 for i, names in sorted(undeclared.items())]
    for index, layer in sorted(mtp_layers.items()):  # Megatron shares these with its MTP layers; a release keeps copies
        for src, part in mla.MTP_SHARED.items():
            if src in layout.tensors:
                cut.whole(f"model.layers.{layer}.{part}", src, (), layout.tensors[src].true_shape)
        notes.append(f"MTP layer mtp.layers.{index} -> model.layers.{layer}, with copies of the embedding and output "
                     "layer it shares (embed_tokens, shared_head.head)")
    return cut.result(), notes, problems


def refused_model(names: Collection[str]) -> tuple[str, str] | None:
    """``(tensor, message)`` naming the Megatron-Core model whose tensors ``names`` are when it is one ckpttool does
    not cut (:data:`_UNCUT`: LLaVAModel, GPTModel with gated DeltaNet layers), else None."""
    for pattern, model in _UNCUT:
        fqn = next((name for name in names if pattern.search(name)), None)
        if fqn is not None:
            return (fqn, f"'{fqn}': a Megatron-Core {model} checkpoint, which ckpttool does not cut: megatron-core "
                         "0.16.1 does not build this model on a CPU as it ships, so no cut is proven against it (see "
                         "docs/formats.md, 'Megatron-Core hybrid and vision-language models'). Merge the model's "
                         "HuggingFace export or an FSDP2 / DCP save of the transformers model instead")
    return None


def _cut_mtp(cut: _Cut, fqn: str, part: str, layer: int, shape: tuple[int, ...],
             dims: tuple[int, int, int, int]) -> None:
    """One tensor of an MTP layer at ``model.layers.{layer}``: its decoder layer like a main one, or its own part."""
    if part.startswith(mla.INNER):
        _cut_layer(cut, fqn, part[len(mla.INNER):], layer, (), shape, *dims)
    elif part in mla.MTP_PARTS:
        cut.whole(f"model.layers.{layer}.{mla.MTP_PARTS[part]}", fqn, (), shape)
    else:
        raise ConfigError(f"'{fqn}': '{part}' is not a part of an MTP layer ckpttool can place")


def _config_count(config: Mapping[str, object], *names: str) -> int:
    """The first of ``names`` the config holds as a non-negative integer (``2**16`` when none: a bound to loop to)."""
    value = config_value(config, *names)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 1 << 16


def _cut_layer(cut: _Cut, fqn: str, suffix: str, layer: int, lead: tuple[int, ...], shape: tuple[int, ...],
               heads: int, groups: int, head_dim: int, most_experts: int) -> None:
    h = f"model.layers.{layer}."
    if suffix in mla.RENAMES:  # Megatron names MLA's query norm and qk-norm's alike (q_layernorm): the model says which
        mla.check_rows(fqn, suffix, shape, cut.info.config)
        plain = (h + _RENAMES[suffix],) if suffix in _RENAMES else ()
        cut.whole(cut.pick(h + mla.RENAMES[suffix], *plain), fqn, lead, shape)
    elif suffix in _RENAMES:
        cut.whole(h + _RENAMES[suffix], fqn, lead, shape)
    elif suffix in ("self_attention.linear_qkv.weight", "self_attention.linear_qkv.bias"):
        _cut_qkv(cut, fqn, h, suffix.rsplit(".", 1)[1], lead, shape, heads, groups, head_dim)
    elif suffix == "mlp.linear_fc1.weight":
        _cut_gate_up(cut, fqn, lead, shape, h + "mlp.gate_proj.weight", h + "mlp.up_proj.weight")
    elif suffix in ("mlp.linear_fc1.weight_w", "mlp.linear_fc1.weight_v"):  # singleton shards: halves on their own
        cut.whole(h + ("mlp.gate_proj.weight" if suffix.endswith("_w") else "mlp.up_proj.weight"), fqn, lead, shape)
    elif suffix == "mlp.router.weight":
        cut.whole(cut.pick(h + "block_sparse_moe.gate.weight", h + "mlp.gate.weight"), fqn, lead, shape)
    elif (m := _SHARED.match(suffix)) is not None:
        _cut_shared(cut, fqn, h, m.group(1), m.group(2), lead, shape)
    elif (m := _EXPERT.match(suffix)) is not None:
        if m.group(1) is None and (not shape or shape[0] > most_experts):
            raise ConfigError(f"'{fqn}': {shape[0] if shape else 'no'} stacked experts, expected at most "
                              f"{most_experts} (the config's number of experts)")
        experts = range(shape[0]) if m.group(1) is None else (int(m.group(1)),)
        inner = shape[1:] if m.group(1) is None else shape
        for e in experts:
            at = (*lead, e) if m.group(1) is None else lead
            mixtral = h + f"block_sparse_moe.experts.{e}."
            qwen = h + f"mlp.experts.{e}."
            gate = cut.pick(mixtral + "w1.weight", qwen + "gate_proj.weight")
            up = cut.pick(mixtral + "w3.weight", qwen + "up_proj.weight")
            down = cut.pick(mixtral + "w2.weight", qwen + "down_proj.weight")
            if m.group(2) == "linear_fc2":
                cut.whole(down, fqn, at, inner)
            elif m.group(3) is not None:  # torch_dist singleton shards: the halves under their own keys
                cut.whole(gate if m.group(3) == "_w" else up, fqn, at, inner)
            else:
                _cut_gate_up(cut, fqn, at, inner, gate, up)
    else:
        raise ConfigError(f"'{fqn}': '{suffix}' is not a layer tensor ckpttool can place in a HuggingFace model")


def _cut_shared(cut: _Cut, fqn: str, h: str, kind: str, half: str | None, lead: tuple[int, ...],
                shape: tuple[int, ...]) -> None:
    """Megatron's shared expert under the names transformers writes: Qwen2-MoE's ``mlp.shared_expert.*`` and its
    sigmoid ``mlp.shared_expert_gate``, or ``mlp.shared_experts.*`` (DeepSeek-style, no gate)."""
    qwen, plural = h + "mlp.shared_expert.", h + "mlp.shared_experts."
    gate = cut.pick(qwen + "gate_proj.weight", plural + "gate_proj.weight")
    up = cut.pick(qwen + "up_proj.weight", plural + "up_proj.weight")
    if kind == "gate_weight":
        cut.whole(h + "mlp.shared_expert_gate.weight", fqn, lead, shape)
    elif kind == "linear_fc2.weight":
        cut.whole(cut.pick(qwen + "down_proj.weight", plural + "down_proj.weight"), fqn, lead, shape)
    elif half is not None:  # torch_dist singleton shards: the SwiGLU halves under their own keys
        cut.whole(gate if half == "_w" else up, fqn, lead, shape)
    else:
        _cut_gate_up(cut, fqn, lead, shape, gate, up)


def _cut_qkv(cut: _Cut, fqn: str, h: str, kind: str, lead: tuple[int, ...], shape: tuple[int, ...],
             heads: int, groups: int, head_dim: int) -> None:
    """Rows per query group: ``heads/groups`` query heads, one key head, one value head."""
    if not heads or not groups or heads % groups:
        raise ConfigError(
            f"'{fqn}': the config's num_attention_heads {heads} / num_key_value_heads {groups} do not group"
        )
    per_group = heads // groups
    rows = groups * (per_group + 2) * head_dim
    if not shape or shape[0] != rows:
        raise ConfigError(
            f"'{fqn}': {shape[0] if shape else 0} rows, expected {rows} ({groups} query groups x ({per_group} query + "
            f"1 key + 1 value heads) x head_dim {head_dim}) from the config"
        )
    rest = shape[1:]
    block = (per_group + 2) * head_dim
    for g in range(groups):
        base = g * block
        cut.put(f"{h}self_attn.q_proj.{kind}", fqn, lead, base, per_group * head_dim, rest,
                g * per_group * head_dim, heads * head_dim)
        cut.put(f"{h}self_attn.k_proj.{kind}", fqn, lead, base + per_group * head_dim, head_dim, rest,
                g * head_dim, groups * head_dim)
        cut.put(f"{h}self_attn.v_proj.{kind}", fqn, lead, base + (per_group + 1) * head_dim, head_dim, rest,
                g * head_dim, groups * head_dim)


def _cut_gate_up(cut: _Cut, fqn: str, lead: tuple[int, ...], shape: tuple[int, ...], gate: str, up: str) -> None:
    """A SwiGLU ``linear_fc1`` as the readers describe it globally: ``[gate; up]``."""
    if not shape or shape[0] % 2:
        raise ConfigError(f"'{fqn}': {shape[0] if shape else 0} rows cannot be split into gate and up halves")
    half = shape[0] // 2
    cut.put(gate, fqn, lead, 0, half, shape[1:])
    cut.put(up, fqn, lead, half, half, shape[1:])
