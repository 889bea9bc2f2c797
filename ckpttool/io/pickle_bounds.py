"""Bounds on the work a checkpoint's pickle can make ckpttool do, and enum members named by ``getattr``.

A pickle is a small program. With memo references a few hundred bytes describe an object graph that, walked as a
tree, has 2**60 nodes (sixty levels, each referring twice to the one below), or one long list that a million calls
are each handed in full. Three bounds keep every pickle-reading path linear in the size of the file:

- **While unpickling**, every stand-in a pickle calls is charged for what it is handed: one unit per call, per
  argument, and per element (item, character) of each argument. A pickle may spend :data:`BASE_WORK` units plus
  :data:`WORK_PER_BYTE` per byte of itself; a real pickle hands each object to one call, so it spends about its size.
- **After unpickling**, the object graph is walked once, each object once: it is refused when it contains itself,
  nests deeper than :data:`MAX_DEPTH` levels, or when a walk that does not notice sharing (as readers' walks and
  ``repr`` do) would visit more than :data:`BASE_VISITS` plus :data:`VISITS_PER_OBJECT` per container and reference
  the graph holds (a tree without sharing is exactly that size).
- Stand-ins that read numbers or names take ints and strings only (:func:`ints`, :func:`text`): ``str()`` of a
  shared graph would be the tree walk again.

Python 3.11.0 to 3.11.4 (Debian 12's 3.11.2) pickle an enum member as ``getattr(<class>, "<NAME>")``; later ones as
``<class>(<value>)``. :func:`enum_member` allows exactly the first form for an :class:`EnumStandIn` and a name
it lists; ``getattr`` on anything else is refused.
"""

from __future__ import annotations

import gc
import itertools
import pickle
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from ckpttool.errors import PickleBombError, UnsafePickleError

#: work units any pickle may spend while it is unpickled, and how many more per byte of pickle
BASE_WORK, WORK_PER_BYTE = 1_000_000, 8
#: visits a tree walk of the unpickled graph may make, and how many more per container and reference it holds
BASE_VISITS, VISITS_PER_OBJECT = 1_000_000, 8
#: containers nested deeper than this are refused (real checkpoints nest about 10 levels)
MAX_DEPTH = 100


class Budget:
    """The work units one pickle (``label``, ``nbytes`` long) may still spend while it is unpickled."""

    def __init__(self, label: str, nbytes: int) -> None:
        self.label = label
        self.limit = BASE_WORK + WORK_PER_BYTE * nbytes
        self.left = self.limit

    def charge(self, *handed: Any) -> None:
        cost = 1 + len(handed)
        for x in handed:
            if isinstance(x, _SIZED):
                cost += len(x)
        self.left -= cost
        if self.left < 0:
            raise PickleBombError(
                f"'{self.label}': refused to unpickle: it makes ckpttool do more than {self.limit} steps of work "
                "(objects handed over and over to the classes it names: a crafted file?); nothing was executed"
            )


_CURRENT: ContextVar[Budget | None] = ContextVar("ckpttool_pickle_budget", default=None)


@contextmanager
def budget(label: str, nbytes: int) -> Iterator[Budget]:
    """The budget of the pickle being unpickled in this block; :func:`charge` spends from it."""
    current = Budget(label, nbytes)
    token = _CURRENT.set(current)
    try:
        yield current
    finally:
        _CURRENT.reset(token)


def charge(*handed: Any) -> None:
    """Charge what a stand-in was handed to the pickle being unpickled (nothing outside :func:`budget`)."""
    current = _CURRENT.get()
    if current is not None:
        current.charge(*handed)


def spend(units: int) -> None:
    """Spend ``units`` of the pickle being unpickled (nothing outside :func:`budget`): :func:`charge` when the caller
    has counted them itself, as the stand-ins called 100k times a file do."""
    current = _CURRENT.get()
    if current is not None:
        current.left -= units
        if current.left < 0:
            current.charge()  # the refusal, with its message


def self_charging(stand_in: Callable[..., Any]) -> Callable[..., Any]:
    """Mark ``stand_in`` as charging what it is handed itself (:func:`charged` then returns it unwrapped)."""
    stand_in.charges_itself = True  # type: ignore[attr-defined]
    return stand_in


def charged(found: Any) -> Any:
    """What ``find_class`` returns, with its calls charged to the pickle being unpickled: functions and container
    types are wrapped; other classes (built with ``NEWOBJ``, which needs the class itself) charge in their own
    ``__new__``/``__setstate__``. Outside :func:`budget`, ``found`` itself."""
    if isinstance(found, type) and not issubclass(found, (dict, list, tuple, set, frozenset)):
        return found
    if isinstance(found, EnumStandIn) or getattr(found, "charges_itself", False):
        return found
    current = _CURRENT.get()
    if current is None:
        return found

    def call(*args: Any, **kwargs: Any) -> Any:
        current.charge(*args, *kwargs.values())
        return found(*args, **kwargs)

    return call


