"""Reading a source for a command: its config found and read, its sizes checked, its layout read, then planned by
the families (:func:`ckpttool.families.source.plan_layout`). The one place commands go from a path to a
:class:`~ckpttool.families.source.Planned`; it sits above the readers and the families, which never import each other.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ckpttool.families.source import Planned, plan_layout
from ckpttool.model.architecture import find_config, model_info, read_config
from ckpttool.model.config_sizes import check_config_sizes
from ckpttool.readers import census, detect_format, hf_distributed, read_layout


def plan_source(
    src: str | Path, *, format: str | None = None, config: str | Path | None = None, dtype: str | None = None,
    weights: str | None = None, quantize: tuple[int, int] | None = None, drop: Sequence[str] = (),
) -> Planned:
    """Find and read the config, read the source's layout, and plan it (see :func:`plan_layout`).

    Raises:
        SourceError, ConfigError: the source or the config cannot be read (not what merely does not fit:
            that is data in the result).
    """
    root = Path(src)
    config_path = find_config(root, config)
    config_dict = read_config(config_path) if config_path is not None else None
    model = None
    if config_dict is not None:  # absurd sizes are refused before transformers spends minutes on them
        check_config_sizes(config_dict, str(config_path), lambda: census(root, format, weights))
        model = model_info(config_dict, label=str(config_path))
        if model is None and (format or detect_format(root)) == hf_distributed.NAME:  # needs the shapes it gives
            raise hf_distributed.undescribed(root, str(config_path), config_dict.get("model_type"))
    layout = read_layout(root, format=format, model=model, weights=weights)
    return plan_layout(layout, config_path=config_path, config=config_dict, model=model, dtype=dtype, quantize=quantize,
                       drop=drop)
