"""The classes a ColossalAI model shard's pickle may name, each with the ColossalAI releases that write it.

ColossalAI's ``save_model(..., shard=True)`` writes ``.bin`` shards with ``torch.save`` of a plain
``OrderedDict`` of tensors (``.safetensors`` shards have no pickle). :data:`TABLE` lists every class the
ColossalAI reader lets such a pickle name: those the fixture matrix shows each release writing (the fixtures
``colossalai_real_*`` of 0.5.0, made by ``fixtures/make_colossalai_real.py``, and ``colossalai_v0_4_*`` of
0.4.9; ``tests/test_versions_more.py`` checks both ways), and the rest of what
:func:`ckpttool.io.torch_save.scan` accepts for any ``torch.save`` file, with no release listed and where it would
come from. Anything else is refused by :class:`ShardAllow`, naming the class, the releases ckpttool knows and
what the checkpoint records of its writer (:func:`refusal`): ColossalAI records no version of its own (its index
holds only ``metadata.total_size``); the ``config.json`` saved beside the shards records the transformers
release, which each ColossalAI release pins (:data:`TRANSFORMERS_PINS`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.console.terminal import escaped
from ckpttool.errors import SourceError, UnsafePickleError
from ckpttool.io import jsonfile
from ckpttool.io.paths import JSON_LIMIT, read_inside
from ckpttool.io.torch_pickle import accepted_classes
from ckpttool.fast.deferred import torch

#: the ColossalAI releases whose checkpoints the fixtures hold (``colossalai_real_*``, ``colossalai_v0_4_*``)
RELEASES = ("0.4.9", "0.5.0")
#: the transformers release each ColossalAI release of the matrix pins (its requirements.txt): ``config.json``
#: records the transformers that saved it, the one trace of the ColossalAI release a checkpoint keeps
TRANSFORMERS_PINS = {"4.39.3": "0.4.9", "4.51.3": "0.5.0"}
_SHARD = "the state dict of every .bin model shard"


@dataclass(frozen=True, slots=True)
class Allowed:
    """One class a ColossalAI ``.bin`` shard may name.

    Attributes:
        module, name: as the pickle names it.
        written_by: the ColossalAI releases whose shards pickle it (the fixtures show it); empty for a class
            ``torch.save`` may write that no fixture of the matrix has.
        where: what pickles it, or where it would come from.
    """

    module: str
    name: str
    written_by: tuple[str, ...]
    where: str

    @property
    def qualified(self) -> str:
        return f"{self.module}.{self.name}"


#: every class a ColossalAI model shard's pickle may name, with the releases that write it
TABLE: tuple[Allowed, ...] = (
    Allowed("collections", "OrderedDict", RELEASES, _SHARD),
    Allowed("torch._utils", "_rebuild_tensor_v2", RELEASES, "every tensor of a shard"),
    Allowed("torch", "FloatStorage", RELEASES, "the tensors of an fp32 model (precision='fp32')"),
    Allowed("torch", "BFloat16Storage", RELEASES, "the tensors of a bf16 model (precision='bf16')"),
    Allowed("torch", "HalfStorage", (), "the tensors of an fp16 model (precision='fp16'; the matrix's cases are fp32 "
                                        "and bf16)"),
    *(Allowed("torch", storage, (), "a buffer of that dtype (no fixture's model has one)")
      for storage in ("DoubleStorage", "LongStorage", "IntStorage", "ShortStorage", "CharStorage", "ByteStorage",
                      "BoolStorage")),
    *(Allowed(module, name, (), "torch.save's own, for a tensor subclass or a parameter saved as such; ColossalAI "
                                "saves detached tensors")
      for module, name in (("torch._utils", "_rebuild_tensor_v3"), ("torch._utils", "_rebuild_parameter"),
                           ("torch._utils", "_rebuild_parameter_with_state"),
                           ("torch._tensor", "_rebuild_from_type_v2"),
                           ("torch._utils", "_rebuild_from_type_v2"), ("torch", "Tensor"),
                           ("torch.nn.parameter", "Parameter"), ("torch", "Size"))),
)
_BY_NAME = {(a.module, a.name): a for a in TABLE}
_SCANS = frozenset(accepted_classes())


def recorded(root: Path) -> str:
    """What the checkpoint in ``root`` records of the release that wrote it, as a clause of a message."""
    try:
        config = jsonfile.loads(read_inside(root, "config.json", limit=JSON_LIMIT))
    except (OSError, SourceError, UnicodeDecodeError, json.JSONDecodeError):
        config = None
    version = config.get("transformers_version") if isinstance(config, dict) else None
    clause = ("the checkpoint records no ColossalAI version (ColossalAI writes none: its index holds only "
              "metadata.total_size)")
    if not isinstance(version, str) or len(version) > 40:
        return clause
    pinned = TRANSFORMERS_PINS.get(version)
    return (f"{clause}; its config.json records transformers {escaped(version)}, "
            + (f"the release ColossalAI {pinned} pins" if pinned else
               "which no ColossalAI release ckpttool knows pins"))


def refusal(label: str, qualified: str, root: Path) -> str:
    """The message refusing a class outside :data:`TABLE` in the shard ``label`` of the checkpoint ``root``."""
    return (
        f"'{label}': refused to unpickle: it asks for '{qualified}', which no ColossalAI model shard ckpttool knows "
        f"pickles (nothing was executed); {recorded(root)}. ckpttool reads the classes that ColossalAI "
        f"{' and '.join(RELEASES)} write: a model shard holds a plain dict of tensors. If a newer or older release "
        "wrote this checkpoint, report the class and the release"
    )


class ShardAllow(Mapping[tuple[str, str], Any]):
    """:data:`TABLE` as the allow-list of :func:`ckpttool.io.torch_save.scan` for one shard.

    Every class of :data:`TABLE` is one ``scan`` accepts by itself (so none is looked up here); a storage class or a
    dtype outside the table is left to ``scan`` (a ``KeyError``); any other class is refused with
    :func:`refusal`, which names ColossalAI's releases instead of ``scan``'s generic message. It adds no class:
    it iterates over nothing.
    """

    def __init__(self, label: str, root: Path) -> None:
        self.label = label  # the shard whose pickle asks
        self.root = root

    def __getitem__(self, key: tuple[str, str]) -> Any:
        module, name = key
        if key in _BY_NAME or f"{module}.{name}" in _SCANS or (
                module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            raise KeyError(key)  # scan's own: a tensor, a container, a storage or a dtype
        raise UnsafePickleError(refusal(self.label, f"{module}.{name}", self.root))

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(())

    def __len__(self) -> int:
        return 0
