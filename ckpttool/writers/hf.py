"""The HuggingFace output: sharded safetensors + index + config + tokenizer, published atomically.

Everything is written into a staging directory beside the destination (see :mod:`ckpttool.writers.staging`),
verified, and renamed into place at the end; on an error the staging directory is removed, so the
destination never holds a partial checkpoint. A journal in the staging directory records every output file
finished so far with its digest, so a merge killed after hours continues with ``--resume`` where it stopped,
re-checking what it keeps.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ckpttool.execute.buffers import distinct_targets, Chunk, buffer_sizes, chunks, piece_uses
from ckpttool.execute.reads import Reader
from ckpttool.execute.executor import file_digest
from ckpttool.execute.digest import checks
from ckpttool.execute.buffers import predict_peak_bytes as stream_peak_bytes
from ckpttool.execute.executor import write_file as stream_file
from ckpttool.plan.plan import Plan, target_sizes
from ckpttool.errors import ArgumentError, OutputError, SourceError
from ckpttool.io.paths import link_escapes
from ckpttool.quant.encode import RoundTrip
from ckpttool.io.safetensors_format import encode_header, read_header
from ckpttool.writers.destination import EXTRA_FILES, INDEX
from ckpttool.writers.files import OutputFile
from ckpttool.writers.journal import Journal, write_text
from ckpttool.writers.trust import create_file

__all__ = [
    "SIZE_HELP", "SIZE_UNITS", "assign_files", "check_written", "file_layout", "find_extras", "parse_size",
    "predict_peak_bytes", "write_extras", "write_index", "write_weights",
]

log = logging.getLogger(__name__)


#: size units: decimal as huggingface_hub (``5GB`` is 5 * 1000**3 bytes), binary with an ``i`` (``5GiB``)
SIZE_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
              "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
SIZE_HELP = "give bytes, or a number with KB, MB, GB, TB (decimal) or KiB, MiB, GiB, TiB (binary), e.g. 5GB or 500MiB"
_SIZE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-z]*)\s*", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """Bytes from ``"5GB"``/``"500MB"`` (decimal units, as huggingface_hub), ``"5GiB"``/``"500MiB"`` (binary) or
    a plain integer. Units are case-insensitive.

    Raises:
        ValueError: not a number of bytes or a number with one of :data:`SIZE_UNITS`.
    """
    if isinstance(text, int):
        return text
    match = _SIZE.fullmatch(text)
    unit = match.group(2).upper() if match else ""
    if match is None or (unit and unit not in SIZE_UNITS):
        raise ValueError(f"invalid size {text!r}: {SIZE_HELP}")
    return int(float(match.group(1)) * SIZE_UNITS[unit or "B"])


def _shard_size(value: str | int) -> int:
    try:
        return parse_size(value)
    except (ValueError, TypeError):
        raise ArgumentError(f"max_shard_size={value!r} is not a size: {SIZE_HELP}") from None


def assign_files(plan: Plan, max_shard_size: str | int = "5GB") -> list[OutputFile]:
    """Split the plan's targets into ``model-0000i-of-0000N.safetensors`` files, as huggingface_hub does: all in
    ``model.safetensors`` when they fit in one file (decided here, without importing huggingface_hub)."""
    by_name = {t.name: t for t in plan.targets}
    limit = _shard_size(max_shard_size)
    if by_name and sum(target_sizes(list(by_name.values()))) <= limit:  # no tensor tips a file over: one file
        return [OutputFile("model.safetensors", tuple(by_name.values()))]
    from huggingface_hub import split_state_dict_into_shards_factory

    split = split_state_dict_into_shards_factory(
        by_name,
        get_storage_size=lambda t: t.nbytes,
        filename_pattern="model{suffix}.safetensors",
        max_shard_size=limit,
    )
    return [OutputFile(name, tuple(by_name[n] for n in names)) for name, names in split.filename_to_tensors.items()]


def write_weights(
    plan: Plan,
    mine: Sequence[OutputFile],
    directory: Path,
    identity: str,
    on_bytes: Callable[[int], None] = lambda n: None,
    *,
    verify: bool = False,
    workers: int = 1,
    rank: int = 0,
    round_trips: dict[str, RoundTrip] | None = None,
) -> int:
    """Write the safetensors files ``mine`` (this process's share of the output), check each, and journal it.

    Tensors are streamed in row chunks by ``workers`` threads (:mod:`ckpttool.execute.executor`). Files an interrupted
    run of the same plan (``identity``, see :func:`plan_id`) finished are kept after their digest is checked
    again (see :class:`Journal`). With ``verify``, each file written is read back from disk and its digest
    compared with the bytes written. The staging directory must have been cleaned once (:func:`clean_staging`)
    before any process writes; the index is written once all are done (:func:`write_index`).

    Returns:
        How many files were kept from an earlier run. ``round_trips`` (if given) receives the round trip of each
        weight quantized here (files kept from an earlier run are not measured again).
    """
    layouts = [file_layout(out) for out in mine]
    journal = Journal(directory, identity, rank)
    every_chunk = [c for _, chunk_list in layouts for c in chunk_list]
    reader = Reader(plan.root, piece_uses(every_chunk), buffer_sizes(every_chunk))
    kept = 0
    try:
        for out, (prefix, chunk_list) in zip(mine, layouts):
            path = directory / out.name
            size = len(prefix) + out.nbytes
            compute = lambda path=path, prefix=prefix, chunk_list=chunk_list: file_digest(  # noqa: E731
                path, len(prefix), checks(chunk_list, reader))
            if journal.kept(out.name, path, size, compute):
                kept += 1
                on_bytes(out.nbytes)
                continue
            try:
                path.unlink(missing_ok=True)  # a file that failed its check: the name only, created anew
                digest = stream_file(path, prefix, chunk_list, reader, workers, on_bytes)
            except OSError as e:
                raise OutputError(f"'{out.name}': cannot write: {e.strerror or e}; nothing was published") from None
            check_written(path, out, len(prefix), prefix)
            if verify:
                _read_back(path, out.name, digest, compute)
            journal.record(out.name, size, digest)
    finally:
        reader.close()
        if round_trips is not None:
            round_trips.update(reader.round_trips)
    return kept


def write_index(plan: Plan, files: Sequence[OutputFile], directory: Path) -> None:
    """``model.safetensors.index.json`` when there are several files."""
    if len(files) > 1:
        weight_map = {t.name: out.name for out in files for t in out.targets}
        index = {"metadata": {"total_size": plan.nbytes}, "weight_map": dict(sorted(weight_map.items()))}
        write_text(directory / INDEX, json.dumps(index, indent=2) + "\n")


def file_layout(out: OutputFile) -> tuple[bytes, list[Chunk]]:
    """The header bytes of an output file and its chunks in file order."""
    prefix, offsets = encode_header({t.name: (t.dtype, t.shape) for t in out.targets}, {"format": "pt"})
    return prefix, [c for t in out.targets for c in chunks(t, offsets[t.name][0])]


def predict_peak_bytes(plan: Plan, workers: int = 1) -> int:
    """The most memory the writer holds at once (see :func:`ckpttool.execute.buffers.predict_peak_bytes`)."""
    chunk_list = [c for t in distinct_targets(plan.targets) for c in chunks(t, 0)]  # the targets that can change it
    return stream_peak_bytes(chunk_list, workers)


def _read_back(path: Path, name: str, digest: str, compute: Callable[[], str]) -> None:
    """Drop the file from the page cache, read it from disk, and compare its digest with what was written."""
    try:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
        found = compute()
    except OSError as e:
        raise OutputError(f"'{name}': cannot read it back: {e.strerror or e}; nothing was published") from None
    if found != digest:
        raise OutputError(
            f"'{name}': read back from disk, its digest is {found[:16]}... but {digest[:16]}... was written; "
            "the disk or file system corrupted it. Nothing was published"
        )


def check_written(path: Path, out: OutputFile, prefix_len: int, header: bytes | None = None) -> None:
    """The file has the planned size and its header holds every tensor with the planned dtype and shape: given the
    ``header`` written, compared byte for byte (offsets included; a 90k-tensor header takes a second to parse),
    and parsed only when it differs, to name the tensor written wrongly."""
    expected = prefix_len + out.nbytes
    size = path.stat().st_size
    if size != expected:
        raise OutputError(f"'{out.name}': wrote {size} bytes, expected {expected}; is the disk full?")
    if header is not None:
        try:
            with open(path, "rb") as f:
                if f.read(len(header)) == header:
                    return
        except OSError as e:
            raise OutputError(f"'{out.name}': cannot read it back: {e.strerror or e}; nothing was published") from None
    parsed = read_header(path, out.name)
    for t in out.targets:
        entry = parsed.entries.get(t.name)
        if entry is None or entry.shape != t.shape or entry.dtype != t.dtype:
            raise OutputError(f"'{out.name}': '{t.name}' was not written as planned")
    if header is not None:
        raise OutputError(f"'{out.name}': its header on disk differs from the header written (offsets or metadata); "
                          "the disk or file system corrupted it. Nothing was published")


def write_extras(directory: Path, config: Mapping[str, object] | None, search: Sequence[Path], dtype: str | None) -> list[str]:
    """Write ``config.json`` (dtype updated when cast) and copy tokenizer/generation files found in ``search``."""
    written = []
    if config is not None:
        config = dict(config)
        if dtype is not None:
            from ckpttool.io.dtypes import torch_dtype

            name = str(torch_dtype(dtype)).removeprefix("torch.")
            keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
            for key in keys:
                config[key] = name
        write_text(directory / "config.json", json.dumps(config, indent=2, sort_keys=True) + "\n")
        written.append("config.json")
    extras, skipped = find_extras(search)
    for note in skipped.values():
        log.warning("%s", note)
    for candidate in extras:
        try:
            with open(candidate, "rb") as source:
                with os.fdopen(create_file(directory / candidate.name), "wb") as copy:
                    shutil.copyfileobj(source, copy)
        except OSError as e:
            raise SourceError(f"'{candidate}': cannot copy: {e.strerror or e}") from None
        written.append(candidate.name)
    return written


def find_extras(search: Sequence[Path]) -> tuple[list[Path], dict[Path, str]]:
    """The tokenizer and generation files to copy (each name from the first folder of ``search`` holding it),
    and those skipped, each with a note, because they are symlinks out of their folder (``tokenizer.json ->
    /etc/passwd`` is never read nor published); links inside a hub cache repository folder are followed."""
    extras: list[Path] = []
    skipped: dict[Path, str] = {}
    for name in EXTRA_FILES:
        candidate = next((f / name for f in search if (f / name).is_file()), None)
        target = link_escapes(candidate, candidate.parent) if candidate is not None else None
        if candidate is not None and target is not None:
            skipped[candidate] = (f"'{candidate}' not copied: it is a symlink to '{target}', outside the checkpoint; "
                                  "copy the file in its place to ship it")
        elif candidate is not None:
            extras.append(candidate)
    return extras, skipped
