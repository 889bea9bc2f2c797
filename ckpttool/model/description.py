"""A model's description as plain data (:class:`ModelInfo`), its JSON document, and the cache that keeps it.

:mod:`ckpttool.model.architecture` makes a description (with transformers); this module holds what it makes and
where it is kept between runs: one JSON file per config and transformers version under ``CKPTTOOL_CACHE`` (default
``~/.cache/ckpttool``), the same document the describing subprocess answers with.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ckpttool.io import jsonfile
from ckpttool.layout.layout import Shape

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
        family: the family whose adapter cuts this model's tensors (:mod:`ckpttool.families`): the model type, or
            the one transformers itself treats it as (``qwen3_moe`` is cut as ``qwen2_moe``).
        mtp_shapes: the multi-token-prediction layers the config declares, as transformers' ``MtpModel`` builds
            them (``layers.0.eh_proj.weight``, ``layers.0.post_norm.weight``, ``embed_tokens.weight``,
            ``shared_head.weight``), each decoder block under its on-disk names (``layers.0.mtp_block.mlp.experts.0
            .gate_proj.weight``); empty when the config declares none. Where a release stores them is
            :mod:`ckpttool.families.mtp`'s to say.
        buffers: the model's non-persistent buffers (``model.rotary_emb.inv_freq``): not in its state dict, so
            ``save_pretrained`` never writes them, but some savers do (ColossalAI's MoE checkpoint IO); a merge
            drops them with a note.
        architecture: the transformers class the expectations were built from (``Qwen2_5_VLForConditionalGeneration``
            for an image-text-to-text model, a causal LM otherwise); None in descriptions cached before it was kept.
    """

    model_type: str
    config: Mapping[str, object]
    memory_shapes: Mapping[str, Shape]
    disk_shapes: Mapping[str, Shape]
    tied: Mapping[str, str] = field(default_factory=dict)
    family: str | None = None
    mtp_shapes: Mapping[str, Shape] = field(default_factory=dict)
    buffers: Mapping[str, Shape] = field(default_factory=dict)
    architecture: str | None = None


#: bumped whenever :class:`ModelInfo` gains a field, so that no older entry (which lacks it) is read
CACHE_FORMAT = 4


def cache_path(config: Mapping[str, object]) -> Path | None:
    """The cache entry of ``config``'s description: keyed by the config's content, the transformers version and
    :data:`CACHE_FORMAT`; None when transformers is not installed or the config is not JSON."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        key = json.dumps({"transformers": version("transformers"), "config": config, "format": CACHE_FORMAT},
                         sort_keys=True, default=str)
    except (PackageNotFoundError, TypeError, ValueError):
        return None
    root = Path(os.environ.get("CKPTTOOL_CACHE") or Path.home() / ".cache" / "ckpttool")
    return root / "models" / f"{hashlib.sha256(key.encode()).hexdigest()}.json"


def read_cache(path: Path, config: Mapping[str, object]) -> tuple[ModelInfo | None] | None:
    """``(info,)`` from the cache (``info`` may be None: no causal LM), or None when there is no usable entry."""
    try:
        doc = jsonfile.loads(path.read_text())
        if doc is None or doc.get("none"):
            return (None,) if doc is not None else None
        return (from_doc(doc, config),)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def from_doc(doc: Mapping[str, Any], config: Mapping[str, object]) -> ModelInfo:
    """The description a cache entry (:func:`to_doc`) holds, for ``config``; KeyError, TypeError, ValueError or
    AttributeError when it holds none."""
    shapes = lambda m: {k: tuple(int(n) for n in v) for k, v in m.items()}  # noqa: E731
    return ModelInfo(doc["model_type"], dict(config), shapes(doc["memory"]), shapes(doc["disk"]), dict(doc["tied"]),
                     doc.get("family"), shapes(doc["mtp"]), shapes(doc["buffers"]), doc.get("architecture"))


def to_doc(info: ModelInfo | None) -> dict[str, Any]:
    """A description as a JSON document (a cache entry, and the subprocess's answer); ``{"none": true}`` for None."""
    return {"none": True} if info is None else {
        "model_type": info.model_type, "memory": info.memory_shapes, "disk": info.disk_shapes, "tied": info.tied,
        "family": info.family, "mtp": info.mtp_shapes, "buffers": info.buffers, "architecture": info.architecture,
    }


def write_cache(path: Path, info: ModelInfo | None) -> None:
    """Keep ``info`` (None: transformers builds no model of it) at ``path``, atomically; a cache that cannot be
    written is logged and left out."""
    doc = to_doc(info)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps(doc))
        os.replace(temporary, path)
    except OSError as e:  # a read-only home: no cache, same answers
        log.info("cannot cache the model description in %s: %s", path.parent, e)
