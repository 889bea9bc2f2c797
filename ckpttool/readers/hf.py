"""HuggingFace weights: ``model.safetensors``, or shards named by ``model.safetensors.index.json``; and the older
``.bin`` weights of transformers 4 (``pytorch_model.bin``, or shards named by ``pytorch_model.bin.index.json``:
:mod:`.hf_bin` reads them without running their pickles).

Every tensor is whole in one file, so each is one piece covering its whole shape. :func:`scan` reads the
directory tolerantly and reports every problem as a finding (the audit shows them all); :func:`read` refuses
the first problem that makes the checkpoint unreadable (the merge). Both kinds get the same checks. A directory
holding both is read as transformers' ``from_pretrained`` reads it: the safetensors, with a note that the
``.bin`` files were left unread.
"""

from __future__ import annotations

import json
import operator
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ckpttool.io import jsonfile
from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import RAW, Box, Layout, Piece
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.findings import Finding, finding
from ckpttool.io.paths import JSON_LIMIT, inside, read_source
from ckpttool.io.safetensors_format import Header, read_header
from ckpttool.readers import accelerate
from ckpttool.readers.base import FormatReader
from ckpttool.readers.hf_bin import BIN_INDEX, BIN_PATTERN, BIN_SINGLE, read_bin

NAME = "hf"
LOOKS_FOR = "pytorch_model.bin, pytorch_model.bin.index.json, model.safetensors or model.safetensors.index.json (HuggingFace)"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
ADAPTER = "adapter_model.safetensors"
#: problems that leave a tensor unreadable; the others (a wrong total_size, a stray file) do not stop a merge
FATAL = ("index-invalid", "index-outside", "index-missing-file", "header-invalid", "index-wrong-file")


@dataclass(frozen=True, slots=True)
class Weights:
    """One of the two ways transformers stores weights: the index's and the single file's names, the files an
    index should name (a glob), and how a file's tensors are read (a header of entries with byte ranges)."""

    index: str
    single: str
    pattern: str
    read_header: Callable[[Path, str], Header]

    def present(self, root: Path) -> bool:
        """True when ``root`` holds this kind's index or single file."""
        return (root / self.index).is_file() or (root / self.single).is_file()


SAFETENSORS = Weights(INDEX, SINGLE, "*.safetensors", read_header)
BIN = Weights(BIN_INDEX, BIN_SINGLE, BIN_PATTERN, read_bin)


@dataclass(frozen=True, slots=True)
class Scan:
    """A HuggingFace directory as far as it is readable, and every problem found on the way.

    ``refused``: for each file a ``header-invalid`` finding names, the error reading it raised (an unsafe pickle
    stays an :class:`~ckpttool.errors.UnsafePickleError` when :func:`read` refuses it)."""

    layout: Layout
    findings: tuple[Finding, ...]
    refused: dict[str, SourceError]


def matches(root: Path) -> bool:
    return SAFETENSORS.present(root) or BIN.present(root) or bool(accelerate.whole_model_files(root))


def read(root: Path, model: ModelInfo | None) -> Layout:
    result = scan(root)
    for f in result.findings:
        if f.code in FATAL:
            if f.code == "header-invalid" and f.file in result.refused:
                raise result.refused[f.file]
            raise (SourceNotFoundError if f.code == "index-missing-file" else SourceError)(f.message)
    return result.layout


