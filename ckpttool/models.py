"""From a model config to target names and shapes, the way transformers itself saves them.

The expected tensors come from transformers, not from tables: the architecture is built from ``config.json``
on the meta device (no memory), which gives the in-memory names and global shapes; transformers' own
``revert_weight_conversion`` on those meta tensors gives the on-disk names and shapes ``save_pretrained``
writes; tied weights are dropped as ``save_pretrained`` drops them.

What ckpttool adds is how to cut an in-memory tensor into on-disk tensors *as boxes* (so no tensor is
materialised): the rules below, one per family. Every plan is checked against transformers' on-disk names and
shapes, so a wrong rule is an error, never a silently wrong checkpoint.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .diagnose import Diagnosis, diagnose, refusal_advice
from . import jsonfile
from .errors import ConfigError, SourceError
from .layout import Box, Layout, Shape, TensorLayout
from .paths import JSON_LIMIT, link_escapes, read_source
from .plan import Slice, TargetSpec, tensor_specs

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ModelInfo:
    """What transformers says a model built from this config looks like.

    Attributes:
        model_type: ``config.model_type``.
        config: the config as a plain dict.
        memory_shapes: in-memory state-dict names -> global shapes (what DCP and FSDP save).
        disk_shapes: on-disk names -> shapes (what ``save_pretrained`` writes), tied weights removed.
        tied: tied target name -> the name it shares storage with (e.g. ``lm_head.weight``).
        family: the key of :data:`RULES` that cuts this model's tensors, following transformers' aliases.
    """

    model_type: str
    config: Mapping[str, object]
    memory_shapes: Mapping[str, Shape]
    disk_shapes: Mapping[str, Shape]
    tied: Mapping[str, str] = field(default_factory=dict)
    family: str | None = None


@dataclass(frozen=True, slots=True)
class Rename:
    """An in-memory name that ``save_pretrained`` writes under another name."""

    pattern: str
    replacement: str


@dataclass(frozen=True, slots=True)
class Unstack:
    """A stacked expert tensor ``(E, k*n, ...)`` saved as ``k`` tensors ``(n, ...)`` per expert.

    ``names`` are templates with ``{prefix}`` (the pattern's first group) and ``{expert}``; part ``i`` of an
    expert is rows ``i*n .. (i+1)*n`` of that expert's slab (e.g. ``gate_up_proj`` = [gate; up]).
    """

    pattern: str
    names: tuple[str, ...]


#: How transformers 5 stores MoE experts in memory (stacked) versus on disk (one tensor per expert).
RULES: dict[str, tuple[Rename | Unstack, ...]] = {
    "mixtral": (
        Rename(r"^(.*)\.mlp\.gate\.weight$", r"\1.block_sparse_moe.gate.weight"),
        Unstack(
            r"^(.*)\.mlp\.experts\.gate_up_proj$",
            ("{prefix}.block_sparse_moe.experts.{expert}.w1.weight", "{prefix}.block_sparse_moe.experts.{expert}.w3.weight"),
        ),
        Unstack(r"^(.*)\.mlp\.experts\.down_proj$", ("{prefix}.block_sparse_moe.experts.{expert}.w2.weight",)),
    ),
    "qwen2_moe": (
        Unstack(
            r"^(.*)\.mlp\.experts\.gate_up_proj$",
            ("{prefix}.mlp.experts.{expert}.gate_proj.weight", "{prefix}.mlp.experts.{expert}.up_proj.weight"),
        ),
        Unstack(r"^(.*)\.mlp\.experts\.down_proj$", ("{prefix}.mlp.experts.{expert}.down_proj.weight",)),
    ),
}


def find_config(source: Path, explicit: str | Path | None) -> Path | None:
    """The ``config.json`` to use: ``explicit`` (a file or an HF directory), else in the source, in its
    ``huggingface/`` directory (where verl writes it), or next to the source.

    A ``config.json`` found in a directory must not be a symlink out of it (:func:`paths.link_escapes`).

    Raises:
        ConfigError: ``explicit`` names no config, or a ``config.json`` found is a symlink out of its directory.
    """
    if explicit is not None:
        path = Path(explicit)
        if path.is_dir():
            path = _refuse_link_out(path / "config.json", path)
        if not path.is_file():
            raise ConfigError(f"config '{explicit}' not found (give a config.json file or a directory holding one)")
        return path
    for candidate, folder in ((source / "config.json", source), (source / "huggingface" / "config.json", source),
                              (source.parent / "config.json", source.parent)):
        if candidate.is_file():
            return _refuse_link_out(candidate, folder)
    return None


def _refuse_link_out(path: Path, folder: Path) -> Path:
    target = link_escapes(path, folder)
    if target is not None:
        raise ConfigError(f"'{path}' is a symlink to '{target}', outside '{folder}'; ckpttool follows no link out of "
                          "the checkpoint. Copy the config in its place, or name that file itself as the config")
    return path


def read_config(path: Path) -> dict[str, object]:
    try:
        config = jsonfile.loads(read_source(path, limit=JSON_LIMIT))
    except SourceError as e:  # not a regular file, unreadable: the message names the file
        raise ConfigError(str(e)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"'{path}': cannot read the config: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"'{path}': the config is not a JSON object")
    return config


def model_info(config: Mapping[str, object], *, label: str = "config.json") -> ModelInfo | None:
    """Build the architecture on the meta device and read its expected tensors; None if transformers lacks it.

    The answer depends only on the config and the transformers version, and importing transformers takes
    seconds, so it is kept in a cache (``CKPTTOOL_CACHE``, default ``~/.cache/ckpttool``) keyed by both.

    Raises:
        ConfigError: transformers knows the model type but cannot build it from this config.
    """
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"'{label}': no model_type; is it a transformers config?")
    cache = _cache_path(config)
    cached = _read_cache(cache, config) if cache is not None else None
    if cached is not None:
        return cached[0]
    info = _build(model_type, config, label)
    if cache is not None:
        _write_cache(cache, info)
    return info


def _build(model_type: str, config: Mapping[str, object], label: str) -> ModelInfo | None:
    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        log.info("transformers %s does not know model_type %r", transformers.__version__, model_type)
        return None
    try:
        cfg = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    except Exception as e:  # transformers validates configs with several exception types
        raise ConfigError(f"'{label}': transformers rejects this {model_type} config: {e}") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except ValueError:
        return None  # a model type transformers knows, but with no causal-LM head: stay generic
    except Exception as e:
        raise ConfigError(f"'{label}': transformers cannot build a {model_type} model from it: {e}") from None
    state = model.state_dict()
    memory = {k: tuple(v.shape) for k, v in state.items()}
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    try:
        from transformers.core_model_loading import revert_weight_conversion

        disk_state = revert_weight_conversion(model, dict(state))
    except ImportError:  # transformers < 5: memory names are the disk names
        disk_state = state
    disk = {k: tuple(v.shape) for k, v in disk_state.items() if k not in tied}
    return ModelInfo(model_type, dict(config), memory, disk, tied, _family(model_type))


def _cache_path(config: Mapping[str, object]) -> Path | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        key = json.dumps({"transformers": version("transformers"), "config": config}, sort_keys=True, default=str)
    except (PackageNotFoundError, TypeError, ValueError):
        return None
    root = Path(os.environ.get("CKPTTOOL_CACHE") or Path.home() / ".cache" / "ckpttool")
    return root / "models" / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def _read_cache(path: Path, config: Mapping[str, object]) -> tuple[ModelInfo | None] | None:
    """``(info,)`` from the cache (``info`` may be None: no causal LM), or None when there is no usable entry."""
    try:
        doc = jsonfile.loads(path.read_text())
        if doc is None or doc.get("none"):
            return (None,) if doc is not None else None
        shapes = lambda m: {k: tuple(int(n) for n in v) for k, v in m.items()}  # noqa: E731
        return (ModelInfo(doc["model_type"], dict(config), shapes(doc["memory"]), shapes(doc["disk"]),
                          dict(doc["tied"]), doc.get("family")),)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def _write_cache(path: Path, info: ModelInfo | None) -> None:
    doc = {"none": True} if info is None else {
        "model_type": info.model_type, "memory": info.memory_shapes, "disk": info.disk_shapes, "tied": info.tied,
        "family": info.family,
    }
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(doc))
        os.replace(temporary, path)
    except OSError as e:  # a read-only home: no cache, same answers
        log.info("cannot cache the model description in %s: %s", path.parent, e)


def _family(model_type: str) -> str | None:
    """The key of :data:`RULES` for this model type, following transformers' own aliases (e.g. qwen3_moe)."""
    if model_type in RULES:
        return model_type
    try:
        from transformers.conversion_mapping import _MODEL_TO_CONVERSION_PATTERN as aliases
    except ImportError:
        return None
    alias = aliases.get(model_type)
    return alias if alias in RULES else None


@dataclass(frozen=True, slots=True)
class HfMapping:
    """A layout's tensors under the on-disk HuggingFace names of ``info``'s architecture, not yet checked.

    Attributes:
        specs: the targets, tied weights excluded.
        tied: targets ``save_pretrained`` would drop because they are tied (e.g. ``lm_head.weight``).
        notes: what was done for the user (a stripped wrapper prefix).
        problems: ``(source tensor, message)`` for tensors the family's rules cannot cut.
    """

    specs: list[TargetSpec]
    tied: list[TargetSpec]
    notes: list[str]
    problems: list[tuple[str, str]]


def map_to_hf(layout: Layout, info: ModelInfo) -> HfMapping:
    """The layout's tensors under on-disk HuggingFace names: the reader's own cut when its format has one
    (``to_hf``, e.g. Megatron's fused QKV); else in-memory names (DCP, FSDP, transformers distributed) cut by
    the family's rules, on-disk names passed through, and a wrapper prefix (``model.``/``module.``) stripped."""
    from .readers import READERS  # a reader may own its format's cut; imported here (readers import models)

    cut = getattr(READERS.get(layout.format), "to_hf", None)
    if cut is not None:
        specs, notes, problems = cut(layout, info)
    else:
        specs, notes, problems = _generic_cut(layout, info)
    tied = [s for s in specs if s.name in info.tied]
    return HfMapping([s for s in specs if s.name not in info.tied], tied, notes, problems)


def _generic_cut(layout: Layout, info: ModelInfo) -> tuple[list[TargetSpec], list[str], list[tuple[str, str]]]:
    notes: list[str] = []
    prefix = _wrapper_prefix(layout, info)
    if prefix:
        notes.append(f"stripped the prefix '{prefix}' the training loop put before every tensor name")
    rules = RULES.get(info.family or "", ())
    specs: list[TargetSpec] = []
    problems: list[tuple[str, str]] = []
    for tensor in layout.tensors.values():
        try:
            specs.extend(_specs_for(tensor, tensor.fqn[len(prefix):], rules))
        except ConfigError as e:
            problems.append((tensor.fqn, str(e)))
    return specs, notes, problems


def hf_specs(layout: Layout, info: ModelInfo) -> tuple[list[TargetSpec], list[str]]:
    """The targets of a HuggingFace checkpoint of ``info``'s architecture made from ``layout``, checked
    against what transformers expects on disk. Tied weights are dropped, as ``save_pretrained`` drops them.

    Returns:
        The target specs and notes for the user.

    Raises:
        ConfigError: missing, unexpected or wrongly shaped tensors, all listed, with the likely cause.
    """
    mapping = map_to_hf(layout, info)
    notes = list(mapping.notes)
    if mapping.tied:
        dropped = [s.name for s in mapping.tied]
        notes.append(f"dropped {', '.join(dropped)}: tied to {', '.join(info.tied[n] for n in dropped)} (as save_pretrained does)")
    problems = [message for _, message in mapping.problems]
    mismatches = compare_with_model({s.name: s.shape for s in mapping.specs}, info)
    problems.extend(m.message() for m in mismatches)
    padded = any(m.diagnosis is not None and m.diagnosis.code.startswith("vocab-padding") for m in mismatches)
    if problems:
        raise ConfigError(
            f"the checkpoint in '{layout.root}' does not match its {info.model_type} config "
            f"({len(problems)} problem{'s' if len(problems) != 1 else ''}):\n"
            + "\n".join(f"  - {p}" for p in problems[:40])
            + (f"\n  ... and {len(problems) - 40} more" if len(problems) > 40 else "")
            + "\n" + refusal_advice(m.diagnosis.code for m in mismatches if m.diagnosis is not None)
            + (" ckpttool strips padding the source recorded (sidecar 'padding') and never guesses it."
               if padded else "")
        )
    return mapping.specs, notes


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One difference between a checkpoint's tensors and the architecture.

    ``kind`` is ``"missing"`` (expected, not there), ``"unexpected"`` (there, not expected) or ``"shape"``;
    ``diagnosis`` explains a wrong shape.
    """

    kind: str
    name: str
    shape: Shape | None
    expected: Shape | None
    model_type: str
    diagnosis: Diagnosis | None = None

    def message(self) -> str:
        if self.kind == "missing":
            return f"'{self.name}': expected by the config but not in the checkpoint"
        if self.kind == "unexpected":
            return f"'{self.name}': not a tensor of a {self.model_type} model built from this config"
        assert self.shape is not None and self.expected is not None and self.diagnosis is not None
        return (
            f"'{self.name}': shape {list(self.shape)}, but the config gives {list(self.expected)} "
            f"({self.diagnosis.text})"
        )


def compare_with_model(shapes: Mapping[str, Shape], info: ModelInfo) -> list[Mismatch]:
    """Every tensor of ``shapes`` (on-disk names) that the architecture does not expect, or expects with
    another shape, then every expected tensor that is missing; wrong shapes come with a diagnosis."""
    vocab = info.config.get("vocab_size")
    vocab = vocab if isinstance(vocab, int) else None
    vocab_rows = {
        name: shapes[name][0] for name, expected in info.disk_shapes.items()
        if vocab and expected and expected[0] == vocab and name in shapes and shapes[name]
    }
    found: list[Mismatch] = []
    for name, shape in shapes.items():
        expected = info.disk_shapes.get(name)
        if expected is None:
            found.append(Mismatch("unexpected", name, tuple(shape), None, info.model_type))
        elif tuple(expected) != tuple(shape):
            why = diagnose(name, tuple(shape), tuple(expected), vocab, vocab_rows)
            found.append(Mismatch("shape", name, tuple(shape), tuple(expected), info.model_type, why))
    found.extend(
        Mismatch("missing", name, None, tuple(expected), info.model_type)
        for name, expected in info.disk_shapes.items() if name not in shapes
    )
    return found


def _wrapper_prefix(layout: Layout, info: ModelInfo) -> str:
    """'' normally; 'model.' when a loop saved ``{"model": state_dict}`` and every name carries it."""
    known = set(info.memory_shapes) | set(info.disk_shapes)
    names = list(layout.tensors)
    if not names or any(n in known for n in names):
        return ""
    for prefix in ("model.", "module."):
        if all(n.startswith(prefix) for n in names) and any(n[len(prefix):] in known for n in names):
            return prefix
    return ""


def _specs_for(tensor: TensorLayout, name: str, rules: tuple[Rename | Unstack, ...]) -> list[TargetSpec]:
    for rule in rules:
        match = re.match(rule.pattern, name)
        if match is None:
            continue
        if isinstance(rule, Rename):
            return tensor_specs(tensor, match.expand(rule.replacement))
        return _unstack(tensor, match.group(1), rule)
    return tensor_specs(tensor, name)


def _unstack(tensor: TensorLayout, prefix: str, rule: Unstack) -> list[TargetSpec]:
    shape = tensor.true_shape
    parts = len(rule.names)
    if len(shape) < 2 or shape[1] % parts:
        raise ConfigError(
            f"'{tensor.fqn}': shape {list(shape)} cannot be split into {parts} per-expert parts along dim 1"
        )
    experts, rows, rest = shape[0], shape[1], shape[2:]
    n = rows // parts
    specs = []
    for e in range(experts):
        for i, template in enumerate(rule.names):
            src = Box((e, i * n, *(0 for _ in rest)), (1, n, *rest))
            out_shape = (n, *rest)
            name = template.format(prefix=prefix, expert=e)
            specs.append(TargetSpec(name, out_shape, (Slice(tensor.fqn, src, Box.whole(out_shape)),)))
    return specs
