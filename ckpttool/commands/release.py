"""Reading a packed release for its scales (``merge(..., scales_from=RELEASE)``): its config's quantization and
where each of its tensors' bytes lie, headers only (:class:`~ckpttool.families.quantize_release.Release`)."""

from __future__ import annotations

import json
from pathlib import Path

from ckpttool import readers
from ckpttool.errors import ArgumentError
from ckpttool.families.quantize_release import Release
from ckpttool.model.config_file import find_config, read_config
from ckpttool.quant.formats import read_quantization
from ckpttool.quant.on_grid import ReleaseTensor
from ckpttool.quant.packed import PACKED_METHODS


def read_release(path: str | Path) -> Release:
    """The packed release at ``path`` (a HuggingFace folder: config.json and safetensors), headers only.

    Raises:
        ArgumentError: no config, or a config that declares no packed format (compressed-tensors pack-quantized
            or nvfp4-pack-quantized, ModelOpt NVFP4).
        SourceError, ConfigError: the folder or its config cannot be read.
    """
    root = Path(path)
    config_path = find_config(root, None)
    if config_path is None:
        raise ArgumentError(f"scales_from='{root}': no config.json there; give the release's folder (its config "
                            "says how its weights are packed)")
    config = read_config(config_path)
    quant = read_quantization(config, str(config_path))
    if quant is None or quant.method not in PACKED_METHODS:
        what = "no quantization_config" if quant is None else quant.describe()
        raise ArgumentError(f"scales_from='{root}': its config declares {what}; scales are taken from a packed "
                            "release (compressed-tensors pack-quantized or nvfp4-pack-quantized, ModelOpt NVFP4)")
    layout = readers.read_layout(root, format="hf")
    base = Path(layout.root).resolve()
    tensors = {}
    for name, tensor in layout.tensors.items():
        piece = tensor.pieces[0]
        tensors[name] = ReleaseTensor(name, str(base / piece.file), piece.byte_offset, piece.dtype,
                                      tuple(tensor.global_shape))
    raw = config["quantization_config"]
    return Release(str(root), quant, json.dumps(raw), tensors)
