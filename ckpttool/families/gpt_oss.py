"""gpt-oss (transformers ``GptOssForCausalLM``): attention sinks, biases everywhere, experts stacked with gate and up
interleaved by column.

The HuggingFace convention is the identity: transformers 5 keeps gpt-oss's tensors in memory under the names and
shapes ``save_pretrained`` writes (the BF16 release's layout): ``self_attn.sinks [heads]``, ``mlp.router.{weight,
bias}``, ``mlp.experts.gate_up_proj [E, H, 2I]`` whose columns alternate gate and up (``[..., ::2]`` gate,
``[..., 1::2]`` up; used as ``x @ gate_up_proj[e]``), ``gate_up_proj_bias [E, 2I]`` alike, ``down_proj [E, I, H]``
(``x @ down_proj[e]``: the transpose of an ``nn.Linear`` weight) and ``down_proj_bias [E, H]``. So a DCP or
transformers-distributed source needs no rule, and experts on disk stay stacked.

The Megatron-Core convention (``softmax_type="learnable"``, ``add_bias_linear``, the clamped SwiGLU as
``quick_gelu`` with ``glu_linear_offset`` 1; Megatron-Bridge's ``GPTOSSBridge`` is the reference mapping) keeps per
expert ``linear_fc1 [2I, H]`` as ``[gate; up]`` and ``linear_fc2 [H, I]``, each with a bias, the sinks as
``self_attention.core_attention.softmax_offset``, and the router's bias. :func:`megatron_core_cut` places those:

- ``gate_up_proj[e]`` = ``interleave(gate, up)`` of ``fc1`` along its rows, then transposed: a target whose slices
  tile the stacked pre tensor ``[E, 2I, H]`` (one box per expert, as the checkpoint holds it) and whose transform is
  ``Chain(interleave(2, 2I, dim=1), Transpose(1, 2))``, streamed by the executor expert by expert;
- ``gate_up_proj_bias[e]`` = ``interleave`` of the fc1 bias; ``down_proj[e]`` = ``fc2`` transposed
  (``Transpose(1, 2)`` of the stacked ``[E, H, I]``); ``down_proj_bias[e]`` = the fc2 bias;
- sinks, router weight and bias, ``o_proj`` bias: renamed whole.

Everything else (embeddings, norms, QKV with its bias grouped per query group, ``o_proj``) is the Megatron-Core
convention's own cut.
"""

from __future__ import annotations

import re
from dataclasses import replace
from typing import Any

from ckpttool.errors import ConfigError
from ckpttool.families.adapter import HF_TP_RULES, REPLICATE, SHARD0, CutResult, FamilyAdapter
from ckpttool.families.conventions import megatron_core
from ckpttool.families.layers import alike
from ckpttool.layout.layout import Box, Layout, Shape
from ckpttool.model.description import ModelInfo
from ckpttool.plan.tiling import Slice
from ckpttool.plan.plan import TargetSpec
from ckpttool.plan.transforms import Chain, Transform, Transpose, interleave

NAME = "gpt_oss"

#: a Megatron-Core layer tensor this adapter places itself (group 1: the layer when named per layer, group 2: the
#: part): the experts' fc1/fc2 weights and biases (stacked ``experts.experts.`` or per expert ``local_experts.E.``),
#: the sinks, the router and the attention output's bias
_LAYER = re.compile(
    r"^decoder\.layers\.(?:(\d+)\.)?("
    r"mlp\.experts\.(?:experts\.|local_experts\.)?(?:\d+\.)?linear_fc[12]\.(?:weight|bias)"
    r"|self_attention\.core_attention\.softmax_offset|mlp\.router\.(?:weight|bias)|self_attention\.linear_proj\.bias)$"
)
_EXPERT = re.compile(r"^mlp\.experts\.(?:experts\.|local_experts\.)?(?:(\d+)\.)?(linear_fc[12])\.(weight|bias)$")
_WHOLE = {
    "self_attention.core_attention.softmax_offset": "self_attn.sinks",
    "mlp.router.weight": "mlp.router.weight",
    "mlp.router.bias": "mlp.router.bias",
    "self_attention.linear_proj.bias": "self_attn.o_proj.bias",
}
#: Megatron expert part -> the HF tensor stacking it over experts (fc1's are interleaved, and the weight transposed;
#: fc2's weight is transposed)
_EXPERT_TARGETS = {
    ("linear_fc1", "weight"): "mlp.experts.gate_up_proj",
    ("linear_fc1", "bias"): "mlp.experts.gate_up_proj_bias",
    ("linear_fc2", "weight"): "mlp.experts.down_proj",
    ("linear_fc2", "bias"): "mlp.experts.down_proj_bias",
}


