"""The classes a verl/FSDP DTensor pickle names, as stand-ins: what ``readers.verl`` lets the pickle build.

A rank file's DTensor pickles as ``_rebuild_wrapper_subclass`` (the *global* dtype, size and stride) plus a state
holding the rank's ``_local_tensor`` and its ``_spec`` (``DeviceMesh``, ``placements``, ``tensor_meta`` and, in
newer torch, ``shard_order``). :data:`ALLOW` maps exactly these classes, under every module torch has pickled
them from, to stand-ins that only keep data: nothing is imported from torch.distributed and nothing runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckpttool.io.pickle_bounds import charge, ints, text
from ckpttool.io.safe_pickle import record_class


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


def _allow() -> dict[tuple[str, str], Any]:
    allow: dict[tuple[str, str], Any] = {
        ("torch._utils", "_rebuild_wrapper_subclass"): _rebuild_wrapper_subclass,
        ("torch.serialization", "_get_layout"): text,
        ("torch", "device"): lambda *args: text(args[0]) if args else "cpu",
        ("torch.distributed.device_mesh", "DeviceMesh"): _Mesh,
        ("torch.distributed._mesh_layout", "_MeshLayout"): record_class("_MeshLayout"),
        ("torch.distributed._mesh_layout", "_FlatLayout"): record_class("_FlatLayout"),
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
    }
    # the modules DTensor classes were pickled under, across torch versions
    for module in ("torch.distributed.tensor", "torch.distributed.tensor._api", "torch.distributed._tensor.api",
                   "torch.distributed._tensor"):
        allow[(module, "DTensor")] = DTensorStandIn
    for module in ("torch.distributed.tensor._dtensor_spec", "torch.distributed._tensor.placement_types",
                   "torch.distributed.tensor.placement_types"):
        allow[(module, "DTensorSpec")] = _Spec
        allow[(module, "TensorMeta")] = TensorMetaStandIn
        allow[(module, "ShardOrderEntry")] = _ShardOrderEntry
    for module in ("torch.distributed.tensor.placement_types", "torch.distributed._tensor.placement_types"):
        allow[(module, "Shard")] = _Shard
        allow[(module, "Replicate")] = _Replicate
        allow[(module, "_StridedShard")] = _Strided
        allow[(module, "Partial")] = _Partial
        allow[(module, "_Partial")] = _Partial
    return allow


ALLOW = _allow()
