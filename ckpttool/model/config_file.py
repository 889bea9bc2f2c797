"""Which file is a model's config, and reading it: the ``config.json`` beside a checkpoint (or named), never a link out
of the checkpoint, and never a training job's config mistaken for a HuggingFace one.

What the config says the model looks like is :mod:`ckpttool.model.architecture`'s to answer.
"""

from __future__ import annotations

import json
from pathlib import Path

from ckpttool.errors import ConfigError, SourceError
from ckpttool.io import jsonfile
from ckpttool.io.paths import JSON_LIMIT, escaping_link, link_escapes, read_source

__all__ = ["JOB_SECTIONS", "find_config", "read_config"]


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
        # name the link itself: the file, or a folder on the way to it (verl's huggingface/)
        link, target = escaping_link(folder, path.relative_to(folder).as_posix()) or (path.name, target)
        raise ConfigError(f"'{folder / link}' is a symlink to '{target}', outside '{folder}'; ckpttool follows no link "
                          "out of the checkpoint. Copy the config in its place, or name that file itself as the config")
    return path


#: top-level keys (JSON) or sections (TOML) of a training framework's job config (torchtitan's ``[job]``,
#: ``[model]``, ``[training]``, ``[parallelism]``, ``[checkpoint]``; its 0.3 ``save_config_file`` JSON), which a user
#: may pass for "the config the model was trained with"
JOB_SECTIONS = frozenset({"job", "training", "parallelism", "checkpoint", "optimizer", "lr_scheduler", "model_spec"})
_NOT_HF = ("is a training job config ({what}), not a HuggingFace config.json: ckpttool needs the config.json of the "
           "HuggingFace model ({{\"model_type\": ...}}) to name and shape the tensors. Pass that one (torchtitan keeps "
           "it in hf_assets_path, or write it for the model the job trained)")


def read_config(path: Path) -> dict[str, object]:
    """The JSON object in ``path``.

    Raises:
        ConfigError: it cannot be read, is not a JSON object, or is a training job config (a TOML file, or JSON
            with a job's sections and no ``model_type``) instead of a HuggingFace config.
    """
    try:
        data = read_source(path, limit=JSON_LIMIT)
        config = jsonfile.loads(data)
    except SourceError as e:  # not a regular file, unreadable: the message names the file
        raise ConfigError(str(e)) from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        sections = _toml_sections(data)
        if sections & JOB_SECTIONS:
            what = "TOML with sections " + ", ".join(f"[{s}]" for s in sorted(sections))
            raise ConfigError(f"'{path}': " + _NOT_HF.format(what=what)) from None
        raise ConfigError(f"'{path}': cannot read the config: {e}") from None
    if not isinstance(config, dict):
        raise ConfigError(f"'{path}': the config is not a JSON object")
    job = sorted(JOB_SECTIONS & set(config))
    if "model_type" not in config and len(job) >= 2:
        raise ConfigError(f"'{path}': " + _NOT_HF.format(what="JSON with keys " + ", ".join(job)))
    return config


def _toml_sections(data: bytes) -> set[str]:
    """The ``[section]`` headers of a text that may be TOML (none when it is not text)."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        return set()
    return {line.strip()[1:-1].strip() for line in text.splitlines()
            if line.strip().startswith("[") and line.strip().endswith("]") and not line.strip().startswith("[[")}
