"""Unpickling of checkpoint metadata with an explicit allow-list: nothing in a checkpoint can run code.

PyTorch DCP writes its ``.metadata`` file with plain ``pickle``. Loading it with ``pickle.load`` would run
whatever callable the file names. Here every class the file asks for is looked up in a fixed table of
stand-ins (plain records, tuples, strings); anything else refuses the file before it is read further.
Tensor data is never unpickled here: pieces go through ``torch.load(..., weights_only=True)``.
"""

from __future__ import annotations

import io
import pickle
import pickletools
from dataclasses import dataclass
from typing import Any

from ckpttool.errors import PickleBombError, SourceError, UnsafePickleError
from ckpttool.io.pickle_bounds import (EnumStandIn, bound_graph, budget, charge, charged, enum_member, ints,
                                      is_torch_dtype, self_charging, spend, text)


class Record:
    """A stand-in for a metadata dataclass: keeps the attributes the pickle sets, runs nothing."""

    kind = "Record"
    #: names for a state pickled as a plain tuple (TensorProperties does this)
    tuple_fields: tuple[str, ...] = ()
    #: the positional arguments it was called with: none for an object the pickle made without calling it (NEWOBJ)
    _args: tuple[Any, ...] = ()

    # No ``__new__``: NEWOBJ (how a dataclass pickles) calls ``object.__new__`` in C, which ignores what it is handed
    # (no work to charge), and at 90k items a Python ``__new__`` per object costs seconds. A call (REDUCE) runs
    # ``__init__``, which charges what it is handed.
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        charge(*args, *kwargs.values())
        self.__dict__.update(kwargs)
        self._args = args

    def __setstate__(self, state: Any) -> None:
        if type(state) is dict and "_args" not in state:  # the common case (a dataclass's __dict__), at C speed
            spend(2 + len(state))
            # by items, not the dict: an empty __dict__ updated from a dict becomes its copy, and 368k objects of
            # a 92k-item .metadata would no longer share their keys (+37 MiB)
            self.__dict__.update(state.items())
            return
        charge(state, *(state if isinstance(state, tuple) else ()))
        if isinstance(state, tuple) and self.tuple_fields:
            self._update(dict(zip(self.tuple_fields, state)))
        elif isinstance(state, tuple) and len(state) == 2:  # (dict state, slots state)
            for part in state:
                if isinstance(part, dict):
                    self._update(part)
        elif isinstance(state, dict):
            self._update(state)

    def _update(self, state: dict) -> None:
        """Keep the pickle's attributes, except ``_args``: the stand-in's own record of its positional arguments
        (a tuple), which a state naming it would replace with any value (found by tests/test_fuzz_readers.py)."""
        self.__dict__.update((k, v) for k, v in state.items() if k != "_args")

    def get(self, name: str, default: Any = None) -> Any:
        return self.__dict__.get(name, default)

    def __repr__(self) -> str:
        return f"{self.kind}({self.__dict__})"


def record_class(name: str, tuple_fields: tuple[str, ...] = ()) -> type[Record]:
    """A stand-in class named ``name``: a :class:`Record` that keeps what the pickle sets."""
    return type(name, (Record,), {"kind": name, "tuple_fields": tuple_fields})


@dataclass(frozen=True, slots=True)
class Allowed:
    """A class DCP metadata may name: the stand-in it loads as, and the torch releases seen writing it.

    ``torch`` lists the releases of the matrix the fixtures prove (``fixtures/torch_v2_*`` and the 2.13 fixtures);
    ``note`` says when a release writes it, where not in every ``.metadata``.
    """

    stand_in: Any
    torch: tuple[str, ...]
    note: str = ""


#: the torch releases whose DCP metadata fixtures prove (fixtures/make_torch_versions.py, fixtures/make_fixtures.py)
DCP_RELEASES = ("2.6", "2.10", "2.13")
_DCP_METADATA = "torch.distributed.checkpoint.metadata"
_PLANNER = "torch.distributed.checkpoint.planner"
_MEGATRON = "Megatron-Core's torch_dist save planner keeps every rank's plan (Metadata.all_local_plans)"


def _posix_path(*parts: Any) -> str:
    return "/".join(text(p) for p in parts)


