"""Megatron-Core LoRA saved with its base (Megatron-Bridge's ``megatron.bridge.peft.LoRA``, as NeMo 2's), mapped to
the PEFT adapter of the HuggingFace model the base merges to.

Megatron-Bridge wraps each targeted ``linear_qkv`` / ``linear_proj`` / ``linear_fc1`` / ``linear_fc2`` in
``LoRALinear(to_wrap, adapter)``, and its ``sharded_state_dict`` saves, beside the base under its plain name::

    decoder.layers.self_attention.linear_qkv.adapter.linear_in.weight    A (dim, in), layers stacked on dim 0
    decoder.layers.self_attention.linear_qkv.adapter.linear_out.weight   B (out, dim), rows in the base's layout

``LoRAMerge`` computes ``W + alpha / dim * (linear_out @ linear_in)`` on Megatron's layout: the rows of a fused QKV
interleaved by query group, fc1 as [gate; up]. Every row of that delta is one row of B times A, so the delta of
HuggingFace's ``q_proj`` is ``q_proj``'s rows of B times A: B is planned exactly as the base is
(:func:`bridge_targets`: the family's own plan of the base, given B under the base's name, says which rows of B make
``q_proj``, ``k_proj``, ``gate_proj``, ...), and A, whole for every target a module makes, is cut per layer by the plan
of a module whose plan moves no row (``linear_proj`` -> ``o_proj``). Nothing here knows a row map: the family's does.
The pairs are then a PEFT adapter of the HuggingFace model (keys ``<hf module>.lora_A.weight`` / ``lora_B.weight``),
fused through the same streamed ``lora-add`` path and exported by ``--adapter-only`` as PEFT's are.

Refused by name: DoRA (``adapter.weight_magnitude``), canonical LoRA (``adapter.adapter_q`` ...), LoRA on MoE experts,
a module other than the four, and any other adapter tensor.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace

from pathlib import Path

from ckpttool.errors import SourceError
from ckpttool.layout.layout import Layout, TensorLayout
from ckpttool.lora.adapter import check_positive, read_adapter_config, read_json_object
from ckpttool.plan.plan import Target
from ckpttool.plan.transforms import Permute

#: Megatron-Bridge's (and NeMo's) LoRA on a Megatron-Core module, saved with the base
BRIDGE = re.compile(r"(?P<module>.+\.(?P<kind>linear_qkv|linear_proj|linear_fc1|linear_fc2))\.adapter\."
                    r"linear_(?P<which>in|out)\.weight")
#: what else a Megatron-Core module's adapter may save, and why ckpttool does not fuse it
_REFUSED = (
    (re.compile(r"\.adapter\.weight_magnitude$"), "DoRA's weight_magnitude (Megatron-Bridge's DoRA): DoRA is not fused"),
    (re.compile(r"\.adapter\.adapter_(q|k|v|gate|up)\."), "canonical LoRA (Megatron-Bridge's CanonicalLoRA: one adapter "
     "per q / k / v and gate / up) is not fused yet"),
    (re.compile(r"\.experts\..*\.adapter\."), "LoRA on MoE experts (Megatron-Bridge) is not fused yet"),
)
#: a module whose plan moves no row: its target is the module's weight of one layer, as stored
_CARRIER = "linear_proj"
#: the name a Megatron-Bridge adapter goes by in messages and notes
NAME = "megatron-bridge"

#: plans tensors under the base's names (the base's layout otherwise) to the HF targets the family makes of them
Planner = Callable[[Mapping[str, TensorLayout]], Sequence[Target]]


def is_bridge(fqn: str) -> bool:
    """Whether ``fqn`` is a Megatron-Core module's adapter tensor (Megatron-Bridge / NeMo)."""
    return ".adapter." in fqn and fqn.rsplit(".adapter.", 1)[0].rsplit(".", 1)[-1].startswith("linear_")


def split_bridge(layout: Layout) -> tuple[Layout, dict[str, TensorLayout]] | None:
    """``layout`` without its Megatron-Bridge LoRA tensors, and those tensors by their names; None when it holds none.

    Raises:
        SourceError: an adapter tensor ckpttool does not fuse (DoRA, canonical LoRA, expert LoRA, another module),
            or a module with linear_in and no linear_out (or the reverse), naming the tensor.
    """
    found = {fqn: t for fqn, t in layout.tensors.items() if is_bridge(fqn)}
    if not found:
        return None
    for fqn in found:
        for pattern, why in _REFUSED:
            if pattern.search(fqn):
                raise SourceError(f"'{layout.root}': '{fqn}': {why}; merge it into the base with Megatron-Bridge's "
                                  "own merge (LoRAMerge, DoRA's merge) before saving")
        if BRIDGE.fullmatch(fqn) is None:
            raise SourceError(f"'{layout.root}': '{fqn}': a Megatron-Core adapter tensor ckpttool does not fuse "
                              "(it fuses LoRA's adapter.linear_in / linear_out on linear_qkv, linear_proj, linear_fc1 "
                              "and linear_fc2)")
    for fqn in found:
        module, which = BRIDGE.fullmatch(fqn).group("module", "which")  # type: ignore[union-attr]
        other = f"{module}.adapter.linear_{'out' if which == 'in' else 'in'}.weight"
        if other not in found:
            raise SourceError(f"'{layout.root}': '{fqn}' has no '{other}': a LoRA module needs both")
        if f"{module}.weight" not in layout.tensors:
            raise SourceError(f"'{layout.root}': '{fqn}': the base's '{module}.weight' is not in the checkpoint")
    base = {fqn: t for fqn, t in layout.tensors.items() if fqn not in found}
    note = (f"a Megatron-Core LoRA adapter (Megatron-Bridge's adapter.linear_in / linear_out, {len(found)} tensors) "
            "saved with the base: set aside from the base")
    return replace(layout, tensors=base, notes=(*layout.notes, note)), found