_SIZED = (str, bytes, bytearray, tuple, list, dict, set, frozenset)


def ints(values: Any, *, charged: bool = False) -> tuple[int, ...]:
    """``values`` (a shape, a stride) as a tuple of ints; anything else is not what a checkpoint pickles.
    ``charged``: spend what it was handed (the call, the sequence and its elements) from the pickle's budget."""
    if not isinstance(values, (tuple, list)):
        raise pickle.UnpicklingError("a size that is not a sequence of integers")
    if charged:
        spend(2 + len(values))
    for v in values:
        if type(v) is not int:
            raise pickle.UnpicklingError("a size that is not a sequence of integers")
    return tuple(values)


def text(value: Any) -> str:
    """``value`` when it is a string (a layout or device name, a path part)."""
    if not isinstance(value, str):
        raise pickle.UnpicklingError(f"a name that is a {type(value).__name__}, not a string")
    return value


#: the dtypes torch 2.13 defines (``torch.<name>``): a metadata pickle names one per tensor (``torch.bfloat16``), and
#: knowing them by name keeps torch (seconds of import, ~200 MiB) out of a dry run; other names ask torch itself
TORCH_DTYPES = frozenset({
    "bfloat16", "bit", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "cdouble", "cfloat", "chalf",
    "complex128", "complex32", "complex64", "double", "float", "float16", "float32", "float4_e2m1fn_x2", "float64",
    "float8_e4m3fn", "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "half", "int", "int1",
    "int16", "int2", "int3", "int32", "int4", "int5", "int6", "int64", "int7", "int8", "long", "qint32", "qint8",
    "quint2x4", "quint4x2", "quint8", "short", "uint1", "uint16", "uint2", "uint3", "uint32", "uint4", "uint5",
    "uint6", "uint64", "uint7", "uint8",
})


def is_torch_dtype(module: str, name: str) -> bool:
    """Whether ``module.name`` is a torch dtype (data, not code): from :data:`TORCH_DTYPES`, else from torch."""
    if module != "torch":
        return False
    if name in TORCH_DTYPES:
        return True
    from ckpttool.fast.deferred import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


# ------------------------------------------------------------------------------------------ the graph, once


def bound_graph(obj: Any, label: str) -> None:
    """Refuse an unpickled object graph that walking it as a tree would make costly.

    Each container is visited once; the size of the tree walk (shared objects counted every time they are reached)
    is computed from the sizes of their parts. Without sharing, it is the number of containers and references.

    Raises:
        PickleBombError: ``obj`` contains itself, nests more than :data:`MAX_DEPTH` levels, or its tree walk would
            visit more than :data:`BASE_VISITS` + :data:`VISITS_PER_OBJECT` x (its containers + their references).
    """
    if _unshared(obj):  # the common case, proven at C speed: no part reached twice, so no costly tree walk
        return
    sizes: dict[int, int] = {}  # id -> tree size, for containers done
    open_ids: set[int] = set()
    references = 0
    cap = 1 << 62

    # Recursive, one call per container (never per leaf: a 90k-item DCP .metadata is ~1M leaves), at most
    # MAX_DEPTH deep, which Python's recursion limit allows.
    def size(node: Any, parts: Iterable[Any], depth: int) -> int:
        nonlocal references
        key = id(node)
        if key in open_ids:
            raise PickleBombError(f"'{label}': refused: its pickled objects contain themselves (a reference cycle)")
        if depth >= MAX_DEPTH:
            raise PickleBombError(
                f"'{label}': refused: its pickled objects are nested more than {MAX_DEPTH} levels deep")
        open_ids.add(key)
        total = 1
        for child in parts:
            references += 1
            if type(child) in _LEAVES:
                total += 1
                continue
            known = sizes.get(id(child))
            if known is not None:
                total += known
                continue
            inner = _parts(child)
            total += 1 if inner is None else size(child, inner, depth + 1)
        open_ids.discard(key)
        total = sizes[key] = min(cap, total)
        return total

    parts = _parts(obj)
    total = 1 if parts is None else size(obj, parts, 0)
    limit = BASE_VISITS + VISITS_PER_OBJECT * (len(sizes) + references)
    if total > limit:
        raise PickleBombError(
            f"'{label}': refused: its pickled objects refer to shared parts so often that reading them would visit "
            f"{'more than 4e18' if total >= cap else total} objects ({len(sizes)} containers holding {references} "
            f"references; the limit is {limit}): a crafted file?"
        )


#: types a walk never enters (what a pickle's strings and numbers load as)
_LEAVES = frozenset({str, int, float, bool, bytes, type(None)})
_CONTAINERS = frozenset({dict, list, tuple, set, frozenset})


