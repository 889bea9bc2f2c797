"""HuggingFace safetensors: ``model.safetensors``, or shards named by ``model.safetensors.index.json``.

Every tensor is whole in one file, so each is one piece covering its whole shape.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import SourceError, SourceNotFoundError
from ..layout import RAW, Box, Layout, LayoutBuilder, Piece
from ..models import ModelInfo
from ..paths import inside
from ..safetensors_format import Header, read_header

NAME = "hf"
LOOKS_FOR = "model.safetensors or model.safetensors.index.json (HuggingFace)"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def matches(root: Path) -> bool:
    return (root / INDEX).is_file() or (root / SINGLE).is_file()


def read(root: Path, model: ModelInfo | None) -> Layout:
    builder = LayoutBuilder(str(root), NAME)
    if (root / INDEX).is_file():
        weight_map = _weight_map(root)
    elif (root / SINGLE).is_file():
        weight_map = {key: SINGLE for key in read_header(root / SINGLE, SINGLE).entries}
    else:
        raise SourceNotFoundError(f"'{root}': neither {INDEX} nor {SINGLE} found")
    headers: dict[str, Header] = {}
    for key, rel in weight_map.items():
        path = inside(root, rel, named_by=INDEX)
        if rel not in headers:
            if not path.is_file():
                raise SourceNotFoundError(f"'{INDEX}' puts '{key}' in '{rel}', which does not exist")
            headers[rel] = read_header(path, rel)
        entry = headers[rel].entries.get(key)
        if entry is None:
            raise SourceError(f"'{INDEX}' puts '{key}' in '{rel}', but that file has no such tensor")
        where = f"'{rel}'"
        if builder.declare(key, entry.shape, entry.dtype, where=where):
            builder.add(key, Piece(rel, key, Box.whole(entry.shape), entry.dtype, RAW, entry.begin, entry.end - entry.begin))
    return builder.build()


def _weight_map(root: Path) -> dict[str, str]:
    try:
        index = json.loads((root / INDEX).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise SourceError(f"'{INDEX}': cannot read: {e}") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise SourceError(f"'{INDEX}': no 'weight_map' of tensor names to file names")
    return weight_map