def scan(root: Path) -> Scan:
    """Every tensor the index (or the single file) names, read from the headers; problems as findings."""
    builder = LayoutBuilder(str(root), NAME)
    found: list[Finding] = []
    refused: dict[str, SourceError] = {}
    weights = _chosen(root, builder)
    index, single = weights.index, weights.single
    if (root / index).is_file():
        weight_map, total_size = _read_index(root, index, found)
    else:
        weight_map, total_size = None, None
    keys_of: dict[str, list[str]] = {}
    for key, rel in (weight_map or {single: single}).items():
        keys_of.setdefault(rel, []).append(key)
    headers: dict[str, Header] = {}
    for rel, keys in sorted(keys_of.items()):
        header = _header(root, rel, keys if weight_map is not None else [], weights, found, refused)
        if header is not None:
            headers[rel] = header
    if weight_map is None:
        weight_map = {key: single for key in headers[single].entries} if single in headers else {}
    quoted = {rel: f"'{rel}'" for rel in headers}
    boxes: dict[tuple[int, ...], Box] = {}  # one box per shape, shared (a checkpoint has few shapes, 90k tensors)
    names: list[str] = []
    pieces: list[Piece] = []
    wheres: list[str] = []
    for key, rel in weight_map.items():
        header = headers.get(rel)
        if header is None:
            continue
        entry = header.entries.get(key)
        if entry is None:
            holders = [f for f, h in headers.items() if key in h.entries]
            also = f"; it is in '{holders[0]}'" if holders else ""
            found.append(finding("index-wrong-file", f"'{index}' puts '{key}' in '{rel}', but that file has no such tensor{also}",
                                 tensor=key, file=rel))
            continue
        box = boxes.get(entry.shape)
        if box is None:
            box = boxes[entry.shape] = Box.whole(entry.shape)
        names.append(key)
        pieces.append(Piece(rel, key, box, entry.dtype, RAW, entry.begin, entry.end - entry.begin))
        wheres.append(quoted[rel])
    builder.add_wholes(names, pieces, wheres)
    _cross_check(root, weights, weight_map, headers, total_size, found)
    return Scan(builder.build(), tuple(found), refused)


def _chosen(root: Path, builder: LayoutBuilder) -> Weights:
    """The weights transformers' ``from_pretrained`` loads: the safetensors when there are any, else the .bin."""
    if not SAFETENSORS.present(root):
        if BIN.present(root):
            return BIN
        if accelerate.whole_model_files(root):  # accelerate's FULL_STATE_DICT save_state: a .bin under its own name
            name = accelerate.the_whole_model_file(root)
            builder.note(accelerate.whole_note(root, name))
            return Weights(BIN_INDEX, name, BIN_PATTERN, read_bin)
        raise SourceNotFoundError(f"'{root}': neither {INDEX} nor {SINGLE} found (nor {BIN_INDEX} or {BIN_SINGLE})")
    if BIN.present(root):
        bins = sorted(p.name for p in root.glob(BIN_PATTERN))
        shown = ", ".join(f"'{b}'" for b in bins[:3]) + (f" and {len(bins) - 3} more" if len(bins) > 3 else "")
        builder.note(f"the directory holds both safetensors and .bin weights; read the safetensors, as transformers' "
                     f"from_pretrained does, and left {shown} unread")
    return SAFETENSORS


def _read_index(root: Path, index_name: str, found: list[Finding]) -> tuple[dict[str, str], object]:
    try:
        index = jsonfile.loads(read_source(root / index_name, index_name, limit=JSON_LIMIT))
    except SourceError as e:  # unreadable, or not a regular file: the message names it
        found.append(finding("index-invalid", str(e), file=index_name))
        return {}, None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        found.append(finding("index-invalid", f"'{index_name}': cannot read: {e}", file=index_name))
        return {}, None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        found.append(finding("index-invalid", f"'{index_name}': no 'weight_map' of tensor names to file names",
                             file=index_name))
        return {}, None
    metadata = index.get("metadata")
    return weight_map, metadata.get("total_size") if isinstance(metadata, dict) else None


def _header(root: Path, rel: str, keys: list[str], weights: Weights, found: list[Finding],
            refused: dict[str, SourceError]) -> Header | None:
    try:
        path = inside(root, rel, named_by=weights.index)
    except SourceError as e:
        found.append(finding("index-outside", str(e), file=rel))
        return None
    if not path.exists():  # a FIFO or a device is there: read_header says it is not a regular file
        more = f" (and {len(keys) - 1} more tensors)" if len(keys) > 1 else ""
        found.append(finding("index-missing-file", f"'{weights.index}' puts '{keys[0]}'{more} in '{rel}', which does "
                             "not exist", tensor=keys[0], file=rel))
        return None
    try:
        return weights.read_header(path, rel)
    except SourceError as e:
        found.append(finding("header-invalid", str(e), file=rel))
        refused[rel] = e
        return None


