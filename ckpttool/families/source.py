"""The one way from a layout to a plan, used by merge, audit, diff, split and live: the commands' bridge to the
families (:func:`ckpttool.commands.source.plan_source` reads the source and its config, then calls
:func:`plan_layout`).

layout + config + options -> :class:`Planned`: the layout (what the reader found), the family's mapping of it
to HuggingFace names (:mod:`ckpttool.families`), and the coverage-checked plan, with everything that does not
fit kept as data: tensors the adapter cannot place, mismatches against transformers, targets not covered
exactly once. A merge refuses on any of them (:meth:`Planned.refuse`); the audit turns each into findings.
Reads no tensor data.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import Layout
from ckpttool.plan.plan import Plan, Target, TargetSpec, identity_specs, plan_covered
from ckpttool.errors import ArgumentError, ConfigError, CoverageError
from ckpttool.families import (
    Mismatch,
    adapter_for,
    compare_with_model,
    convention_of,
    keeps_dtype,
    map_to_hf,
    mtp_absent,
    mtp_missing_note,
    refusal,
    tied_on_disk,
)
from ckpttool.families.buffers import message as historical_message
from ckpttool.families.buffers import note as historical_note
from ckpttool.families.buffers import split_historical
from ckpttool.families.quantize import quantized_specs
from ckpttool.families.quantize_packed import PackScheme
from ckpttool.families.quantized import dequantized, with_quantized
from ckpttool.families.quantized import problems as quantization_problems
from ckpttool.families.quantized import refusal as quantization_refusal
from ckpttool.quant.checks import Problem
from ckpttool.quant.formats import MXFP4, read_quantization
from ckpttool.console.startup import planned


@dataclass(frozen=True, slots=True)
class Planned:
    """A source under its family's names, planned.

    Attributes:
        layout: what the reader found.
        config_path, config, model: the config used (None: a generic plan) and what transformers says of it.
        plan: every target tiled exactly once (targets that are not are left out and listed in ``uncovered``).
        tied: targets ``save_pretrained`` drops because they are tied (not in ``plan``).
        adapter: the family adapter used, in words; ``generic (...)`` when names are kept as recorded.
        adapter_notes: what the adapter did for the user (a stripped wrapper prefix, vocab padding stripped).
        unplaced: ``(source tensor, message)`` for tensors the adapter cannot place.
        mismatches: the plan's names and shapes against the architecture.
        uncovered: ``(target, problems)`` for targets with a gap, an overlap or a piece out of bounds.
        quantization: what is wrong with a quantized checkpoint (scales, block size, quantization_config).
        mtp_missing: the MTP layers the config declares that the source does not hold at all (indices of
            ``model.layers``): not a refusal, a note on the plan and an ``mtp-missing`` warning in an audit.
        historical: ``(tensor, message)`` for the historical non-persistent buffers left out of the plan
            (:mod:`ckpttool.families.buffers`): a note on the plan, a ``tensor-unexpected`` warning in an audit.
    """

    layout: Layout
    config_path: Path | None
    config: dict[str, object] | None
    model: ModelInfo | None
    plan: Plan
    tied: tuple[TargetSpec, ...]
    adapter: str
    adapter_notes: tuple[str, ...] = ()
    unplaced: tuple[tuple[str, str], ...] = ()
    mismatches: tuple[Mismatch, ...] = ()
    uncovered: tuple[tuple[TargetSpec, list[str]], ...] = ()
    mtp_missing: tuple[int, ...] = ()
    quantization: tuple[Problem, ...] = ()
    historical: tuple[tuple[str, str], ...] = ()
    #: the family's targets before they were planned (quantized weights and scales apart), when asked for
    #: (``keep_specs``: the audit's :func:`dequantized_targets`); None otherwise (a merge frees them)
    specs: tuple[TargetSpec, ...] | None = None

    @property
    def generic(self) -> bool:
        """No architecture was mapped: names are kept as the source recorded them."""
        return self.model is None

    @property
    def raw_names(self) -> str | None:
        """The source convention whose names a generic plan keeps (``"Megatron-Core"``): names transformers
        loads under no config. None for a mapped plan, or a source holding transformers' own names."""
        return convention_of(self.layout) if self.generic else None

    def refuse(self) -> None:
        """Raise what a merge refuses: tensors that do not fit the config, then targets not covered exactly once.

        Raises:
            ConfigError: unplaced tensors or mismatches, all listed, with the likely cause.
            CoverageError: every coverage problem of every target.
        """
        if self.model is not None and (self.unplaced or self.mismatches):
            raise refusal(self.layout, self.model, [m for _, m in self.unplaced], list(self.mismatches))
        if self.quantization:
            raise quantization_refusal(self.layout, self.quantization)
        if self.uncovered:
            raise CoverageError([problem for _, problems in self.uncovered for problem in problems])

    def refuse_raw_names(self) -> None:
        """Raise for a generic plan of names transformers cannot load (:attr:`raw_names`): what a merge refuses
        unless asked for those names (merge's ``raw_names``). Not part of :meth:`refuse`: an audit, a diff or a
        split reads such a source as it is, and writes nothing transformers is meant to load.

        Raises:
            ConfigError: the convention, why nothing maps its names, and what to pass.
        """
        convention = self.raw_names
        if convention is None:
            return
        if self.config is None:
            why = "no config.json was found in or next to it"
        else:
            why = f"transformers has no causal LM for the model_type {self.config.get('model_type')!r} of '{self.config_path}'"
        raise ConfigError(
            f"'{self.layout.root}': its tensors are named in the {convention} convention, not HuggingFace's, and {why}, "
            "so a merge would write names transformers cannot load. Pass config='path/to/config.json' (the config of "
            f"the HuggingFace model) to write HuggingFace names, or raw_names=True to keep the {convention} names"
        )