def bridge_targets(root: str, lora: Mapping[str, TensorLayout], plan: Planner) -> dict[str, tuple[Target, str]]:
    """Per PEFT adapter-file key of the HuggingFace model (``model.layers.0.self_attn.q_proj.lora_B.weight``), the
    target that reads it from the source and the source's name of the tensor: B through the base's own plan (``q_proj``'s rows of ``linear_qkv``'s B),
    A (``linear_in``) whole for each target its module makes, cut per layer by the plan of :data:`_CARRIER`.

    Raises:
        SourceError: the base's plan makes no target of a module's B, A's plan is not one target per layer, or a
            plan transforms more than B's rows (a permutation of columns would mix B's rank), naming the tensor.
    """
    modules = sorted({BRIDGE.fullmatch(fqn)["module"] for fqn in lora})  # type: ignore[index]
    found: dict[str, tuple[Target, str]] = {}
    for module in modules:
        b = lora[f"{module}.adapter.linear_out.weight"]
        a = lora[f"{module}.adapter.linear_in.weight"]
        b_targets = plan(_as(b, f"{module}.weight"))
        carrier = module.rsplit(".", 1)[0].rsplit(".", 1)[0] + f".self_attention.{_CARRIER}.weight"
        a_targets = plan(_as(a, carrier))
        if not b_targets:
            raise SourceError(f"'{root}': '{b.fqn}': the base's plan makes no HuggingFace tensor of it")
        by_layer = {_layer_of(t.name): t for t in a_targets}
        for target in (*b_targets, *a_targets):
            moves = target.transform
            if moves is not None and not (target in b_targets and isinstance(moves, Permute) and moves.dim == 0):
                raise SourceError(f"'{root}': '{b.fqn if target in b_targets else a.fqn}': planned as "
                                  f"'{target.name}', which the base's plan makes with {moves.name}; only a "
                                  "permutation of B's rows keeps B @ A the delta of that tensor, so it is not fused")
        for target in b_targets:
            hf = target.name.removesuffix(".weight")
            a_target = by_layer.get(_layer_of(target.name))
            if a_target is None or len(by_layer) != len(a_targets):
                raise SourceError(f"'{root}': '{a.fqn}': no layer's A for '{target.name}' (its layers are not "
                                  "planned one target each)")
            found[f"{hf}.lora_A.weight"] = (replace(a_target, name=f"{hf}.lora_A.weight"), a.fqn)
            found[f"{hf}.lora_B.weight"] = (replace(target, name=f"{hf}.lora_B.weight"), b.fqn)
    return found


def _as(tensor: TensorLayout, name: str) -> dict[str, TensorLayout]:
    """``tensor`` under the base's name ``name``, so the family plans it as it plans that weight."""
    return {name: replace(tensor, fqn=name)}


def _layer_of(name: str) -> str:
    """The layer a HuggingFace name is in (``model.layers.3.``), or the name itself outside the layers."""
    found = re.search(r"\.layers\.\d+\.", name)
    return name[:found.end()] if found else name


def bridge_config(path: Path, targets: Mapping[str, tuple[Target, str]]) -> dict[str, object]:
    """The PEFT adapter config of a Megatron-Core LoRA, from ``path``: Megatron-Bridge's own LoRA fields ``dim`` and
    ``alpha`` (those of its ``LoRA(...)``, as its run's ``run_config.yaml`` records them under ``peft``, in a JSON
    object), or a PEFT ``adapter_config.json`` stating ``r`` and ``lora_alpha``. Megatron-Bridge scales by
    ``alpha / dim`` (its ``LoRAMerge`` and ``LoRALinear``), which is PEFT's ``lora_alpha / r``; ``target_modules``
    are the HuggingFace modules ``targets`` makes (``q_proj``, ...).

    Raises:
        SourceError: not JSON, ``dim`` / ``alpha`` (or ``r`` / ``lora_alpha``) missing or not positive, or rsLoRA /
            patterns, which Megatron-Bridge's LoRA does not have; naming the file.
    """
    found = read_json_object(path, "a JSON LoRA config")
    keys = ("dim", "alpha") if "dim" in found or "alpha" in found else ("r", "lora_alpha")
    check_positive(found, keys, path, "a Megatron-Core LoRA's scaling is alpha / dim: give Megatron-Bridge's LoRA dim "
                   "and alpha, or PEFT's r and lora_alpha")
    if keys == ("r", "lora_alpha"):
        config = read_adapter_config(path)
        for key in ("use_rslora", "rank_pattern", "alpha_pattern"):
            if config.get(key):
                raise SourceError(f"'{path}': {key} = {config[key]!r}; Megatron-Bridge's LoRA has one dim and alpha "
                                  "for every module, scaled alpha / dim")
        rank, alpha = config["r"], config["lora_alpha"]
    else:
        rank, alpha = found["dim"], found["alpha"]
    modules = sorted({key.rsplit(".lora_", 1)[0].rsplit(".", 1)[-1] for key in targets})
    return {"peft_type": "LORA", "r": rank, "lora_alpha": alpha, "bias": "none", "task_type": "CAUSAL_LM",
            "target_modules": modules}
