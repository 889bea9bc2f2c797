"""The safe unpickler of ``torch.save`` pickles: what a tensor, its storage, a state dict and ``torch.Size`` load as,
and the one allow-list every format extends with its own stand-ins.

:class:`Unpickler` knows only plain containers, the tensor rebuilders (a tensor becomes a
:class:`PendingTensor`: its storage, offset, shape and stride, no bytes), dtypes and the stand-ins a reader allows
(``Allow``); anything else is refused by name before it is built, so nothing in a checkpoint can run code, and
every object is charged against :mod:`ckpttool.io.pickle_bounds`' budget. :mod:`ckpttool.io.torch_save` reads the
archive around the pickle and turns pending tensors into located ones.
"""

from __future__ import annotations

import io
import pickle
import struct
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckpttool.errors import SourceError, UnsafePickleError
from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import dtype_name
from ckpttool.io.pickle_bounds import budget, charge, charged, enum_member, ints

#: storage classes of torch.save pickles -> safetensors dtype names
_STORAGES = {
    "FloatStorage": "F32", "DoubleStorage": "F64", "HalfStorage": "F16", "BFloat16Storage": "BF16",
    "LongStorage": "I64", "IntStorage": "I32", "ShortStorage": "I16", "CharStorage": "I8", "ByteStorage": "U8",
    "BoolStorage": "BOOL",
}
#: what a reader may allow: ``(module, name)`` -> a callable the pickle gets instead of the real class
Allow = Mapping[tuple[str, str], Callable[..., Any]]


@dataclass(frozen=True, slots=True)
class Storage:
    dtype: str
    key: str
    numel: int


@dataclass(frozen=True, slots=True)
class PendingTensor:
    """A tensor seen in the pickle, before storage offsets are known."""

    storage: Storage
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _rebuild_tensor(storage: Any, offset: Any, shape: Any, stride: Any, *rest: Any) -> PendingTensor:
    if not isinstance(storage, Storage) or not isinstance(offset, int):
        raise pickle.UnpicklingError("a tensor without a storage")
    shape, stride = ints(shape), ints(stride)
    if len(shape) != len(stride):
        raise pickle.UnpicklingError("a tensor with a bad shape or stride")
    if any(n < 0 for n in shape) or offset < 0:
        raise pickle.UnpicklingError(f"a tensor of shape {list(shape)} at storage offset {offset}")
    return PendingTensor(storage, offset, shape, stride)


def _rebuild_parameter(data: Any, *rest: Any) -> Any:
    return data  # nn.Parameter: the tensor it wraps


def _rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any) -> Any:
    built = func(*args)
    return built if new_type is _PlainTensor else new_type(built, state)


class _PlainTensor:
    """What ``torch.Tensor`` and ``torch.nn.Parameter`` classes load as."""

    def __setstate__(self, state: Any) -> None:
        charge(state)


class _StateDict(dict):
    """``collections.OrderedDict``: a plain dict; the ``_metadata`` attribute a module's state dict carries
    (version numbers for ``load_state_dict``) is dropped."""

    def __setstate__(self, state: Any) -> None:
        pass


_BUILTIN: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor_v3"): lambda storage, offset, shape, stride, *rest: _rebuild_tensor(storage, offset, shape, stride),
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch._utils", "_rebuild_from_type_v2"): _rebuild_from_type,
    ("torch", "Tensor"): _PlainTensor,
    ("torch.nn.parameter", "Parameter"): _PlainTensor,
    ("collections", "OrderedDict"): _StateDict,
    ("torch", "Size"): lambda dims=(): ints(dims),
}


def accepted_classes() -> list[str]:
    """Every class :func:`scan` accepts for any format, as ``module.name``: the tensor rebuilders, the state dict's
    ``collections.OrderedDict``, ``torch.Size`` and the storage classes (a dtype, ``torch.<dtype>``, is data).
    A format's table of the classes its producers write lists these too (``readers/colossalai_classes.py``).

    Example:
        >>> "torch._utils._rebuild_tensor_v2" in accepted_classes()
        True
    """
    return [f"{module}.{name}" for module, name in _BUILTIN] + [f"torch.{name}" for name in _STORAGES]


class Unpickler(pickle.Unpickler):
    def __init__(self, data: BinaryIO, label: str, allow: Allow) -> None:
        super().__init__(data)
        self.label = label
        self.allow = allow
        self.storages: dict[str, Storage] = {}
        self.names: dict[int, str] = {}

    def find_class(self, module: str, name: str) -> Any:
        # an enum member as Python 3.11.0-3.11.4 pickle it (protocol 2 names the module __builtin__)
        if module in ("builtins", "__builtin__") and name == "getattr":
            return enum_member(self.label, self.names)
        if (module, name) in _BUILTIN or (module, name) in self.allow:
            found = charged(_BUILTIN[(module, name)] if (module, name) in _BUILTIN else self.allow[(module, name)])
            self.names[id(found)] = f"{module}.{name}"
            return found
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype is data
        raise UnsafePickleError(
            f"'{self.label}': refused to unpickle: it asks for '{module}.{name}', which is not a tensor, a plain "
            "container or a class ckpttool allows for this format (nothing was executed)"
        )

    def persistent_load(self, pid: Any) -> Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"):
            raise UnsafePickleError(f"'{self.label}': refused to unpickle: unexpected persistent id (nothing was executed)")
        _, dtype, key, _location, numel = pid
        if not (isinstance(dtype, str) and dtype in _STORAGES.values() and isinstance(numel, int) and numel >= 0):
            raise pickle.UnpicklingError(f"storage of type {dtype[:40]!r}" if isinstance(dtype, str) else "a storage")
        if not isinstance(key, (str, int)):
            raise pickle.UnpicklingError("a storage key that is not a name")
        charge(key)
        storage = self.storages.setdefault(str(key), Storage(dtype_name(dtype), str(key), numel))
        return storage


#: ``data.pkl`` bytes -> the plain tensor they describe: a 90k-item checkpoint has a few hundred distinct pickles
_PLAIN: dict[bytes, PendingTensor] = {}
_PLAIN_MAX = 4096


def plain_tensor(data: bytes) -> PendingTensor | None:
    """The tensor ``data`` (a ``data.pkl``) pickles, through the safe unpickler and its bounds, when it is one
    tensor and nothing else; else None (:func:`scan` then says what it is)."""
    found = _PLAIN.get(data)
    if found is not None:
        return found
    unpickler = Unpickler(io.BytesIO(data), "data.pkl", {})
    try:
        with budget("data.pkl", len(data)):
            found = unpickler.load()
    except (SourceError, pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, AttributeError,
            KeyError, struct.error, RecursionError, OverflowError, ZeroDivisionError):
        return None
    if not isinstance(found, PendingTensor) or len(unpickler.storages) != 1:
        return None
    if len(_PLAIN) < _PLAIN_MAX:
        _PLAIN[data] = found
    return found