def plan_layout(
    layout: Layout, *, config_path: Path | None, config: dict[str, object] | None, model: ModelInfo | None,
    dtype: str | None = None, notes: Iterable[str] = (), no_config: str = "no config.json found",
    quantize: tuple[int, int] | str | PackScheme | None = None, keep_specs: bool = False, drop: Sequence[str] = (),
) -> Planned:
    """Map ``layout`` to HuggingFace names with its family's adapter (``model`` given) or keep its names
    (generic), and plan every target; ``dtype`` is a safetensors name to cast floating tensors to (except the
    tensors the families keep, :func:`~ckpttool.families.keeps_dtype`); ``notes`` follow the plan's own;
    ``no_config`` says why there is no config, for the generic note. A quantized source is kept quantized, or
    dequantized to ``dtype`` when one is given (:mod:`ckpttool.families.quantized`); a plain one is quantized to
    FP8 in ``quantize`` blocks when given, or to MXFP4 when ``quantize`` is ``"mxfp4"``
    (:mod:`ckpttool.families.quantize`). ``keep_specs`` keeps the mapped
    targets on the result (:attr:`Planned.specs`). The model's non-persistent buffers, which ``save_pretrained``
    never writes but some savers do, are dropped with a note; so are the tensors whose (mapped) names match a
    ``drop`` pattern (a name or a regular expression, matched whole), each pattern matching at least one.

    Raises:
        ArgumentError: a ``drop`` pattern that is no regular expression, or that matches no tensor."""
    quant = read_quantization(config, str(config_path or "config.json")) if config is not None else None
    if model is None:
        specs = identity_specs(layout)
        why = no_config if config is None else f"transformers has no causal LM for model_type {config.get('model_type')!r}"
        adapter = f"generic ({why})"
        own = [f"generic merge ({why}): tensor names kept as the source recorded them"]
        adapter_notes: list[str] = []
        unplaced: list[tuple[str, str]] = []
        mismatches: list[Mismatch] = []
        tied: list[TargetSpec] = []
        mtp_missing: list[int] = []
        specs, _, historical = _historical(specs, [], own)
        specs, _ = _dropped(specs, [], drop, own)
    else:
        mapping = map_to_hf(layout, model)
        specs, tied, unplaced, adapter = mapping.specs, mapping.tied, mapping.problems, mapping.adapter
        adapter_notes = list(mapping.notes)
        buffers = [s.name for s in specs if s.name in model.buffers and s.name not in model.disk_shapes]
        if buffers:  # a note the audit reports too: merge and audit agree on what was left out
            specs = [s for s in specs if s.name not in set(buffers)]
            adapter_notes.append(f"dropped {_listed(buffers)}: {'buffers' if len(buffers) > 1 else 'a buffer'} the "
                                 f"{model.model_type} model does not save (non-persistent), written by the saver anyway")
        own = list(adapter_notes)
        specs, unplaced, historical = _historical(specs, unplaced, own)
        if tied:
            dropped = [s.name for s in tied]
            own.append(f"dropped {', '.join(dropped)}: tied to {', '.join(tied_on_disk(model)[n] for n in dropped)} "
                         "(as save_pretrained does)")
        specs, unplaced = _dropped(specs, unplaced, drop, own)
        shapes = {s.name: s.shape for s in specs}
        carried = _carried(shapes, model)
        if carried:  # a release's tensors the class ignores on load: kept, not compared with the architecture
            shapes = {name: shape for name, shape in shapes.items() if name not in carried}
            own.append(f"carried {_listed(carried)} unchecked: the {model.model_type} model transformers builds "
                       "ignores them on load (a release keeps them, e.g. its MTP module)")
        mismatches = compare_with_model(shapes, with_quantized(model, specs, quant, shapes=shapes))
        mtp_missing = mtp_absent([s.name for s in specs], model)
        if mtp_missing:
            own.append(mtp_missing_note(mtp_missing, model))
    mapped = tuple(specs) if keep_specs else None
    quant_problems = quantization_problems(specs, layout, quant, has_config=config is not None, dequantize=dtype is not None)
    if dtype is not None and quant is not None and not quant_problems:
        specs = dequantized(specs, layout, quant)
        own.append(f"dequantized the {quant.describe()} weights to {dtype}; no scale and no quantization_config "
                   "are written")
    if quantize is not None:
        specs = quantized_specs(specs, layout, quantize, source=layout.root, quant=quant, has_model=model is not None,
                                model_type=model.model_type if model is not None else None)
        if quantize == MXFP4:
            own.append("quantized the experts to MXFP4 (gpt-oss's release layout: _blocks and E8M0 _scales per 32 "
                       "inputs); every other tensor kept, in the merge's dtype")
        elif isinstance(quantize, PackScheme) and quantize.release is not None:
            own.append(f"re-packed the weights '{quantize.release.root}' packs as it packs them, "
                       f"{quantize.release.quant.describe()}, with its scales, zero points and global scales (copied, "
                       "as are its weight_shape and activation scales) and its quantization_config; every other "
                       "tensor kept")
        elif isinstance(quantize, PackScheme):
            own.append(f"packed the Linear weights of the decoder layers to compressed-tensors {quantize.describe()}; "
                       "norms, embeddings, lm_head, routers and biases kept")
        else:
            own.append(f"quantized the Linear weights of the decoder layers to FP8 E4M3 in {quantize[0]}x{quantize[1]} "
                       "blocks with float32 weight_scale_inv; norms, embeddings, lm_head, routers and biases kept")
    specs = sorted(specs, key=_natural_name)
    keep = {s.name for s in specs if keeps_dtype(s.name)} if dtype is not None else set()
    plan, uncovered = plan_covered(layout, specs, dtype=dtype, notes=[*own, *notes], keep_dtype=keep)
    planned()  # the command's collector runs again, and never walks this plan (ckpttool.console.startup)
    return Planned(layout, config_path, config, model, plan, tuple(tied), adapter, tuple(adapter_notes), tuple(unplaced),
                   tuple(mismatches), tuple(uncovered), tuple(mtp_missing), quantization=tuple(quant_problems), specs=mapped,
                   historical=tuple(historical))


