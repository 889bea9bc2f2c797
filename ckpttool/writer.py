"""The HuggingFace output: sharded safetensors + index + config + tokenizer, published atomically.

Everything is written into a staging directory beside the destination (``.NAME.ckpttool-partial-*``),
verified, and renamed into place at the end; on any error the staging directory is removed, so the
destination never holds a partial checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from .errors import DestinationError, OutputError, SourceError
from .executor import PieceLoader, write_file
from .paths import is_within
from .plan import Plan, Target
from .safetensors_format import encode_header, read_header

INDEX = "model.safetensors.index.json"
PARTIAL = ".ckpttool-partial-"
#: files copied beside the weights when present in the config's directory or the source
EXTRA_FILES = (
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
)


@dataclass(frozen=True, slots=True)
class OutputFile:
    """One safetensors file of the output: its name and the targets it holds, in write order."""

    name: str
    targets: tuple[Target, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.targets)


def parse_size(text: str | int) -> int:
    """Bytes from ``"5GB"``/``"500MB"`` (decimal units, as huggingface_hub) or a plain integer."""
    from huggingface_hub.serialization._base import parse_size_to_int

    if isinstance(text, int):
        return text
    if text.strip().isdigit():
        return int(text.strip())
    try:
        return parse_size_to_int(text)
    except ValueError as e:
        raise ValueError(f"invalid size {text!r}: {e}") from None


def assign_files(plan: Plan, max_shard_size: str | int = "5GB") -> list[OutputFile]:
    """Split the plan's targets into ``model-0000i-of-0000N.safetensors`` files, as huggingface_hub does."""
    from huggingface_hub import split_state_dict_into_shards_factory

    by_name = {t.name: t for t in plan.targets}
    split = split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=lambda t: t.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=parse_size(max_shard_size),
    )
    return [OutputFile(name, tuple(by_name[n] for n in names)) for name, names in split.filename_to_tensors.items()]


def check_destination(dest: Path, sources: Sequence[Path], force: bool) -> None:
    """Refuse destinations that would lose data.

    Raises:
        DestinationError: inside a source, containing a source while ``force`` would replace it, an existing
            non-empty directory without ``force``, a file, or a parent that cannot be written.
    """
    for src in sources:
        if is_within(dest, src):
            raise DestinationError(f"destination '{dest}' lies inside the source '{src}'; ckpttool never writes there")
        if dest.exists() and is_within(src, dest):
            raise DestinationError(f"destination '{dest}' contains the source '{src}'; replacing it would destroy the source")
    if dest.exists() or dest.is_symlink():
        if not dest.is_dir():
            raise DestinationError(f"destination '{dest}' exists and is not a directory")
        if any(dest.iterdir()) and not force:
            raise DestinationError(f"destination '{dest}' exists and is not empty; pass --force to replace it")
    parent = dest.parent if dest.parent != Path("") else Path(".")
    if not parent.is_dir():
        raise DestinationError(f"cannot create '{dest}': its parent directory '{parent}' does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise DestinationError(f"cannot create '{dest}': '{parent}' is not writable")


class Staging:
    """A staging directory beside ``dest``; :meth:`publish` renames it into place, failure removes it."""

    def __init__(self, dest: Path) -> None:
        self.dest = dest
        self.path = dest.parent / f".{dest.name}{PARTIAL}{uuid.uuid4().hex[:8]}"

    def __enter__(self) -> Staging:
        _remove_stale(self.dest)
        self.path.mkdir()
        return self

    def __exit__(self, kind: object, value: object, tb: object) -> None:
        if self.path.exists():
            shutil.rmtree(self.path, ignore_errors=True)

    def publish(self) -> None:
        old = None
        if self.dest.exists():
            old = self.dest.parent / f".{self.dest.name}.ckpttool-old-{uuid.uuid4().hex[:8]}"
            os.rename(self.dest, old)
        os.rename(self.path, self.dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def _remove_stale(dest: Path) -> None:
    """Staging directories of earlier runs that died (SIGKILL, power loss) are recognisable by name."""
    for stale in dest.parent.glob(f".{dest.name}{PARTIAL}*"):
        if stale.is_dir():
            shutil.rmtree(stale, ignore_errors=True)


def write_weights(
    plan: Plan, files: Sequence[OutputFile], directory: Path, on_bytes: Callable[[int], None] = lambda n: None
) -> None:
    """Write the safetensors files (and the index when there are several) and verify each."""
    loader = PieceLoader.for_plan(plan)
    for out in files:
        prefix, offsets = encode_header({t.name: (t.dtype, t.shape) for t in out.targets}, {"format": "pt"})
        path = directory / out.name
        try:
            write_file(path, prefix, [(t, offsets[t.name][0]) for t in out.targets], loader, on_bytes)
        except OSError as e:
            raise OutputError(f"'{out.name}': cannot write: {e.strerror or e}; nothing was published") from None
        _verify(path, out, len(prefix))
    if len(files) > 1:
        weight_map = {t.name: out.name for out in files for t in out.targets}
        index = {"metadata": {"total_size": plan.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_text(directory / INDEX, json.dumps(index, indent=2) + "\n")


def _verify(path: Path, out: OutputFile, prefix_len: int) -> None:
    expected = prefix_len + out.nbytes
    size = path.stat().st_size
    if size != expected:
        raise OutputError(f"'{out.name}': wrote {size} bytes, expected {expected}; is the disk full?")
    header = read_header(path, out.name)
    for t in out.targets:
        entry = header.entries.get(t.name)
        if entry is None or entry.shape != t.shape or entry.dtype != t.dtype:
            raise OutputError(f"'{out.name}': '{t.name}' was not written as planned")


def write_text(path: Path, text: str) -> None:
    """Write a small output file; a failure is an :class:`OutputError`."""
    try:
        path.write_text(text)
    except OSError as e:
        raise OutputError(f"'{path.name}': cannot write: {e.strerror or e}; nothing was published") from None


def write_extras(directory: Path, config: Mapping[str, object] | None, search: Sequence[Path], dtype: str | None) -> list[str]:
    """Write ``config.json`` (dtype updated when cast) and copy tokenizer/generation files found in ``search``."""
    written = []
    if config is not None:
        config = dict(config)
        if dtype is not None:
            from .dtypes import torch_dtype

            name = str(torch_dtype(dtype)).removeprefix("torch.")
            keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
            for key in keys:
                config[key] = name
        write_text(directory / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append("config.json")
    for name in EXTRA_FILES:
        for folder in search:
            candidate = folder / name
            if candidate.is_file():
                try:
                    shutil.copyfile(candidate, directory / name)
                except OSError as e:
                    raise SourceError(f"'{candidate}': cannot copy: {e.strerror or e}") from None
                written.append(name)
                break
    return written
