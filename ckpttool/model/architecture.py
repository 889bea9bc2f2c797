"""What a model config says the model looks like, the way transformers itself builds and saves it.

The expected tensors come from transformers, not from tables: the architecture is built from ``config.json``
on the meta device (no memory), which gives the in-memory names and global shapes; transformers' own
``revert_weight_conversion`` on those meta tensors gives the on-disk names and shapes ``save_pretrained``
writes; tied weights are dropped as ``save_pretrained`` drops them. The answer (:class:`ModelInfo`) is plain
data: readers use it where a format records no global shapes, the families (:mod:`ckpttool.families`) to
name and cut tensors, the audit to check them.

The answer is cached on disk. A config not in the cache is described by transformers in a short-lived subprocess
(:data:`DESCRIBE_ENV` says otherwise), so that importing transformers and building the model (a few hundred MiB
the allocator keeps) do not stay in the merging process and push its peak memory above the plan's prediction. That
subprocess is :mod:`ckpttool.model.describer`'s, started as soon as the config is read (:func:`start_describing`) so
that it runs beside the caller's own reading.

Which file is the config, and reading it, is :mod:`ckpttool.model.config_file`'s.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ckpttool.errors import ConfigError
from ckpttool.layout.layout import Shape
from ckpttool.model.description import ModelInfo, cache_path, read_cache, to_doc, write_cache
from ckpttool.model.describer import DESCRIBE_ENV, CannotSpawn, DescribingProcess, describe_mode
from ckpttool.model.reduced import LayerReduction, expand

__all__ = ["DESCRIBE_ENV", "Describing", "config_value", "describe_main", "model_info", "special_floats",
           "start_describing"]

log = logging.getLogger(__name__)


def model_info(config: Mapping[str, object], *, label: str = "config.json",
               reduce: Callable[[Mapping[str, object]], LayerReduction | None] | None = None) -> ModelInfo | None:
    """Build the architecture on the meta device and read its expected tensors; None if transformers lacks it.

    The answer depends only on the config and the transformers version, and importing transformers takes
    seconds, so it is kept in a cache (``CKPTTOOL_CACHE``, default ``~/.cache/ckpttool``) keyed by both. A config
    not in the cache is described in a subprocess (see :data:`DESCRIBE_ENV`); the time it took is logged. A caller
    with other work to do meanwhile starts the description first (:func:`start_describing`).

    Args:
        config: the model's config as a plain dict.
        label: what the config is called in messages (its path).
        reduce: the family's layer rule (:func:`ckpttool.families.registry.reduced_layers`): a config with one
            decoder layer of each kind, whose description is repeated by layer index (:func:`.reduced.expand`)
            instead of building every layer; None, or a rule that answers None, describes the config in full.

    Raises:
        ConfigError: transformers knows the model type but cannot build it from this config, or the subprocess
            that describes it failed (the message names the config and the reason).
    """
    with start_describing(config, label=label, reduce=reduce) as describing:
        return describing.result()


def start_describing(config: Mapping[str, object], *, label: str = "config.json",
                     reduce: Callable[[Mapping[str, object]], LayerReduction | None] | None = None) -> Describing:
    """:func:`model_info` begun: a config not in the cache has its describing subprocess started at once, and its
    answer is taken by :meth:`Describing.result`, so that the caller's work in between (reading a checkpoint's
    headers) runs beside it. Use it as a context manager: leaving it stops a description whose result was not taken.

    Raises:
        ConfigError: the config has no model type.
        ArgumentError: :data:`DESCRIBE_ENV` has a value other than ``subprocess`` or ``inline``.

    Example:
        >>> with start_describing(config, label="config.json", reduce=reduced_layers) as describing:  # doctest: +SKIP
        ...     layout = read_layout(root)  # meanwhile, on another core
        ...     model = describing.result()
    """
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ConfigError(f"'{label}': no model_type; is it a transformers config?")
    cache = cache_path(config)
    cached = read_cache(cache, config) if cache is not None else None
    if cached is not None:
        return Describing(model_type, config, label, cache, None, None, cached)
    reduction = reduce(config) if reduce is not None else None
    child = None
    if describe_mode() == "subprocess":
        child = DescribingProcess(model_type, config if reduction is None else reduction.config, label)
    return Describing(model_type, config, label, cache, reduction, child, None)


class Describing:
    """A config's description under way (:func:`start_describing`): taken by :meth:`result`, dropped by
    :meth:`close` (or by leaving it as a context manager)."""

    def __init__(self, model_type: str, config: Mapping[str, object], label: str, cache: Path | None,
                 reduction: LayerReduction | None, child: DescribingProcess | None,
                 answer: tuple[ModelInfo | None] | None) -> None:
        self._model_type, self._config, self._label, self._cache = model_type, config, label, cache
        self._reduction, self._child, self._answer = reduction, child, answer

    def result(self) -> ModelInfo | None:
        """The description (None if transformers builds no model of the config), cached for the next run.

        Raises:
            ConfigError: as :func:`model_info` says.
        """
        if self._answer is None:
            model_type, config, label, reduction = self._model_type, self._config, self._label, self._reduction
            try:
                info = _build_reduced(model_type, config, label, reduction, self._child) if reduction else None
                if info is None:  # a reduced description's child is spent; the full one starts its own
                    info = _build(model_type, config, label, None if reduction else self._child)
            finally:
                self.close()
            if self._cache is not None:
                write_cache(self._cache, info)
            self._answer = (info,)
        return self._answer[0]

    def close(self) -> None:
        """Stop the describing subprocess if its answer was not taken; idempotent."""
        if self._child is not None:
            self._child.close()
            self._child = None

    def __enter__(self) -> Describing:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _build_reduced(model_type: str, config: Mapping[str, object], label: str, reduction: LayerReduction,
                   child: DescribingProcess | None = None) -> ModelInfo | None:
    """The description of ``config`` from its reduced config's (``child``: the subprocess describing it, as
    :func:`_build` takes it), or None when that cannot stand for it: transformers rejects the reduced config or
    builds no model of it (the full config is then described and its own error, or None, is the answer), or its
    layers cannot be repeated (:func:`.reduced.expand`)."""
    try:
        small = _build(model_type, reduction.config, label, child)
    except ConfigError as e:
        log.info("the reduced %s config of '%s' is not described (%s): describing it in full", model_type, label, e)
        return None
    info = expand(small, reduction, config) if small is not None else None
    if info is not None:
        log.info("'%s': %d decoder layers described as %d (one of each kind), repeated by layer index", label,
                 len(reduction.layer_of), max(reduction.layer_of) + 1)
    return info


def _build(model_type: str, config: Mapping[str, object], label: str,
           child: DescribingProcess | None = None) -> ModelInfo | None:
    """The description of a config not in the cache, where :data:`DESCRIBE_ENV` says; its time is logged.

    ``child``: the subprocess already describing ``config`` (:func:`start_describing`), whose answer is taken;
    without it one is started here when the mode is ``subprocess``.

    Raises:
        ConfigError: transformers cannot build the model, or the subprocess failed (the message says why).
        ArgumentError: :data:`DESCRIBE_ENV` has another value.
    """
    mode = describe_mode()
    started, where = time.perf_counter() if child is None else child.started, "in this process"
    if mode == "subprocess":
        try:
            with child or DescribingProcess(model_type, config, label) as process:
                info, peak = process.answer()
            where = f"in a subprocess (peak RSS {peak / 2**20:.0f} MiB)"
        except CannotSpawn as e:
            log.info("cannot start a subprocess to describe the architecture (%s): describing it in this process", e)
            mode = "inline"
    if mode == "inline":
        info = _describe(model_type, config, label)
    log.info("described the %s architecture of '%s' with transformers in %.1f s, %s; cached for the next run",
             model_type, label, time.perf_counter() - started, where)
    return info


def describe_main() -> None:
    """The subprocess of :class:`~ckpttool.model.describer.DescribingProcess`: ``{"config", "label"}`` on stdin, one
    JSON document on stdout: the cache entry of the description, or ``{"error": message}``; with the process's peak
    RSS."""
    import resource

    request = json.loads(sys.stdin.read())
    config, label = request["config"], request["label"]
    with contextlib.redirect_stdout(sys.stderr):  # whatever transformers prints must not mix with the answer
        try:
            answer = to_doc(_describe(config["model_type"], config, label))
        except ConfigError as e:
            answer = {"error": str(e)}
    answer["peak"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    sys.stdout.write(json.dumps(answer))


#: how transformers' ``to_json_string`` writes a float JSON cannot hold (Nemotron-H's ``time_step_limit`` ends in
#: infinity): ``{"__float__": "Infinity"}``; its ``from_dict`` reads it back, ``for_model`` does not
_FLOAT_TAGS = {"Infinity": float("inf"), "-Infinity": float("-inf"), "NaN": float("nan")}


def special_floats(value: object) -> object:
    """``value`` with every ``{"__float__": "Infinity"}`` (``-Infinity``, ``NaN``) that transformers writes for a
    non-finite float read back as that float, in lists and dicts at any depth; anything else unchanged.

    Example:
        >>> special_floats([0.0, {"__float__": "Infinity"}])
        [0.0, inf]
    """
    if isinstance(value, dict):
        if set(value) == {"__float__"} and value["__float__"] in _FLOAT_TAGS:
            return _FLOAT_TAGS[value["__float__"]]
        return {k: special_floats(v) for k, v in value.items()}
    if isinstance(value, list):
        return [special_floats(v) for v in value]
    return value


def _describe(model_type: str, config: Mapping[str, object], label: str) -> ModelInfo | None:
    """Build the architecture on the meta device in this process and read its expected tensors."""
    import torch
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        log.info("transformers %s does not know model_type %r", transformers.__version__, model_type)
        return None
    try:  # for_model builds transformers' own class of model_type (CONFIG_MAPPING): it never imports remote code
        cfg = AutoConfig.for_model(model_type, **{k: special_floats(v) for k, v in config.items() if k != "model_type"})
    except Exception as e:  # transformers validates configs with several exception types
        raise ConfigError(f"'{label}': transformers rejects this {model_type} config: {e}") from None
    try:
        with torch.device("meta"):
            model = _build_model(model_type, cfg, config)
    except Exception as e:
        raise ConfigError(f"'{label}': transformers cannot build a {model_type} model from it: {e}") from None
    if model is None:
        return None  # a model type transformers knows, but with no causal-LM or image-text-to-text head: stay generic
    state = model.state_dict()
    memory = {k: tuple(v.shape) for k, v in state.items()}
    tied = dict(getattr(model, "all_tied_weights_keys", None) or {})
    try:
        from transformers.core_model_loading import revert_weight_conversion

        # tied weights dropped before reverting: a model whose conversion renames its head (Gemma 3's ``lm_head`` is
        # reverted to ``language_model.lm_head.weight``) would keep it under a name the tied keys do not hold,
        # where save_pretrained writes no such tensor
        disk_state = revert_weight_conversion(model, {k: v for k, v in state.items() if k not in tied})
    except ImportError:  # transformers < 5: memory names are the disk names
        disk_state = state
    disk = {k: tuple(v.shape) for k, v in disk_state.items() if k not in tied}
    buffers = {k: tuple(v.shape) for k, v in model.named_buffers() if k not in state}
    return ModelInfo(model_type, dict(config), memory, disk, tied, _family(model_type), _mtp_shapes(model, cfg),
                     buffers, type(model).__name__)


def _build_model(model_type: str, cfg: Any, config: Mapping[str, object]) -> Any:
    """The model transformers builds for ``cfg`` (on the current device), or None when it has no class to build.

    The class is transformers' own for the model type, never remote code: the one ``config.architectures`` names
    when it is the model type's causal-LM or image-text-to-text class (a vision-language model saved by its
    ``...ForConditionalGeneration``), else the causal LM, else the image-text-to-text model (Qwen2.5-VL has no
    causal-LM class: both towers are only built by the latter)."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    from transformers.models.auto import modeling_auto

    kinds = {modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type): AutoModelForCausalLM,
             modeling_auto.MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING_NAMES.get(model_type): AutoModelForImageTextToText}
    named = config.get("architectures")
    if isinstance(named, list) and len(named) == 1 and named[0] in kinds and named[0] is not None:
        return kinds[named[0]].from_config(cfg, trust_remote_code=False)  # an auto_map is never run
    for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
        try:
            return auto.from_config(cfg, trust_remote_code=False)
        except ValueError:  # no class of this kind for the model type
            continue
    return None