def _carried(shapes: dict[str, object], model: ModelInfo) -> list[str]:
    """The targets the model's family carries unchecked (:attr:`~.adapter.FamilyAdapter.carried`), in order."""
    family = adapter_for(model)
    return [name for name in shapes if family.carried and name not in model.disk_shapes and family.carries(name)]


def natural(name: str) -> list[object]:
    """Sort key that puts ``layers.2`` before ``layers.10``."""
    return [int(p) if p.isdigit() else p for p in _DIGITS.split(name)]


_DIGITS = re.compile(r"(\d+)")


def _natural_name(spec: TargetSpec) -> list[object]:
    return natural(spec.name)


def dequantized_targets(planned: Planned, dtype: str) -> tuple[Target, ...]:
    """The computed targets a plan of the same source given ``dtype`` holds for its quantized weights (what
    :func:`plan_layout` with ``dtype`` plans for them), planned alone. ``planned`` must have a config and no
    quantization problem; () when its config declares no quantization.

    Raises:
        ValueError: ``planned`` was made without ``keep_specs`` (a bug).
    """
    if planned.specs is None:
        raise ValueError("dequantized_targets needs a plan made with keep_specs=True")
    quant = read_quantization(planned.config, str(planned.config_path or "config.json")) if planned.config is not None else None
    if quant is None or planned.quantization:
        return ()
    specs = [s for s in dequantized(planned.specs, planned.layout, quant) if s.dequant is not None]
    keep = {s.name for s in specs if keeps_dtype(s.name)}
    return plan_covered(planned.layout, specs, dtype=dtype, keep_dtype=keep)[0].targets