def _cross_check(root: Path, weights: Weights, weight_map: dict[str, str], headers: dict[str, Header],
                 total_size: object, found: list[Finding]) -> None:
    """Tensors in two files, tensors no index entry names, files no index entry names, total_size."""
    index = weights.index
    holders: dict[str, list[str]] = {}
    stored = [key for header in headers.values() for key in header.entries]
    unique = set(stored)
    listed = len(unique) == len(stored) and weight_map.keys() >= unique  # else a tensor twice or one unlisted
    if not listed:
        for rel, header in headers.items():
            for key in header.entries:
                holders.setdefault(key, []).append(rel)
    for key, files in holders.items():
        if len(files) > 1:
            found.append(finding("tensor-duplicated", f"'{key}' is stored in {' and '.join(repr(f) for f in files)}",
                                 tensor=key, file=files[1]))
        elif key not in weight_map:
            found.append(finding("tensor-unlisted", f"'{key}' is in '{files[0]}' but not in '{index}'; transformers will not load it",
                                 tensor=key, file=files[0]))
    if weights is BIN:
        if (root / index).is_file():
            named = set(weight_map.values())
            for path in sorted(root.glob(weights.pattern)):
                if path.name not in named:
                    found.append(finding("file-unreferenced", f"'{path.name}' is not named by '{index}'; transformers "
                                         "ignores it (from_pretrained reads only the files the index names)",
                                         file=path.name))
    else:
        found.extend(_stray_files(root, set(weight_map.values()) if (root / INDEX).is_file() else None))
    if total_size is not None and all(f.code not in FATAL for f in found):
        if weights is BIN:  # tensors that share a storage (tied weights) are counted once, as transformers counts
            spans = {(rel, entry.begin, entry.end) for key, rel in weight_map.items()
                     for entry in (headers[rel].entries[key],)}
            actual = sum(end - begin for _, begin, end in spans)
        elif listed:  # each tensor of the index in its file (no fatal finding) and no other: every entry, at C speed
            entries = [entry for header in headers.values() for entry in header.entries.values()]
            actual = sum(map(operator.sub, map(_END, entries), map(_BEGIN, entries)))
        else:
            actual = sum(headers[rel].entries[key].end - headers[rel].entries[key].begin for key, rel in weight_map.items())
        if total_size != actual:
            found.append(finding("index-total-size", f"'{index}': metadata.total_size is {total_size}, but its tensors hold "
                                 f"{actual} bytes", file=index))


_END, _BEGIN = operator.attrgetter("end"), operator.attrgetter("begin")


def _stray_files(root: Path, named: set[str] | None) -> list[Finding]:
    """The ``*.safetensors`` files of ``root`` that ``from_pretrained`` does not read as this scan does: it loads
    ``model.safetensors`` when there is one, and the index only when there is none; ``named``: the files the
    index names, None without an index."""
    found = []
    for path in sorted(root.glob("*.safetensors")):
        if path.name == ADAPTER:  # a PEFT adapter beside its base: from_pretrained reads it through adapter_config.json
            continue
        if named is None and path.name != SINGLE:
            found.append(finding("file-unreferenced", f"'{path.name}' is not {SINGLE} and no {INDEX} names it: "
                                 f"transformers ignores it (from_pretrained reads only {SINGLE})", file=path.name))
        elif named is not None and path.name == SINGLE and SINGLE not in named:
            found.append(finding("index-shadowed", f"'{SINGLE}' is not named by '{INDEX}', but transformers loads it and "
                                 f"ignores the index (from_pretrained reads {SINGLE} first): the tensors audited here are "
                                 f"not the ones it loads. Remove '{SINGLE}' or the index", file=SINGLE))
        elif named is not None and path.name not in named:
            found.append(finding("file-unreferenced", f"'{path.name}' is not named by '{INDEX}': transformers ignores it "
                                 "(from_pretrained reads only the files the index names)", file=path.name))
    return found

READER = FormatReader(NAME, LOOKS_FOR, matches, read)