def _mtp_shapes(model: Any, cfg: Any) -> dict[str, Shape]:
    """The MTP layers transformers (5.23+) builds for a config that declares them (``num_mtp_layers``, alias
    ``num_nextn_predict_layers``), on the meta device; each decoder block's tensors reverted to on-disk names the
    way the main model's layers are (stacked experts saved per expert). Empty when there are none to build."""
    layers = getattr(cfg, "num_mtp_layers", None)
    if not isinstance(layers, int) or layers <= 0:
        return {}
    try:
        import torch
        from transformers.core_model_loading import revert_weight_conversion
        from transformers.modeling_layers import MtpModel

        with torch.device("meta"):
            state = MtpModel(model, layers).state_dict()
        blocks = {}
        for name, tensor in state.items():
            head, sep, rest = name.partition(".mtp_block.")
            if sep:  # through the main model's conversions, as if it were one of its layers
                blocks[f"{head}.{rest}"] = tensor
        reverted = revert_weight_conversion(model, {f"model.{k}": v for k, v in blocks.items()})
    except Exception as e:  # an older transformers, or a model its MTP class cannot build: no MTP expectations
        log.info("transformers builds no MTP layers for %s: %s", type(model).__name__, e)
        return {}
    shapes = {k: tuple(v.shape) for k, v in state.items() if ".mtp_block." not in k}
    for name, tensor in reverted.items():
        index, _, rest = name.removeprefix("model.layers.").partition(".")
        shapes[f"layers.{index}.mtp_block.{rest}"] = tuple(tensor.shape)
    return shapes


def _family(model_type: str) -> str:
    """The family that cuts this model type: transformers' own alias for its weight conversion (``qwen3_moe``
    is converted as ``qwen2_moe``), else the model type itself."""
    try:
        from transformers.conversion_mapping import (
            _MODEL_TO_CONVERSION_PATTERN as aliases,
        )
    except ImportError:
        return model_type
    alias = aliases.get(model_type)
    return alias if isinstance(alias, str) else model_type


def config_value(config: Mapping[str, object], *names: str) -> Any:
    """The first of ``names`` the config sets (not None), or None: configs name one thing several ways."""
    for name in names:
        if config.get(name) is not None:
            return config[name]
    return None