_ALLOWED: dict[tuple[str, str], Allowed] = {
    **{
        (_DCP_METADATA, name): Allowed(record_class(name), DCP_RELEASES)
        for name in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "MetadataIndex")
    },
    (_DCP_METADATA, "StorageMeta"): Allowed(record_class("StorageMeta"), DCP_RELEASES),
    (_DCP_METADATA, "BytesStorageMetadata"): Allowed(
        record_class("BytesStorageMetadata"), ("2.13",),
        "a non-tensor entry (an optimizer's lr, Megatron's _extra_state); the older fixtures save weights only",
    ),
    (_DCP_METADATA, "TensorProperties"): Allowed(
        record_class("TensorProperties", ("dtype", "layout", "requires_grad", "memory_format", "pin_memory")),
        DCP_RELEASES,
    ),
    (_DCP_METADATA, "_MEM_FORMAT_ENCODING"): Allowed(
        EnumStandIn(
            f"{_DCP_METADATA}._MEM_FORMAT_ENCODING",
            {"TORCH_CONTIGUOUS_FORMAT": 0, "TORCH_CHANNELS_LAST": 1, "TORCH_PRESERVE_FORMAT": 2},
        ),
        DCP_RELEASES,
        "TensorProperties.memory_format, as Cls(value) (or getattr(Cls, NAME) under Python 3.11.0-3.11.4)",
    ),
    # megatron-core 0.12.3 and 0.14.0 keep each rank's plan as their SavePlan subclass (with mcore_data, a dict per
    # item); 0.9.0 and 0.16.1 write torch's SavePlan (fixtures megatron_v0_*; tests/test_megatron_versions.py)
    ("megatron.core.dist_checkpointing.strategies.torch", "MCoreSavePlan"): Allowed(
        record_class("MCoreSavePlan"), (), "megatron-core 0.12.3 and 0.14.0 under torch 2.13 (" + _MEGATRON + "); proven by fixtures megatron_v0_12_*, megatron_v0_14_*"
    ),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): Allowed(record_class("_StorageInfo"), DCP_RELEASES),
    **{
        (_PLANNER, name): Allowed(record_class(name), ("2.13",), _MEGATRON)
        for name in ("SavePlan", "WriteItem", "TensorWriteData")
    },
    (_PLANNER, "WriteItemType"): Allowed(
        EnumStandIn(f"{_PLANNER}.WriteItemType", {"TENSOR": 1, "SHARD": 2, "BYTE_IO": 3}), ("2.13",), _MEGATRON
    ),
    ("torch", "Size"): Allowed(self_charging(lambda dims=(): ints(dims, charged=True)), DCP_RELEASES),
    ("torch.serialization", "_get_layout"): Allowed(text, DCP_RELEASES, "TensorProperties.layout"),
    ("pathlib", "PosixPath"): Allowed(_posix_path, DCP_RELEASES, "StorageMeta.checkpoint_id (FileSystemWriter's path)"),
    ("pathlib", "PurePosixPath"): Allowed(_posix_path, (), "a checkpoint_id given as a pure path; no fixture names it"),
    ("pathlib", "WindowsPath"): Allowed(
        lambda *parts: "\\".join(text(p) for p in parts), (), "a checkpoint_id saved on Windows; no fixture names it"
    ),
    **{(module, name): Allowed(stand_in, (), "a plain container; no fixture names it")
       for module, name, stand_in in (("collections", "OrderedDict", dict), ("builtins", "set", set),
                                      ("builtins", "frozenset", frozenset))},
}


def allowed_classes() -> list[tuple[str, tuple[str, ...], str]]:
    """Every class DCP metadata may name, as ``(module.name, torch releases seen writing it, when)`` rows, for docs.

    Example:
        >>> ("torch.distributed.checkpoint.metadata.Metadata", ("2.6", "2.10", "2.13"), "") in allowed_classes()
        True
    """
    return [(f"{module}.{name}", entry.torch, entry.note) for (module, name), entry in _ALLOWED.items()]


#: torch dtypes pickle as module-level globals (``torch.float32``); they load as their names.
#: Enum members pickle as ``Cls(value)``, or under Python 3.11.0-3.11.4 as ``getattr(Cls, "NAME")``
#: (:func:`ckpttool.io.pickle_bounds.enum_member`); both give the member's value.


class _AllowListUnpickler(pickle.Unpickler):
    def __init__(self, data: bytes, label: str) -> None:
        super().__init__(io.BytesIO(data))
        self.data = data
        self.label = label
        self.names: dict[int, str] = {}

    def find_class(self, module: str, name: str) -> Any:
        # an enum member as Python 3.11.0-3.11.4 pickle it (protocol 2 names the module __builtin__)
        if module in ("builtins", "__builtin__") and name == "getattr":
            return enum_member(self.label, self.names)
        if (module, name) in _ALLOWED:
            found = charged(_ALLOWED[(module, name)].stand_in)
            self.names[id(found)] = f"{module}.{name}"
            return found
        if is_torch_dtype(module, name):
            return name  # a dtype is data; whether safetensors can hold it is the reader's question
        raise UnsafePickleError(
            f"'{self.label}': refused to unpickle: it asks for '{module}.{name}', which is not on ckpttool's "
            f"allow-list of metadata classes (nothing was executed){_written_by(self.data)}"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafePickleError(f"'{self.label}': refused to unpickle: unexpected persistent id (nothing was executed)")


def _written_by(data: bytes) -> str:
    """What the refused metadata says of its writer: the DCP format version it records (``Metadata.version``),
    found by reading the pickle's opcodes (nothing is unpickled), or nothing when it records none."""
    previous = None
    try:
        for op, arg, _ in pickletools.genops(data):
            if op.name in ("MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"):
                continue
            if previous == "version" and isinstance(arg, str):
                return (f"; the metadata records DCP format version {arg!r}; ckpttool knows the classes that torch "
                        f"{DCP_RELEASES[0]} to {DCP_RELEASES[-1]} write: is it from a newer torch?")
            previous = arg if isinstance(arg, str) and "UNICODE" in op.name else None
    except (ValueError, IndexError, KeyError, TypeError, OverflowError, UnicodeDecodeError):
        pass  # the bytes stop being a pickle after the refused class: nothing more to say
    return ""


def load_metadata_pickle(data: bytes, label: str) -> Any:
    """Unpickle DCP metadata bytes with the allow-list; ``label`` names the file in errors.

    The work the pickle causes is bounded (:mod:`ckpttool.io.pickle_bounds`).

    Raises:
        UnsafePickleError: the pickle names a class outside the allow-list.
        PickleBombError: reading it would take work without bound (shared objects, cycles, deep nesting).
        SourceError: the bytes are not a valid pickle (truncated, garbage).
    """
    try:
        with budget(label, len(data)):
            found = _AllowListUnpickler(data, label).load()
        bound_graph(found, label)
        return found
    except (UnsafePickleError, PickleBombError):
        raise
    except SourceError:
        raise
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, IndexError, KeyError, AttributeError,
            RecursionError, OverflowError, UnicodeDecodeError, MemoryError) as e:  # what the pickle VM raises on garbage
        raise SourceError(f"'{label}': cannot read the metadata pickle ({type(e).__name__}: {e}); is it truncated?") from None