def _listed(names: Sequence[str], shown: int = 3) -> str:
    more = f" and {len(names) - shown} more" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def _historical(specs: Sequence[TargetSpec], unplaced: Sequence[tuple[str, str]], notes: list[str],
                ) -> tuple[list[TargetSpec], list[tuple[str, str]], list[tuple[str, str]]]:
    """``specs`` and ``unplaced`` without the historical buffers (:mod:`ckpttool.families.buffers`), a note for
    each kind appended to ``notes``, and ``(name, message)`` for each buffer, for the audit."""
    found = split_historical([*(s.name for s in specs), *(name for name, _ in unplaced)])
    if not found:
        return list(specs), list(unplaced), []
    gone = {name for names in found.values() for name in names}
    notes.extend(historical_note(entry, names) for entry, names in found.items())
    messages = sorted((name, historical_message(entry, name)) for entry, names in found.items() for name in names)
    return ([s for s in specs if s.name not in gone], [(n, m) for n, m in unplaced if n not in gone], messages)


def _dropped(specs: Sequence[TargetSpec], unplaced: Sequence[tuple[str, str]], patterns: Sequence[str],
             notes: list[str]) -> tuple[list[TargetSpec], list[tuple[str, str]]]:
    """``specs`` and ``unplaced`` without the tensors a ``drop`` pattern names, a note for each pattern."""
    specs, unplaced = list(specs), list(unplaced)
    for pattern in patterns:
        try:
            regex = re.compile(pattern)
        except re.error as e:
            raise ArgumentError(f"drop='{pattern}' is not a name or a regular expression: {e}") from None
        gone = [s.name for s in specs if regex.fullmatch(s.name)] + [n for n, _ in unplaced if regex.fullmatch(n)]
        if not gone:
            raise ArgumentError(f"drop='{pattern}' matches no tensor of the source (names are matched whole, "
                                "after mapping to HuggingFace names)")
        specs = [s for s in specs if not regex.fullmatch(s.name)]
        unplaced = [(n, m) for n, m in unplaced if not regex.fullmatch(n)]
        notes.append(f"dropped {_listed(gone)}: matched by the drop pattern '{pattern}'")
    return specs, unplaced
