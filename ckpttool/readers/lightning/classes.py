"""The classes a Lightning checkpoint's pickles name, each with the Lightning releases that write it.

A Lightning ``.ckpt`` file (and the ``meta.pt`` of a sharded ``.ckpt`` folder) is ``torch.save`` of the checkpoint
dict. Besides the tensors, Lightning pickles its training state there: ``loops`` (progress counters), ``callbacks``
(``ModelCheckpoint``'s state: paths, scores), ``hyper_parameters`` (what ``save_hyperparameters`` captured),
``optimizer_states`` and ``lr_schedulers`` (their ``state_dict()``). :data:`TABLE` lists every class the fixtures show
a release writing (``lightning_*``, made by ``fixtures/make_lightning.py`` under each release;
``tests/test_lightning.py`` checks both ways): with plain hyper-parameters, Lightning writes nothing but dicts, lists,
numbers, strings, tensors and the state dict's ``OrderedDict``; Lightning 1.9.5 also keeps ``ModelCheckpoint``'s
``dirpath`` as the user gave it (its local-path test compares fsspec's ``protocol`` to ``"file"``, a tuple in the
fsspec releases since 2023), so a ``Path`` given there is pickled as ``pathlib.PosixPath``, read as its text. Any other
class (a config object or an
``argparse.Namespace`` a LightningModule put in its hyper-parameters, a class of a newer release) is refused by
:class:`CkptAllow`, naming it and the Lightning version the checkpoint records (its ``pytorch-lightning_version`` key,
read by :func:`recorded_version` without unpickling anything). Nothing in a checkpoint runs.
"""

from __future__ import annotations

import io
import pickletools
import posixpath
import zipfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any, BinaryIO

from ckpttool.console.terminal import escaped
from ckpttool.errors import UnsafePickleError
from ckpttool.fast.deferred import torch
from ckpttool.io.pickle_bounds import text
from ckpttool.io.torch_pickle import accepted_classes

#: the Lightning releases whose checkpoints the fixtures hold (``lightning_*``)
RELEASES = ("1.9.5", "2.4.0", "2.6.6")
#: the key of the checkpoint dict that records the release that wrote it
VERSION_KEY = "pytorch-lightning_version"
#: how much of a pickle :func:`recorded_version` walks: Lightning writes the version among the dict's first keys
_VERSION_OPS = 256


@dataclass(frozen=True, slots=True)
class Allowed:
    """One class a Lightning checkpoint may name.

    Attributes:
        module, name: as the pickle names it.
        releases: the Lightning releases whose checkpoints the fixtures show pickling it; empty for a class listed
            for a case no fixture has.
        where: what pickles it.
    """

    module: str
    name: str
    releases: tuple[str, ...]
    where: str


TABLE: tuple[Allowed, ...] = (
    Allowed("collections", "OrderedDict", RELEASES, "the LightningModule's state_dict (and its optimizer's)"),
    Allowed("torch._utils", "_rebuild_tensor_v2", RELEASES, "every tensor: weights, optimizer state"),
    Allowed("torch", "FloatStorage", RELEASES, "the tensors of an fp32 model (precision='32-true')"),
    Allowed("torch", "BFloat16Storage", (), "the tensors of a bf16 model (precision='bf16-true'; the fixtures: fp32)"),
    Allowed("torch", "HalfStorage", (), "the tensors of an fp16 model (precision='16-true'; the fixtures are fp32)"),
    Allowed("torch", "LongStorage", (), "an int64 buffer or optimizer step count (the fixtures' SGD keeps none)"),
    Allowed("pathlib", "PosixPath", ("1.9.5",), "ModelCheckpoint's dirpath given as a Path (its callbacks state)"),
)
_SCANS = frozenset(accepted_classes())


def _posix_path(*parts: Any) -> str:
    # the path's text: a Path is never built, so nothing in the checkpoint touches the file system; a Path pickles
    # its parts, the root its own part ('/', 'runs', 'x'), so they are joined as posixpath joins them
    return posixpath.join(*(text(p) for p in parts)) if parts else "."


#: the classes of :data:`TABLE` that ``scan`` does not accept by itself, and what the pickle gets instead
_STAND_INS = {("pathlib", "PosixPath"): _posix_path}


def recorded_version(f: BinaryIO, label: str) -> str | None:
    """The ``pytorch-lightning_version`` the ``torch.save`` archive ``f`` records, read from the first opcodes of its
    pickle (no object is built, nothing runs); None when the archive records none or cannot be read (then
    :func:`ckpttool.io.torch_save.scan` says why)."""
    try:
        f.seek(0)
        archive = zipfile.ZipFile(f)
        names = [n for n in archive.namelist() if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(names) != 1:
            return None
        with archive.open(names[0]) as pickled:
            data = pickled.read(1 << 16)
        after_key = False
        for count, (op, arg, _) in enumerate(pickletools.genops(io.BytesIO(data))):
            if count > _VERSION_OPS:
                return None
            if isinstance(arg, str) and op.name.endswith("UNICODE"):
                if after_key:
                    return arg if len(arg) < 40 else None
                after_key = arg == VERSION_KEY
    except (zipfile.BadZipFile, ValueError, OSError, EOFError, KeyError):
        return None
    return None


def refusal(label: str, qualified: str, version: str | None) -> str:
    """The message refusing a class outside :data:`TABLE` in the Lightning checkpoint file ``label``."""
    recorded = (f"the checkpoint records Lightning {escaped(version)} ({VERSION_KEY})" if version is not None else
                f"the checkpoint records no Lightning version (no {VERSION_KEY} key)")
    known = "known" if version in RELEASES else "not one ckpttool has run"
    return (
        f"'{label}': refused to unpickle: it asks for '{qualified}', which no Lightning checkpoint ckpttool knows "
        f"pickles (nothing was executed); {recorded}, {known}. ckpttool reads the classes Lightning "
        f"{', '.join(RELEASES)} writes with plain hyper-parameters: an object in save_hyperparameters (a config, an "
        "argparse.Namespace) is pickled as its class; save plain values (config.to_dict(), vars(args)), or report "
        "the class and the release"
    )


class CkptAllow(Mapping[tuple[str, str], Any]):
    """:data:`TABLE` as the allow-list of :func:`ckpttool.io.torch_save.scan` for one checkpoint file: a class of the
    table that ``scan`` accepts by itself (a tensor, the state dict, a storage) is left to it (a ``KeyError``), as is
    a dtype; a path gets its text (``_STAND_INS``); any other class is refused with :func:`refusal`. It iterates over
    nothing."""

    def __init__(self, label: str, version: str | None) -> None:
        self.label = label  # the file whose pickle asks
        self.version = version

    def __getitem__(self, key: tuple[str, str]) -> Any:
        module, name = key
        if key in _STAND_INS:
            return _STAND_INS[key]
        if f"{module}.{name}" in _SCANS or (module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
            raise KeyError(key)
        raise UnsafePickleError(refusal(self.label, f"{module}.{name}", self.version))

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(())

    def __len__(self) -> int:
        return 0
