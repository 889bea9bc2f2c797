"""The classes a verl/FSDP DTensor pickle names, as stand-ins, each with the torch releases that write it.

A rank file's DTensor pickles as ``_rebuild_wrapper_subclass`` (the *global* dtype, size and stride) plus a state
holding the rank's ``_local_tensor`` and its ``_spec`` (``DeviceMesh``, ``placements``, ``tensor_meta`` and, in
newer torch, ``shard_order``). The classes are torch's, not verl's: verl (``FSDPCheckpointManager``) saves
``model.state_dict()`` with ``torch.save``, so which classes a rank file names, and under which module, depends on
the torch beside verl. :data:`TABLE` lists each class with the torch releases whose rank files the fixtures show
pickling it (``verl_*``, made by ``fixtures/make_verl.py`` under each torch; ``tests/test_versions_more.py`` checks
both ways) and the verl releases whose own checkpoint manager wrote fixtures pickling it (``verl_v*``, made by
``fixtures/make_verl_releases.py``; ``tests/test_verl_releases.py`` checks both ways) and maps it to a stand-in that
only keeps data: nothing is imported from torch.distributed and nothing runs. A class outside the table is refused
by :class:`RankAllow`, naming it, the releases ckpttool knows and what the checkpoint records of its writer
(:func:`refusal`): verl records neither its version nor torch's (``fsdp_config.json`` holds ``FSDP_version`` and
``world_size``; ``huggingface/config.json`` the transformers).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ckpttool.console.terminal import escaped
from ckpttool.errors import SourceError, UnsafePickleError
from ckpttool.fast.deferred import torch
from ckpttool.io import jsonfile
from ckpttool.io.paths import JSON_LIMIT, read_inside
from ckpttool.io.pickle_bounds import charge, ints, text
from ckpttool.io.safe_pickle import record_class
from ckpttool.io.torch_pickle import accepted_classes


@dataclass(slots=True)
class WrapperStandIn:
    """What ``torch._utils._rebuild_wrapper_subclass`` gives: the global dtype, size and stride."""

    dtype: Any
    size: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_wrapper_subclass(cls: Any, dtype: Any, size: Any, stride: Any, *rest: Any) -> WrapperStandIn:
    return WrapperStandIn(dtype, ints(size), ints(stride))


class DTensorStandIn:
    """A DTensor as data: ``wrapper`` (global dtype/size), ``local`` (the rank's stored tensor), ``spec``."""

    def __init__(self, wrapper: Any, state: Any) -> None:
        self.wrapper = wrapper
        charge(state, *(state if isinstance(state, tuple) else ()))
        slots = {}
        if isinstance(state, tuple):
            for part in state:
                if isinstance(part, dict):
                    slots.update(part)
        elif isinstance(state, dict):
            slots = state
        self.local = slots.get("_local_tensor")
        self.spec = slots.get("_spec")


class _Args:
    """A stand-in for a NamedTuple-like class rebuilt with ``NEWOBJ`` and positional arguments."""

    fields: tuple[str, ...] = ()

    def __new__(cls, *args: Any, **kwargs: Any) -> _Args:  # noqa: PYI034 (stand-in, never subclassed further)
        charge(*args, *kwargs.values())
        obj = object.__new__(cls)
        obj.__dict__.update(zip(cls.fields, args))
        obj.__dict__.update(kwargs)
        return obj

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        charge(state)
        if isinstance(state, dict):
            self.__dict__.update(state)


class TensorMetaStandIn(_Args):
    fields = ("shape", "stride", "dtype")


class _ShardOrderEntry(_Args):
    fields = ("tensor_dim", "mesh_dims")


_Shard, _Replicate, _Strided, _Partial = (record_class(n) for n in ("Shard", "Replicate", "_StridedShard", "Partial"))
_Mesh, _Spec = record_class("DeviceMesh"), record_class("DTensorSpec")

#: the torch releases whose verl rank files the fixtures hold (``verl_*``; ``verl_torch2_<minor>_*`` for the older)
TORCH = ("2.6", "2.10", "2.13")
#: the verl releases whose own ``FSDPCheckpointManager.save_checkpoint`` wrote fixtures (``verl_v*``, made by
#: ``fixtures/make_verl_releases.py``: 0.3 with FSDP1, 0.5 with FSDP1 and FSDP2, 0.9 with FSDP2)
VERL_RELEASES = ("0.3.0.post1", "0.5.0", "0.9.1")
#: the verl code whose files the fixtures hold; its rank files are ``torch.save`` of the state dict
VERL = (f"verl {', '.join(VERL_RELEASES[:-1])} and {VERL_RELEASES[-1]}'s FSDPCheckpointManager (FSDP1 and "
        "FSDP2; the rank files are torch.save(model.state_dict()))")
_FROM_2_10 = ("2.10", "2.13")


@dataclass(frozen=True, slots=True)
class Allowed:
    """One class a verl rank file may name.

    Attributes:
        stand_in: what the pickle gets instead (keeps data, runs nothing).
        torch: the torch releases whose rank files pickle it (the fixtures show it); empty for a module torch has
            pickled the class from in a release outside the matrix, or a placement no fixture has.
        where: what pickles it.
        verl: the verl releases (:data:`VERL_RELEASES`) whose own rank files, written beside torch 2.13, pickle it.
    """

    stand_in: Any
    torch: tuple[str, ...]
    where: str
    verl: tuple[str, ...] = ()


_DTENSOR = "every DTensor of a rank file"


def _except_2_10(releases: tuple[str, ...]) -> tuple[str, ...]:
    return tuple(r for r in releases if r != "2.10")

_TABLE: dict[tuple[str, str], Allowed] = {
    ("torch._utils", "_rebuild_wrapper_subclass"): Allowed(
        _rebuild_wrapper_subclass, TORCH, "a DTensor's global dtype, size and stride"),
    ("torch.serialization", "_get_layout"): Allowed(text, TORCH, "the layout of _rebuild_wrapper_subclass"),
    ("torch", "device"): Allowed(lambda *args: text(args[0]) if args else "cpu", TORCH,
                                 "the device of _rebuild_wrapper_subclass"),
    ("torch.distributed.device_mesh", "DeviceMesh"): Allowed(_Mesh, TORCH, "DTensorSpec.mesh"),
    ("torch.distributed._mesh_layout", "_MeshLayout"): Allowed(
        record_class("_MeshLayout"), _FROM_2_10, "DeviceMesh's layout of its dims (torch 2.10 on)"),
    ("torch.distributed._mesh_layout", "_FlatLayout"): Allowed(
        record_class("_FlatLayout"), ("2.13",), "the flattened layout inside DeviceMesh's (torch 2.13; not 2.10)"),
    ("builtins", "set"): Allowed(set, (), "a plain container; no fixture names it"),
    ("builtins", "frozenset"): Allowed(frozenset, (), "a plain container; no fixture names it"),
}
# the modules torch has pickled DTensor classes under: torch.distributed.tensor since 2.5 (2.6, 2.10 and 2.13 pickle
# DTensor there), torch.distributed._tensor before
for _module, _torch in (("torch.distributed.tensor", TORCH), ("torch.distributed.tensor._api", ()),
                        ("torch.distributed._tensor.api", ()), ("torch.distributed._tensor", ())):
    _TABLE[(_module, "DTensor")] = Allowed(DTensorStandIn, _torch, _DTENSOR)
for _module, _torch in (("torch.distributed.tensor._dtensor_spec", TORCH),
                        ("torch.distributed._tensor.placement_types", ()),
                        ("torch.distributed.tensor.placement_types", ())):
    _TABLE[(_module, "DTensorSpec")] = Allowed(_Spec, _torch, "DTensor._spec")
    _TABLE[(_module, "TensorMeta")] = Allowed(TensorMetaStandIn, _torch, "DTensorSpec.tensor_meta")
    _TABLE[(_module, "ShardOrderEntry")] = Allowed(
        _ShardOrderEntry, tuple(t for t in _torch if t != "2.6"), "DTensorSpec.shard_order (torch 2.10 on)")
for _module, _torch in (("torch.distributed.tensor.placement_types", TORCH),
                        ("torch.distributed._tensor.placement_types", ())):
    _TABLE[(_module, "Shard")] = Allowed(_Shard, _torch, "a placement: a dim split over a mesh dim")
    # torch 2.10's fixture is FSDP2 on a 1-D mesh only: its DTensor cannot gather a _StridedShard (make_verl.py)
    _TABLE[(_module, "Replicate")] = Allowed(_Replicate, _except_2_10(_torch), "a placement: HSDP or TP's replicated "
                                                                              "tensors")
    _TABLE[(_module, "_StridedShard")] = Allowed(_Strided, _except_2_10(_torch), "a placement: FSDP2 over TP (2-D "
                                                                                 "mesh)")
    _TABLE[(_module, "Partial")] = Allowed(_Partial, (), "a placement no saved state dict holds (refused later)")
    _TABLE[(_module, "_Partial")] = Allowed(_Partial, (), "Partial's older, private name")

# what every verl release's FSDP1 and FSDP2 rank files pickle beside torch 2.13 (a DTensor on a 1-D mesh: Shard(0))
for _key in (("torch._utils", "_rebuild_wrapper_subclass"), ("torch.serialization", "_get_layout"), ("torch", "device"),
             ("torch.distributed.device_mesh", "DeviceMesh"), ("torch.distributed._mesh_layout", "_MeshLayout"),
             ("torch.distributed._mesh_layout", "_FlatLayout"), ("torch.distributed.tensor", "DTensor"),
             ("torch.distributed.tensor._dtensor_spec", "DTensorSpec"),
             ("torch.distributed.tensor._dtensor_spec", "TensorMeta"),
             ("torch.distributed.tensor._dtensor_spec", "ShardOrderEntry"),
             ("torch.distributed.tensor.placement_types", "Shard")):
    _TABLE[_key] = replace(_TABLE[_key], verl=VERL_RELEASES)

#: every class a verl rank file may name, with the torch (and verl) releases that write it
TABLE: Mapping[tuple[str, str], Allowed] = _TABLE
#: ``(module, name)`` -> stand-in, as :func:`ckpttool.io.torch_save.scan` takes an allow-list
ALLOW = {key: entry.stand_in for key, entry in TABLE.items()}
_SCANS = frozenset(accepted_classes())


def recorded(root: Path) -> str:
    """What the step directory ``root`` records of the verl and torch that wrote it, as a clause of a message."""
    found = []
    for rel, keys in (("fsdp_config.json", ("FSDP_version",)), ("huggingface/config.json", ("transformers_version",))):
        try:
            data = jsonfile.loads(read_inside(root, rel, limit=JSON_LIMIT))
        except (OSError, SourceError, UnicodeDecodeError, json.JSONDecodeError):
            continue
        for key in keys:
            value = data.get(key) if isinstance(data, dict) else None
            if isinstance(value, (int, str)) and len(str(value)) < 40:
                found.append(f"{key} {escaped(str(value))} in '{rel}'")
    return ("the checkpoint records no verl or torch version (verl writes neither)"
            + (f"; it records {' and '.join(found)}" if found else ""))


def refusal(label: str, qualified: str, root: Path) -> str:
    """The message refusing a class outside :data:`TABLE` in the rank file ``label`` of the step ``root``."""
    return (
        f"'{label}': refused to unpickle: it asks for '{qualified}', which no verl rank file ckpttool knows pickles "
        f"(nothing was executed); {recorded(root)}. ckpttool reads the DTensor classes that torch "
        f"{', '.join(TORCH[:-1])} and {TORCH[-1]} pickle in {VERL}. If a newer torch or another saver wrote this "
        "checkpoint, report the class and the releases"
    )


class RankAllow(Mapping[tuple[str, str], Any]):
    """:data:`TABLE` as the allow-list of :func:`ckpttool.io.torch_save.scan` for one rank file: a listed class
    gives its stand-in; one ``scan`` accepts by itself (a tensor, a container, a storage, a dtype) is left to it;
    any other is refused with :func:`refusal`."""

    def __init__(self, label: str, root: Path) -> None:
        self.label = label  # the rank file whose pickle asks
        self.root = root

    def __getitem__(self, key: tuple[str, str]) -> Any:
        found = TABLE.get(key)
        if found is not None:
            return found.stand_in
        module, name = key
        if f"{module}.{name}" in _SCANS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            raise KeyError(key)
        raise UnsafePickleError(refusal(self.label, f"{module}.{name}", self.root))

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(TABLE)

    def __len__(self) -> int:
        return len(TABLE)
