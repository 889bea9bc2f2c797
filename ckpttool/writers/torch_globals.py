"""Pickles that name torch's classes and functions, written without importing torch.

``split --to dcp`` writes two kinds of pickle: every item's ``archive/data.pkl`` (a tensor as ``torch.save``
pickles it) and the checkpoint's ``.metadata`` (torch's ``Metadata`` dataclasses). Both only *name* torch's
objects (``torch._utils._rebuild_tensor_v2``, ``torch.Size``, ``torch.bfloat16``, the DCP dataclasses); building
them with torch's own objects meant importing torch and ``torch.distributed.checkpoint`` (several CPU seconds,
most of a small split's start-up) for a few hundred bytes. Here stand-ins say what to write:

- :class:`Global` ``(module, name)``: the object ``module.name`` (``STACK_GLOBAL`` from protocol 4, ``GLOBAL``
  before), remembered like any object the pickler meets twice;
- :class:`Call` ``(func, args)``: the result of ``func(*args)`` (``REDUCE``), as torch's ``__reduce__`` records
  a ``torch.Size`` or an enum member;
- :class:`New` ``(cls, state)``: an instance made by ``cls.__new__`` and then given ``state`` (``NEWOBJ`` and
  ``BUILD``), as a dataclass pickles.

:func:`dumps` writes them with the standard library's pickler (its Python implementation, which lets a type be
dispatched to our own method; what it writes for everything else is what the C pickler writes), so the bytes
equal torch's own pickle of the same objects: ``tests/test_split_startup.py`` compares them, and loads the
result with torch. Nothing here imports torch.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Call", "Global", "New", "dumps"]


@dataclass(frozen=True, slots=True, eq=False)
class Global:
    """``module.name``, as the pickle names it. One object per name, so the pickler writes it once and refers
    back to it (what torch's own pickle does for a class or a dtype met twice)."""

    module: str
    name: str


@dataclass(frozen=True, slots=True, eq=False)
class Call:
    """``func(*args)``, recorded as a reduce (``REDUCE``)."""

    func: Global
    args: tuple[Any, ...]


@dataclass(frozen=True, slots=True, eq=False)
class New:
    """An instance of ``cls`` made without ``__init__`` and given ``state`` (a dict, or what its ``__setstate__``
    takes; None for none): how ``object.__reduce_ex__`` pickles a dataclass."""

    cls: Global
    state: Any = None


class _Pickler(pickle._Pickler):  # the Python implementation: its dispatch table takes our types
    dispatch = dict(pickle._Pickler.dispatch)

    def __init__(self, file: io.BytesIO, protocol: int, persistent: Callable[[object], object] | None) -> None:
        super().__init__(file, protocol=protocol)
        self._persistent = persistent

    def persistent_id(self, obj: object) -> object:
        return None if self._persistent is None else self._persistent(obj)

    def _save_standin_global(self, obj: Global) -> None:
        if self.proto >= 4:
            self.save(obj.module)
            self.save(obj.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + f"{obj.module}\n{obj.name}\n".encode("ascii"))
        self.memoize(obj)

    def _save_call(self, obj: Call) -> None:
        self.save(obj.func)
        self.save(obj.args)
        self.write(pickle.REDUCE)
        self.memoize(obj)

    def _save_new(self, obj: New) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    dispatch[Global] = _save_standin_global
    dispatch[Call] = _save_call
    dispatch[New] = _save_new


def dumps(obj: object, protocol: int = pickle.DEFAULT_PROTOCOL,
          persistent_id: Callable[[object], object] | None = None) -> bytes:
    """The pickle of ``obj``, in which :class:`Global`, :class:`Call` and :class:`New` stand for what they name.

    Args:
        obj: plain values (str, int, tuple, list, dict, None, bool) and stand-ins.
        protocol: the pickle protocol (torch's ``.metadata``: the default; ``torch.save``'s ``data.pkl``: 2).
        persistent_id: as :meth:`pickle.Pickler.persistent_id` (``torch.save`` records storages so).

    Example:
        >>> pickle.loads(dumps(Call(Global("builtins", "tuple"), ([2, 3],))))
        (2, 3)
    """
    out = io.BytesIO()
    _Pickler(out, protocol, persistent_id).dump(obj)
    return out.getvalue()