def _unshared(obj: Any) -> bool:
    """Whether ``obj``'s graph is a tree of plain containers and plain objects, fewer than :data:`MAX_DEPTH` levels
    deep: then :func:`bound_graph`'s walk would pass it (its tree walk is its size: one visit per container and
    reference, under the limit), and this proves it in a few C calls per level (``gc.get_referents``,
    ``sys.getrefcount``), not one Python call per container (a 92k-item DCP ``.metadata`` holds 740k containers).

    The levels walked are a superset of :func:`_parts`' (an object's ``__dict__`` is a level of its own, its keys
    and slots are walked too). A part held by nothing but its one parent (and this walk's two lists) has a
    reference count of :data:`_ALONE`; anything more is a part reached twice, or held from outside the graph too.
    False, proving nothing, for such a part (but an empty tuple or frozenset: one visit wherever it is reached),
    too many levels, or an object of another kind (a function, a module: their referents are no part of the data);
    :func:`bound_graph`'s exact walk then decides."""
    level: list[Any] = [obj]
    for depth in range(MAX_DEPTH):
        kinds = set(map(type, level))
        if not kinds <= _KNOWN and not all(list(map(_kind, kinds - _KNOWN))):
            return False
        nodes = list(itertools.compress(level, map(_WALKED.__contains__, map(type, level))))
        if not nodes:
            return True
        counts = list(map(sys.getrefcount, nodes))
        if depth and max(counts) > _ALONE and not all(
                type(n) in (tuple, frozenset) and not n for n, c in zip(nodes, counts) if c > _ALONE):
            return False
        level = gc.get_referents(*nodes)
    return False


def _alone() -> int:
    """``sys.getrefcount`` of a part held by its parent alone, counted as :func:`_unshared` counts (4 on CPython
    3.11: the parent, its two lists, the call's argument); measured, as interpreters differ in what they count."""
    parent = [[]]
    level = gc.get_referents(parent)  # as in _unshared: held by its parent, a level and its nodes, and the call
    nodes = list(itertools.compress(level, [True]))
    return list(map(sys.getrefcount, nodes))[0]


_ALONE = _alone()


#: types :func:`_unshared` has classified: walked (plain containers, plain objects), or leaves (types among them)
_WALKED: set[type] = set(_CONTAINERS)
_KNOWN: set[type] = set(_CONTAINERS) | set(_LEAVES)


def _kind(t: type) -> bool:
    """Classify ``t`` for :func:`_unshared`: True (a leaf, a container, an instance of a class defined in Python,
    whose referents are its type, ``__dict__`` and slots), False for any other kind."""
    if issubclass(t, type):
        _KNOWN.add(t)  # a class named as data: a leaf for _parts, and its referents are code
        return True
    if t.__flags__ & _HEAPTYPE and not issubclass(t, (*_CONTAINERS, *_LEAVES, BaseException)):
        _KNOWN.add(t)
        _WALKED.add(t)
        return True
    return False


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: a class defined by a class statement (or type())


def _parts(node: Any) -> Iterable[Any] | None:
    """What a walk of ``node`` visits, or None for a leaf."""
    if isinstance(node, dict):
        return itertools.chain.from_iterable(node.items())
    if isinstance(node, (list, tuple, set, frozenset)):
        return node
    if isinstance(node, type):
        return None
    attributes = getattr(node, "__dict__", None)
    return attributes.values() if isinstance(attributes, dict) else None


# ------------------------------------------------------------------------------------- enums by getattr


class EnumStandIn:
    """An enum class as data: ``Cls(value)`` and ``getattr(Cls, "NAME")`` give ``make(value)``, nothing imported.

    Args:
        name: the class's ``module.qualname``, for messages.
        members: every member's name and value, as the class defines them.
        make: what a member becomes (default: its value).
    """

    def __init__(self, name: str, members: Mapping[str, Any], make: Callable[[Any], Any] | None = None) -> None:
        self.name = name
        self.members = dict(members)
        self.make = make or (lambda value: value)

    def __call__(self, value: Any = None, *rest: Any) -> Any:
        charge(value, *rest)
        return self.make(value)

    def __repr__(self) -> str:
        return f"EnumStandIn({self.name})"


def enum_member(label: str, names: Mapping[int, str]) -> Callable[..., Any]:
    """The stand-in for ``builtins.getattr``: ``getattr(<an EnumStandIn>, "<one of its members>")`` and nothing
    else. ``names`` maps ``id()`` of what ``find_class`` returned to the ``module.name`` the pickle asked for."""

    def getattr_(owner: Any, name: Any, *default: Any) -> Any:
        charge(name)
        if isinstance(owner, EnumStandIn) and isinstance(name, str) and name in owner.members and not default:
            return owner.make(owner.members[name])
        what = names.get(id(owner), type(owner).__name__)
        shown = repr(name[:60]) if isinstance(name, str) else f"a {type(name).__name__}"
        raise UnsafePickleError(
            f"'{label}': refused to unpickle: it asks for getattr({what}, {shown}), which is not a member of an enum "
            "ckpttool knows (nothing was executed)"
        )

    return getattr_
