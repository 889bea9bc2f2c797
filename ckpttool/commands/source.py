"""Reading a source for a command: its config found and read, its sizes checked, its layout read, then planned by
the families (:func:`ckpttool.families.source.plan_layout`). The one place commands go from a path to a
:class:`~ckpttool.families.source.Planned`; it sits above the readers and the families, which never import each other,
and tells the readers what the conventions know that a format does not record (:func:`read_layout`:
:data:`ckpttool.families.registry.READER_TABLES`, e.g. which dim Megatron-Core splits each tensor on).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path

from ckpttool.errors import SourceError
from ckpttool.families import READER_TABLES, reduced_layers
from ckpttool.families.quantize_packed import PackScheme
from ckpttool.families.source import Planned, plan_layout
from ckpttool.layout.layout import Layout, TensorLayout
from ckpttool.lora import megatron
from ckpttool.lora.embedded import Embedded, split_embedded
from ckpttool.lora.megatron import bridge_targets
from ckpttool.model.description import ModelInfo
from ckpttool.model.architecture import start_describing
from ckpttool.model.config_file import find_config, read_config
from ckpttool.model.config_sizes import check_config_sizes
from ckpttool.plan.plan import Target
from ckpttool import readers
from ckpttool.readers import census, dcp, detect_format, hf, hf_distributed, sidecar


def read_layout(
    src: str | Path, *, format: str | None = None, model: ModelInfo | None = None, **options: str | None
) -> Layout:
    """Describe a checkpoint directory as a layout, reading metadata and headers only: the API's ``read_layout``,
    :func:`ckpttool.readers.read_layout` with what the source conventions tell the readers
    (:data:`~ckpttool.families.registry.READER_TABLES`).

    Args:
        src: the checkpoint directory.
        format: a reader name (``dcp``, ``megatron-legacy``, ``sidecar``, ``hf``, ...); detected when None.
        model: what the config says the model looks like; needed where the format records no global shapes
            (transformers distributed checkpoints), and the args of a Megatron checkpoint are checked against it.
        options: reader options (``weights="module"``); None values are left out.

    Raises:
        SourceError: as :func:`ckpttool.readers.read_layout` says.
        ConfigError: a checkpoint's training args contradict ``model``'s config.

    Example:
        >>> layout = read_layout("fixtures/megatron_tp2_pp2/legacy")  # doctest: +SKIP
        >>> layout.tensors["decoder.layers.0.self_attention.linear_qkv.weight"].global_shape  # doctest: +SKIP
        (96, 32)
    """
    return readers.read_layout(src, format=format, model=model, tables=READER_TABLES, **options)


def plan_source(
    src: str | Path, *, format: str | None = None, config: str | Path | None = None, dtype: str | None = None,
    weights: str | None = None, quantize: tuple[int, int] | str | PackScheme | None = None, drop: Sequence[str] = (),
) -> Planned:
    """Find and read the config, read the source's layout, and plan it (see :func:`plan_layout`).

    A source holding a PEFT-wrapped model (base and LoRA adapter saved together) is planned as its base, under
    transformers' names, the LoRA tensors set aside (see :func:`plan_source_and_adapter`, which gives them).

    Raises:
        SourceError, ConfigError: the source or the config cannot be read (not what merely does not fit:
            that is data in the result).
    """
    return plan_source_and_adapter(src, format=format, config=config, dtype=dtype, weights=weights,
                                   quantize=quantize, drop=drop)[0]


def plan_source_and_adapter(
    src: str | Path, *, format: str | None = None, config: str | Path | None = None, dtype: str | None = None,
    weights: str | None = None, quantize: tuple[int, int] | str | None = None, drop: Sequence[str] = (),
) -> tuple[Planned, Embedded | None]:
    """:func:`plan_source`, and the LoRA adapter saved with the base when the source holds one
    (:func:`ckpttool.lora.embedded.split_embedded`), else None.

    Raises:
        SourceError, ConfigError: as :func:`plan_source`; SourceError too for a PEFT model ckpttool does not fuse.
    """
    root = Path(src)
    config_path = find_config(root, config)
    config_dict = read_config(config_path) if config_path is not None else None
    model = None
    if config_dict is None:
        layout = read_layout(root, format=format, weights=weights)
    else:  # absurd sizes are refused before transformers spends minutes on them
        check_config_sizes(config_dict, str(config_path), lambda: census(root, format, weights, READER_TABLES))
        layout, model = _read_described(root, format, weights, config_dict, str(config_path))
    embedded = split_embedded(layout)
    if embedded is not None:
        layout = embedded.base
    planned = plan_layout(layout, config_path=config_path, config=config_dict, model=model, dtype=dtype,
                          quantize=quantize, drop=drop)
    if embedded is not None and embedded.name == megatron.NAME:
        embedded = _bridge_planned(root, embedded, planned)
    return planned, embedded


#: the formats whose readers take no model (every global shape is on disk, no training args are checked): their
#: layout is read while the config is described in a subprocess, on another core
_READ_WITHOUT_MODEL = frozenset({sidecar.NAME, dcp.NAME, hf.NAME})


def _read_described(root: Path, format: str | None, weights: str | None, config: Mapping[str, object],
                    label: str) -> tuple[Layout, ModelInfo | None]:
    """The source's layout and its config's description; for a format whose reader takes no model, the layout is
    read while the description is made (:func:`ckpttool.model.architecture.start_describing`): a first run's
    seconds of transformers' imports overlap the headers' reading.

    Raises:
        SourceError, ConfigError: as :func:`plan_source` says; the layout's own error comes first for such a format.
    """
    with start_describing(config, label=label, reduce=reduced_layers) as describing:
        fmt = format or detect_format(root)
        if fmt in _READ_WITHOUT_MODEL:
            layout = read_layout(root, format=fmt, weights=weights)
            return layout, describing.result()
        model = describing.result()
        if model is None and fmt == hf_distributed.NAME:  # needs the shapes it gives
            raise hf_distributed.undescribed(root, label, config.get("model_type"))
        return read_layout(root, format=fmt, model=model, weights=weights), model


def _bridge_planned(root: Path, embedded: Embedded, planned: Planned) -> Embedded:
    """A Megatron-Core LoRA's A and B planned as the base is (:func:`ckpttool.lora.megatron.bridge_targets`), so
    its pairs are those of the HuggingFace modules the base is written as.

    Raises:
        SourceError: the base has no model config (its HuggingFace names, and so the adapter's, are unknown).
    """
    if planned.model is None:
        raise SourceError(f"'{root}': holds a Megatron-Core LoRA adapter saved with the base (e.g. "
                          f"'{next(iter(embedded.lora))}'), which is fused into the HuggingFace model's tensors: "
                          "give the model's config.json (--config)")
    base = embedded.base

    def plan(tensors: Mapping[str, TensorLayout]) -> tuple[Target, ...]:
        layout = replace(base, tensors=dict(tensors), notes=())
        return plan_layout(layout, config_path=planned.config_path, config=planned.config,
                           model=planned.model).plan.targets

    return replace(embedded, targets=bridge_targets(str(root), embedded.lora, plan))
