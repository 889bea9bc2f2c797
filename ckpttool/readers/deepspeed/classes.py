"""The classes DeepSpeed's pickles name, each with the DeepSpeed releases that write it, and the ``ds_version`` a
checkpoint records, read from the pickle's opcodes without building anything.

:data:`ALLOW` is the one table of what a DeepSpeed ``.pt`` file may ask the unpickler for. Each entry gives the
inert stand-in the pickle gets instead of the class (nothing is imported from DeepSpeed) and the releases whose
checkpoints were seen to pickle it: the fixture matrix (``fixtures/make_deepspeed*.py``, exact versions), checked
by ``tests/test_deepspeed_versions.py``. A class in no release of the matrix says where it comes from instead.
An unknown class stays a refusal; :func:`refusal_note` adds the release the checkpoint records, so the message
says which DeepSpeed wrote something ckpttool does not know.
"""

from __future__ import annotations

import pickle
import pickletools
import re
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.console.terminal import escaped
from ckpttool.errors import SourceError
from ckpttool.io.paths import open_inside
from ckpttool.io.pickle_bounds import EnumStandIn, text
from ckpttool.io.safe_pickle import Record

#: the releases of the fixture matrix (fixtures/make_deepspeed.py and its moe/autotp siblings: 0.19.8;
#: fixtures/make_deepspeed_versions.py: the older ones)
MATRIX = ("0.14.5", "0.16.9", "0.18.0", "0.19.8")


class _Record(Record):
    kind = "DeepSpeed"


@dataclass(frozen=True, slots=True)
class Allowed:
    """One accepted class: what the pickle gets instead of it, and who writes it.

    Attributes:
        stand_in: the inert callable or class built in its place.
        releases: the DeepSpeed releases of the fixture matrix whose checkpoints pickle it.
        where: what pickles it (the object and the files), or, with no release listed, where it comes from.
    """

    stand_in: Any
    releases: tuple[str, ...]
    where: str


class AllowTable(Mapping[tuple[str, str], Any]):
    """``(module, name)`` -> stand-in, as :func:`ckpttool.io.torch_save.scan` takes an allow-list; the
    :class:`Allowed` entries (with their releases) are :attr:`entries`."""

    def __init__(self, entries: Mapping[tuple[str, str], Allowed]) -> None:
        self.entries: Mapping[tuple[str, str], Allowed] = dict(entries)

    def __getitem__(self, key: tuple[str, str]) -> Any:
        return self.entries[key].stand_in

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)


def _name_set(items: Any = ()) -> frozenset[str]:
    """``set(names)`` as DeepSpeed pickles its model states' ``sparse_tensor_module_names`` (under protocol 2's
    module name ``__builtin__``): module names only, so nothing but strings is accepted."""
    if not isinstance(items, (list, tuple)):
        raise pickle.UnpicklingError(f"a set built from a {type(items).__name__}, not a list of names")
    return frozenset(text(item) for item in items)


_ZERO_STAGE = EnumStandIn(  # ZeroStageEnum(2) -> 2
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    {"disabled": 0, "optimizer_states": 1, "gradients": 2, "weights": 3, "max_stage": 3},
)

#: every non-tensor class a DeepSpeed checkpoint may pickle, with the releases that write it
ALLOW = AllowTable({
    ("deepspeed.runtime.zero.config", "ZeroStageEnum"): Allowed(
        _ZERO_STAGE, MATRIX,
        "the ZeRO optimizer's 'zero_stage' in *_optim_states.pt and the model states' 'ds_config' copy"),
    ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"): Allowed(
        _Record, MATRIX, "the ZeRO optimizer's static 'loss_scaler' (fp32 and bf16) in *_optim_states.pt"),
    ("deepspeed.utils.tensor_fragment", "fragment_address"): Allowed(
        _Record, MATRIX, "'param_slice_mappings' of the ZeRO-1/2 and BF16_Optimizer states"),
    ("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"): Allowed(
        _Record, (), "fp16 with a dynamic loss scale (DeepSpeed's source; fp16 does not run on the CPU, so no "
                     "fixture of the matrix has it)"),
    ("__builtin__", "set"): Allowed(
        _name_set, ("0.14.5", "0.16.9", "0.18.0"), "the model states' 'sparse_tensor_module_names' (an empty set(); Python 2's name of "
                                "builtins, as pickle protocol 2 writes it)"),
    ("argparse", "Namespace"): Allowed(
        _Record, (), "the training args Megatron-DeepSpeed adds to the model states (not DeepSpeed itself)"),
})

