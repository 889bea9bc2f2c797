"""transformers distributed checkpoints: ``save_pretrained(..., distributed_checkpoint=True)``.

Each rank writes ``shard-RRRRR-model-00001-of-00001.safetensors`` holding its local pieces under the
in-memory names, with ``__metadata__["DCP_SHARDING_INFO"]`` = ``{name: {"saved_offsets": [...]}}``. No file
records a global shape: it comes from the model config (transformers builds the model on the meta device).
Inferring it from the pieces found would turn a missing rank file into a silently smaller tensor.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ckpttool.io import jsonfile
from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import RAW, Box, Layout, Piece
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import ConfigError, SourceError, SourceNotFoundError
from ckpttool.io.paths import contained
from ckpttool.io.safetensors_format import read_header
from ckpttool.readers.base import FormatReader

NAME = "hf-distributed"
LOOKS_FOR = "shard-*-model-*-of-*.safetensors (transformers distributed_checkpoint=True)"
PATTERN = re.compile(r"^shard-(\d{5})-model-(\d{5})-of-(\d{5})\.safetensors$")
SHARDING_KEY = "DCP_SHARDING_INFO"


def undescribed(root: Path, config: str, model_type: object, reason: str | None = None) -> ConfigError:
    """The refusal for a checkpoint of this format whose ``config`` was found, but that transformers cannot describe
    (so no global shape is known): a model type it does not know (remote code) or builds no causal-LM or
    image-text-to-text class of, or ``reason`` (its own rejection of the config). Not "put config.json in": it is
    there (issue 30)."""
    from importlib import metadata  # here, not at start-up: ~40 ms of every command's imports for one refusal

    try:
        version = f"transformers {metadata.version('transformers')}"
    except metadata.PackageNotFoundError:
        version = "transformers (not installed)"
    why = reason or (f"{version} builds no model from it: it has no causal-LM or image-text-to-text class for "
                     f"model_type {model_type!r}, or does not know that model type (a model of remote code)")
    return ConfigError(
        f"'{root}': transformers distributed checkpoints record no global shapes; ckpttool takes them from the "
        f"model config, and '{config}' is there, but {why}. Pass --config with the config of a model transformers "
        "builds (its own model type), or a transformers release that knows this one."
    )


def matches(root: Path) -> bool:
    return any(PATTERN.match(p.name) for p in root.iterdir())


def read(root: Path, model: ModelInfo | None) -> Layout:
    files = sorted(p.name for p in root.iterdir() if PATTERN.match(p.name))
    if not files:
        raise SourceNotFoundError(f"'{root}': no shard-*-model-*-of-*.safetensors files")
    if model is None:
        raise ConfigError(
            f"'{root}': transformers distributed checkpoints record no global shapes; ckpttool takes them from the "
            "model config. Put config.json in or next to the checkpoint, or pass --config."
        )
    builder = LayoutBuilder(str(root), NAME)
    ranks = sorted(int(PATTERN.match(f).group(1)) for f in files)
    gaps = sorted(set(range(1, max(ranks) + 1)) - set(ranks))
    builder.mark_missing(*(f"shard-{r:05d}-model-*.safetensors" for r in gaps))
    for name in files:
        header = read_header(contained(root, name), name)  # a link out of the source is refused, naming it
        info = header.metadata.get(SHARDING_KEY)
        try:
            sharding = jsonfile.loads(info) if info is not None else {}
        except json.JSONDecodeError:
            raise SourceError(f"'{name}': {SHARDING_KEY} metadata is not valid JSON") from None
        if not isinstance(sharding, dict):
            raise SourceError(f"'{name}': {SHARDING_KEY} metadata must map tensor names to their saved_offsets")
        rank = int(PATTERN.match(name).group(1)) - 1
        for key, entry in header.entries.items():
            shape = model.memory_shapes.get(key)
            if shape is None:
                raise ConfigError(
                    f"'{name}': tensor '{key}' is not a parameter of the {model.model_type} model the config describes"
                )
            record = sharding.get(key, {})
            offsets = record.get("saved_offsets", [0] * len(entry.shape)) if isinstance(record, dict) else record
            if (
                not isinstance(offsets, list)
                or len(offsets) != len(entry.shape)
                or not all(isinstance(o, int) and not isinstance(o, bool) and o >= 0 for o in offsets)
            ):
                raise SourceError(
                    f"'{name}': '{key}' needs saved_offsets of {len(entry.shape)} non-negative integers, found {offsets!r}"
                )
            if builder.declare(key, shape, entry.dtype, where=f"'{name}'"):
                builder.add(key, Piece(name, key, Box(tuple(offsets), entry.shape), entry.dtype, RAW, entry.begin,
                                       entry.end - entry.begin, (("rank", rank),)))
    _declare_unsaved(builder, model)
    return builder.build()


def _declare_unsaved(builder: LayoutBuilder, model: ModelInfo) -> None:
    """Tensors of the model that no file holds still exist: declared without pieces, they become coverage
    errors naming them (e.g. the norms only the missing rank's file held), not silently absent tensors."""
    dtypes = [builder.dtype_of(fqn) for fqn in builder.declared]
    if not dtypes:
        return
    common = max(set(dtypes), key=dtypes.count)
    for fqn, shape in model.memory_shapes.items():
        if fqn not in builder.declared and fqn not in model.tied:
            builder.declare(fqn, shape, common, where="the model config")


READER = FormatReader(NAME, LOOKS_FOR, matches, read)