def megatron_core_cut(layout: Layout, info: ModelInfo) -> CutResult:
    """A Megatron-Core gpt-oss layout under transformers' on-disk names: the experts, sinks, router and attention
    output bias placed here (see the module docstring), every other tensor by the Megatron-Core convention's cut.

    Returns:
        ``(specs, notes, problems)``; a problem names the source tensor and what does not fit (fc1 rows that do not
        halve into gate and up, an expert index past the config's ``num_local_experts``, a tensor of another shape).
    """
    own = {fqn: t for fqn, t in layout.tensors.items() if _LAYER.match(fqn)}
    rest = replace(layout, tensors={fqn: t for fqn, t in layout.tensors.items() if fqn not in own})
    specs, notes, problems = megatron_core.to_hf(rest, info)
    experts = int(info.config.get("num_local_experts") or 0)
    most_layers = int(info.config.get("num_hidden_layers") or 0)
    pieces: dict[str, tuple[Shape, list[Slice], Transform | None]] = {}  # target -> (pre shape, slices, transform)
    for fqn, tensor in own.items():
        match = _LAYER.match(fqn)
        stacked = match.group(1) is None
        shape = tensor.true_shape
        if stacked and (not shape or shape[0] > most_layers):
            problems.append((fqn, f"'{fqn}': {shape[0] if shape else 'no'} stacked layers, expected at most "
                                  f"{most_layers} (the config's num_hidden_layers)"))
            continue
        layers = range(shape[0]) if stacked else (int(match.group(1)),)
        inner = shape[1:] if stacked else shape
        try:
            for layer in layers:
                lead = (layer,) if stacked else ()
                h = f"model.layers.{layer}."
                part = match.group(2)
                if part in _WHOLE:
                    specs.append(_whole(h + _WHOLE[part], fqn, lead, inner))
                else:
                    _expert(pieces, fqn, h, part, lead, inner, experts)
        except ConfigError as e:
            problems.append((fqn, str(e)))
    for name, (pre, slices, transform) in pieces.items():
        target = pre if transform is None else transform.target_shape(pre)
        specs.append(TargetSpec(name, target, tuple(slices), transform=transform))
    return specs, notes, problems


def _whole(name: str, source: str, lead: tuple[int, ...], shape: Shape) -> TargetSpec:
    src = Box((*lead, *(0 for _ in shape)), (*(1 for _ in lead), *shape))
    return TargetSpec(name, tuple(shape), (Slice(source, src, Box.whole(tuple(shape))),))