_VERSION = re.compile(r"\d+\.\d+(\.\d+)?([.+-][0-9A-Za-z.+-]*)?")
_STRINGS = {"SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8", "UNICODE", "SHORT_BINSTRING", "BINSTRING", "STRING"}
_PUTS = {"BINPUT", "LONG_BINPUT", "PUT"}
_GETS = {"BINGET", "LONG_BINGET", "GET"}


def version_in_pickle(data: bytes) -> str | None:
    """The string a pickle stores under the key ``'ds_version'``, read from its opcodes: nothing is built or called.

    The key and its value are consecutive pushes (memo stores between them are skipped; a value stored once and
    fetched again from the memo is followed). None when there is no such key, the value is not a version number,
    or the opcodes cannot be read.
    """
    memo: dict[int, Any] = {}
    last: Any = None  # what the latest push left on the stack, when it was a string
    after_key = False
    try:
        for op, arg, _ in pickletools.genops(data):
            name = op.name
            if name in _PUTS:
                memo[arg] = last
                continue
            if name == "MEMOIZE":
                memo[len(memo)] = last
                continue
            value = arg if name in _STRINGS else memo.get(arg) if name in _GETS else None
            if after_key:
                if isinstance(value, bytes):
                    value = value.decode("ascii", "replace")
                return value if isinstance(value, str) and len(value) < 40 and _VERSION.fullmatch(value) else None
            after_key = value == "ds_version"
            last = value
    except (ValueError, KeyError, IndexError, UnicodeDecodeError, TypeError):
        return None
    return None


def recorded_version(root: Path, rel: str) -> str | None:
    """The ``ds_version`` recorded in the ``torch.save`` file ``root/rel`` (read with :func:`version_in_pickle`;
    None when it records none or cannot be read)."""
    try:
        with open_inside(root, rel, rel) as f, zipfile.ZipFile(f) as archive:
            pickles = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
            if len(pickles) != 1 or archive.getinfo(pickles[0]).file_size > 1 << 28:
                return None
            return version_in_pickle(archive.read(pickles[0]))
    except (OSError, SourceError, zipfile.BadZipFile, KeyError, ValueError, RuntimeError):
        return None


def refusal_note(root: Path, rel: str) -> str:
    """What a refusal of ``rel`` adds: the DeepSpeed release the checkpoint records (the model states of the step
    first, then its ZeRO optimizer files, then the refused file itself), and the releases ckpttool knows."""
    folder = rel.rpartition("/")[0]
    step = root / folder if folder else root
    names = sorted(p.name for p in step.glob("mp_rank_*_model_states.pt"))
    names += sorted(p.name for p in step.glob("zero_pp_rank_*_mp_rank_*_model_states.pt"))
    names += sorted(p.name for p in step.glob("*zero_pp_rank_*_optim_states.pt"))  # MoE model states before 0.19: none
    candidates = [f"{folder}/{n}" if folder else n for n in names]
    for candidate in [*candidates, rel]:
        version = recorded_version(root, candidate)
        if version is not None:
            recorded = f"the checkpoint records DeepSpeed {version} (ds_version in '{escaped(candidate)}')"
            break
    else:
        recorded = "the checkpoint records no ds_version (neither its model states nor this file)"
    return (f"; {recorded}; ckpttool knows the classes DeepSpeed {', '.join(MATRIX[:-1])} and {MATRIX[-1]} pickle, "
            "and this is not one of them")
