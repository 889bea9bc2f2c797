"""The config's consistency with the weights: what transformers needs, beyond the tensors, to load them.

A HuggingFace directory without ``config.json`` holds valid safetensors, but ``from_pretrained`` stops before
reading a weight. A merge without a config (a generic merge) writes exactly that, so the audit says so with a
warning (``config-missing``), never a bare PASS. A sharded source without a config is no such problem: it is
not what transformers loads, and only ``no-config`` (info) says its names and shapes were not checked.

Beyond its presence: the dtype the config declares against the weights' (and a mix of dtypes), the
tokenizer's ids against ``vocab_size``, tokenizer files linking out of the checkpoint, and an output layer
saved although ``tie_word_embeddings`` is true.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from ckpttool.io import jsonfile
from ckpttool.model.description import ModelInfo
from ckpttool.io.dtypes import FLOAT_DTYPES, dtype_name
from ckpttool.plan.plan import Target, TargetSpec
from ckpttool.errors import ConfigError, SourceError
from ckpttool.families import keeps_dtype, tied_on_disk
from ckpttool.findings import Finding, TensorStats, finding
from ckpttool.io.paths import JSON_LIMIT, read_source
from ckpttool.readers import hf
from ckpttool.writers.hf import find_extras

CONFIG = "config.json"


def config_findings(root: Path, fmt: str, config: Mapping[str, object] | None, checked: bool,
                    invalid: bool = False) -> list[Finding]:
    """The findings about the config of the checkpoint in ``root``.

    Args:
        root: the audited directory.
        fmt: its format.
        config: the config used (found in or next to ``root``, or given), if any.
        checked: whether names and shapes were checked against an architecture built from it.
        invalid: whether ``config-invalid`` already says why not (then no ``no-config``).

    Returns:
        ``config-missing`` for a HuggingFace directory with no ``config.json`` of its own (even when a config
        from elsewhere was given: transformers reads the directory's), and ``no-config`` when nothing was
        checked against an architecture (unless ``config-missing`` already says so).
    """
    found: list[Finding] = []
    missing = fmt == hf.NAME and not (root / CONFIG).is_file()
    if missing:
        unchecked = "; its names and shapes are not checked against an architecture" if config is None else ""
        found.append(finding(
            "config-missing",
            f"no {CONFIG} beside the weights: transformers cannot load this directory (from_pretrained reads "
            f"{CONFIG} first){unchecked}. Merge again with the model's config, or copy its {CONFIG} here",
            file=CONFIG,
        ))
    if not checked and not invalid and not (missing and config is None):
        why = "no config.json found" if config is None else (
            f"transformers has no causal LM for model_type {config.get('model_type')!r}")
        found.append(finding("no-config", f"{why}: names and shapes are not checked against an architecture"))
    return found


def unloadable_findings(config_path: Path, config: Mapping[str, object], rejected: ConfigError | None,
                        hf_directory: bool) -> list[Finding]:
    """``config-invalid`` when transformers cannot load the config: it rejects a key (``rejected``, what building
    the architecture raised), or, for a HuggingFace directory, its ``model_type`` is unknown to transformers and
    no ``auto_map`` points to custom code (``from_pretrained`` stops at ``AutoConfig``).

    A model type transformers knows without a causal LM (T5, ViT) loads with its own class: no finding. A
    sharded source with an unknown type is a generic merge, which ``no-config`` reports.
    """
    if rejected is not None:
        reason = " ".join(str(rejected).split())  # transformers' validation errors span lines
        return [finding("config-invalid", f"{reason}. Fix {CONFIG}: from_pretrained cannot load this checkpoint",
                        file=config_path.name)]
    model_type = config.get("model_type")
    if not hf_directory or "auto_map" in config or _known_model_type(str(model_type)):
        return []
    import transformers

    return [finding(
        "config-invalid",
        f"'{config_path}': model_type {model_type!r} is not a model type transformers {transformers.__version__} "
        f"knows, and {CONFIG} has no auto_map to custom code: from_pretrained cannot load this directory. Set "
        "model_type to the architecture's (e.g. 'llama'), or upgrade transformers",
        file=config_path.name,
    )]


def _known_model_type(model_type: str) -> bool:
    # only reached when no architecture was built (rare): importing transformers here costs seconds, once
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    return model_type in CONFIG_MAPPING


def dtype_findings(targets: Sequence[Target], config: Mapping[str, object] | None) -> list[Finding]:
    """``dtype-mix`` and ``config-dtype``; tensors a family keeps in their own dtype (an FP32 router bias in a
    bfloat16 model, :func:`~ckpttool.families.keeps_dtype`) are no mix."""
    targets = [t for t in targets if not keeps_dtype(t.name)]
    floats = Counter(t.dtype for t in targets if t.dtype in FLOAT_DTYPES)
    if not floats:
        return []
    main, count = floats.most_common(1)[0]
    total = sum(floats.values())
    found = []
    if len(floats) > 1 and count > total / 2:
        found.extend(
            finding("dtype-mix", f"'{t.name}' is {t.dtype}, but {count} of {total} floating-point tensors are {main}",
                    tensor=t.name)
            for t in targets if t.dtype in FLOAT_DTYPES and t.dtype != main
        )
    elif len(floats) > 1:
        found.append(finding("dtype-mix", f"floating-point tensors come in several dtypes: {dict(floats)}"))
    declared = (config or {}).get("dtype") or (config or {}).get("torch_dtype")
    if isinstance(declared, str) and declared != "auto":
        try:
            name = dtype_name(declared)
        except SourceError:
            name = None
        if name is not None and name != main:
            found.append(finding("config-dtype", f"config.json says dtype {declared}, but the weights are {main}",
                                 file="config.json"))
    return found


def tokenizer_findings(root: Path, config_path: Path | None, config: Mapping[str, object] | None) -> list[Finding]:
    extras, skipped = find_extras([root] + ([config_path.parent] if config_path is not None else []))
    found = [finding("file-link-outside", f"'{path.name}' is a symlink to '{path.resolve()}', outside the checkpoint: "
                     "not read, and a merge does not copy it", file=path.name) for path in skipped]
    vocab = (config or {}).get("vocab_size")
    path = _tokenizer_json(extras)
    if not isinstance(vocab, int) or path is None:
        return found
    return found + _tokenizer_size(path, vocab)


def _tokenizer_size(path: Path, vocab: int) -> list[Finding]:
    size = tokenizer_size(path)
    if size is None:
        return [finding("tokenizer-invalid", f"'{path.name}' is not a tokenizer.json with a vocab; its size is not checked",
                        file=path.name)]
    if size > vocab:
        return [finding("tokenizer-vocab", f"'{path.name}' has token ids up to {size - 1}, but vocab_size is {vocab}: "
                        f"ids {vocab}..{size - 1} index past the embedding", file=path.name)]
    if size < vocab:
        return [finding("tokenizer-smaller", f"'{path.name}' has {size} token ids for vocab_size {vocab}", file=path.name)]
    return []


def checkpoint_tokenizer_size(root: Path, config_path: Path | None) -> int | None:
    """The size of the tokenizer.json a merge would copy (in ``root`` or beside the config), if there is one."""
    path = _tokenizer_json(find_extras([root] + ([config_path.parent] if config_path is not None else []))[0])
    return tokenizer_size(path) if path is not None else None


def _tokenizer_json(extras: Sequence[Path]) -> Path | None:
    return next((p for p in extras if p.name == "tokenizer.json"), None)


def tokenizer_size(path: Path) -> int | None:
    """One more than the largest token id of a ``tokenizer.json`` (vocab and added tokens), or None when the
    file is not a tokenizer this can read."""
    try:
        doc = jsonfile.loads(read_source(path, limit=JSON_LIMIT))
    except (SourceError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    model = doc.get("model") if isinstance(doc, dict) else None
    vocab = model.get("vocab") if isinstance(model, dict) else None
    ids: list[int] = []
    if isinstance(vocab, dict):
        ids.extend(v for v in vocab.values() if isinstance(v, int))
    elif isinstance(vocab, list):
        ids.append(len(vocab) - 1)
    added = doc.get("added_tokens") if isinstance(doc, dict) else None
    ids.extend(t["id"] for t in added or () if isinstance(t, dict) and isinstance(t.get("id"), int))
    return max(ids) + 1 if ids else None


def tie_findings(tied: Sequence[TargetSpec], model: ModelInfo, stats: Mapping[str, TensorStats], data: bool) -> list[Finding]:
    found = []
    partners = tied_on_disk(model)
    for spec in tied:
        partner = partners[spec.name]
        if not data:
            found.append(finding(
                "tie-mismatch",
                f"'{spec.name}' is saved although tie_word_embeddings is true; transformers will use '{partner}' "
                "instead (data not checked)",
                tensor=spec.name, severity="warning",
            ))
        elif spec.name in stats and partner in stats:
            if stats[spec.name].fingerprint == stats[partner].fingerprint:
                found.append(finding("tied-copy", f"'{spec.name}' is saved although tied; it equals '{partner}'",
                                     tensor=spec.name))
            else:
                found.append(finding(
                    "tie-mismatch",
                    f"'{spec.name}' differs from '{partner}', but tie_word_embeddings is true: transformers will "
                    f"load '{partner}' as the output layer and drop the trained one. Set tie_word_embeddings to false",
                    tensor=spec.name,
                ))
    return found