def _expert(pieces: dict[str, tuple[Shape, list[Slice], Transform | None]], fqn: str, h: str, part: str,
            lead: tuple[int, ...], shape: Shape, experts: int) -> None:
    """One layer's slab of an expert tensor (stacked ``[E, ...]`` or one expert's) as slices of its HF target's
    stacked pre tensor, with the transform that target needs.

    Raises:
        ConfigError: fc1 rows that do not halve, an expert index or count past the config's, a tensor of the wrong rank.
    """
    m = _EXPERT.match(part)
    per_expert = m.group(1) is not None
    kind, what = m.group(2), m.group(3)
    ids = (int(m.group(1)),) if per_expert else range(shape[0] if shape else 0)
    body = shape if per_expert else shape[1:]
    rank = 2 if what == "weight" else 1
    if len(body) != rank:
        raise ConfigError(f"'{fqn}': shape {list(shape)}, expected {'one expert' if per_expert else 'stacked experts'}"
                          f" of {rank} dim{'s' if rank > 1 else ''}")
    if not per_expert and shape[0] > experts:
        raise ConfigError(f"'{fqn}': {shape[0]} stacked experts, expected at most {experts} (the config's "
                          "num_local_experts)")
    if kind == "linear_fc1" and body[0] % 2:
        raise ConfigError(f"'{fqn}': {body[0]} rows cannot be split into gate and up halves (gpt-oss's fc1 is "
                          "[gate; up])")
    name = h + _EXPERT_TARGETS[(kind, what)]
    if kind == "linear_fc1":
        step = interleave(2, body[0], dim=1)
        transform = Chain((step, Transpose(1, 2))) if what == "weight" else step
    else:
        transform = Transpose(1, 2) if what == "weight" else None
    pre_shape, slices, _ = pieces.setdefault(name, ((experts, *body), [], transform))
    if pre_shape[1:] != tuple(body):
        raise ConfigError(f"'{fqn}': an expert of shape {list(body)}, another of this layer has {list(pre_shape[1:])}")
    for index, e in enumerate(ids):
        if e >= experts:
            raise ConfigError(f"'{fqn}': expert {e} is past the config's num_local_experts {experts}")
        at = (*lead, *(() if per_expert else (index,)))
        src = Box((*at, *(0 for _ in body)), (*(1 for _ in at), *body))
        slices.append(Slice(fqn, src, Box((e, *(0 for _ in body)), (1, *body))))


def megatron_args(args: Any, info: ModelInfo) -> list[str]:
    """What a Megatron-LM run's args must say for its checkpoint to compute gpt-oss, which no tensor shape betrays:
    the learnable softmax offset (the sinks), the clamped SwiGLU (``quick_geglu`` with ``glu_linear_offset`` 1 and
    ``activation_func_clamp_value`` = ``swiglu_limit``), the router's softmax after the top-k, and the sliding window
    (``window_size`` ``(sliding_window - 1, 0)``). An argument the args do not record is not compared.

    Returns:
        One line per disagreement, expected vs found.
    """
    config = info.config
    window = config.get("sliding_window")
    expected = {
        "softmax_type": ("learnable", "gpt-oss's attention sinks"),
        "quick_geglu": (True, "gpt-oss's clamped SwiGLU is quick_gelu(gate) * (up + 1)"),
        "swiglu": (False, "gpt-oss's experts use quick_geglu, not swiglu"),
        "glu_linear_offset": (1.0, "the + 1 of gpt-oss's up projection"),
        "activation_func_clamp_value": (config.get("swiglu_limit"), "config.json swiglu_limit"),
        "moe_router_pre_softmax": (False, "gpt-oss's router takes the softmax of its top-k logits"),
        "window_size": ((window - 1, 0) if isinstance(window, int) else None, "config.json sliding_window - 1"),
    }
    found = []
    for name, (want, why) in expected.items():
        got = args.get(name) if isinstance(args, dict) else getattr(args, name, None)
        got = tuple(got) if isinstance(got, list) else got
        if got is not None and want is not None and got != want:
            found.append(f"{name}: {want!r} expected ({why}), found {got!r} in the args")
    return found


ADAPTER = FamilyAdapter(
    NAME,
    tp_rules=(
        (r"\.self_attn\.sinks$", SHARD0),  # one per head: heads are cut like q_proj's rows
        (r"\.mlp\.router\.(weight|bias)$", REPLICATE),
        (r"\.self_attn\.o_proj\.bias$", REPLICATE),
        *HF_TP_RULES,
    ),
    # experts stay stacked on disk ([E, ...]): split --ep shards dim 0, as transformers' EP plan does (the biases too)
    stacked_experts=(r"\.mlp\.experts\.(?:gate_up_proj|down_proj)(?:_bias)?$",),
    # stored (E, in, out): transformers' GptOssExperts is_transposed=True, so PEFT's ParamWrapper does not swap
    transposed_experts=(r"\.mlp\.experts\.(?:gate_up_proj|down_proj)$",),
    cuts=((megatron_core.NAME, megatron_core_cut),),
    args_checks=(megatron_args,),
)

#: every decoder layer is MoE; ``layer_types`` (sliding or full attention) tells them apart
LAYERS = alike(NAME)
