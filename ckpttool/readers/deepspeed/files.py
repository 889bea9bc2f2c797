"""DeepSpeed's files: finding a step's rank files, loading them, and checking what the model and optimizer
states say about the parameters, before any tensor is cut.

The file names are those listed in :mod:`ckpttool.readers.deepspeed.reader`; this module knows which file of a step is
which (the tag in ``latest``, the ``mp_rank``/``zero_pp_rank`` names), scans the pickles with stand-ins for the
few DeepSpeed classes they name (:data:`ALLOW`, the table of :mod:`.classes` that names the releases writing
each), and checks the set of optimizer files against the
``partition_count`` they record. Loading goes through a :data:`Scan` that :func:`ckpttool.readers.deepspeed.reader.read`
passes down (its ``scan_file``), so one replacement there reaches every file read.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpttool.console.terminal import escaped, quoted
from ckpttool.io import torch_save
from ckpttool.errors import SourceError, SourceNotFoundError, UnsafePickleError
from ckpttool.io.paths import contained, inside, open_inside, read_tag
from ckpttool.readers.validate import dims, expect, field
from ckpttool.readers.deepspeed.classes import ALLOW, refusal_note
from ckpttool.readers.deepspeed.universal import universal_instead

MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
ZERO3_MODEL_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
OPTIM_STATES = re.compile(r"^(bf16_|fp16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")
LAYER_STATES = re.compile(r"^layer_(\d+)-model_states\.pt$")
#: a pipeline layer saved per tensor-parallel rank ('layer_01-model_00-model_states.pt')
LAYER_TP_STATES = re.compile(r"^layer_(\d+)-(.+)-model_states\.pt$")


@dataclass(frozen=True, slots=True)
class Loaded:
    """A scanned ``.pt`` file: its path relative to the layout's root and its object tree."""

    rel: str
    obj: Any


#: how a ``.pt`` file is loaded: ``scan(root, rel)``, :func:`scan_file` unless the reader is given another
Scan = Callable[[Path, str], Loaded]


# --------------------------------------------------------------------------------------------------- discovery

def step_dir(root: Path) -> Path | None:
    """The directory holding the rank files: ``root`` itself, the tag ``root/latest`` names, or the only
    ``global_step*`` directory."""
    if not root.is_dir():
        return None
    if has_states(root):
        return root
    latest = root / "latest"
    if not latest.is_file() and (root / "latest_universal").is_file():
        latest = root / "latest_universal"  # ds_to_universal's tag file
    if latest.is_file():
        tag = read_tag(latest)
        if tag is None or "/" in tag or "\\" in tag or tag in (".", ".."):  # its content is never shown
            raise SourceError(f"'{latest}': not a valid checkpoint tag (DeepSpeed writes the name of one step's "
                              "folder there, such as 'global_step100')")
        step = inside(root, tag, named_by=latest.name)  # a symlink out of the checkpoint is refused
        if not step.is_dir():
            raise SourceError(f"'{latest}' names the checkpoint {tag!r}, but '{step}' is not a directory")
        return step
    steps = sorted(p for p in root.iterdir() if p.is_dir() and has_states(p))
    if len(steps) == 1:
        return steps[0]
    if len(steps) > 1:
        raise SourceError(
            f"'{root}': {len(steps)} checkpoints ({', '.join(p.name for p in steps[:6])}) and no 'latest' file; "
            "give the directory of the one to merge"
        )
    return None


def has_states(path: Path) -> bool:
    """Whether ``path`` holds DeepSpeed rank files (``*_model_states.pt`` or ``*_optim_states.pt``)."""
    return any(n.name.endswith(("_model_states.pt", "_optim_states.pt")) for n in path.iterdir() if n.is_file())


def step_rel(tag: str, name: str) -> str:
    """A file's path relative to the layout's root: ``name`` inside the step folder ``tag`` ('' when the root
    is the step)."""
    return f"{tag}/{name}" if tag else name


# ----------------------------------------------------------------------------------------------------- loading

def scan_file(root: Path, rel: str) -> Loaded:
    """``rel``'s object tree, tensors as :class:`StoredTensor` (``torch_save.scan`` with :data:`ALLOW`).

    Raises:
        UnsafePickleError: the pickle asks for a class :data:`ALLOW` does not list; the message adds the
            DeepSpeed release the checkpoint records (:func:`~ckpttool.readers.deepspeed.classes.refusal_note`).
    """
    if not contained(root, rel).is_file():  # a link on the way out of the checkpoint is refused, naming it
        raise SourceNotFoundError(f"{quoted(rel)}: missing")
    label = escaped(rel)  # a universal checkpoint's folder names come from the file system
    try:
        with open_inside(root, rel, label) as f:
            return Loaded(rel, torch_save.scan(f, label=label, allow=ALLOW))
    except UnsafePickleError as e:
        raise UnsafePickleError(f"{e}{refusal_note(root, rel)}") from None


def first_model_states(root: Path, step: Path, tag: str, models: list[tuple[int, str]], *, scan: Scan) -> Loaded:
    """The first model states file of ``models`` (``mp_rank_00_model_states.pt``), scanned; a clear error when
    there is none."""
    if not models:
        raise SourceNotFoundError(f"'{step_rel(tag, 'mp_rank_00_model_states.pt')}': missing (the model states: "
                                  "parameter names and shapes)")
    return load_states(root, step_rel(tag, models[0][1]), scan=scan)


def load_states(root: Path, rel: str, *, scan: Scan) -> Loaded:
    """A model states file, scanned: a dict."""
    state = scan(root, rel)
    if not isinstance(state.obj, dict):
        raise SourceError(f"'{state.rel}': not a DeepSpeed model states file (no dict inside)")
    return state


def dp_from_optim(optims: list[tuple[int, int, str, str]]) -> int:
    """The data-parallel size the optimizer files show: one more than their highest ``zero_pp_rank`` (1 when none)."""
    return max((r for _, r, _, _ in optims), default=-1) + 1 or 1


def param_shapes(state: Loaded) -> list[dict[str, tuple[int, ...]]]:
    """The model states' ``param_shapes``: one ordered ``{name: shape}`` per optimizer param group, checked."""
    groups = state.obj.get("param_shapes")
    if not isinstance(groups, list) or not all(isinstance(g, dict) for g in groups):
        raise SourceError(f"'{state.rel}': no 'param_shapes' (is it a ZeRO checkpoint? else use weights='module')")
    out = []
    for group in groups:
        shapes = {}
        for name, shape in group.items():
            if not isinstance(shape, tuple) or not all(isinstance(n, int) and n >= 0 for n in shape):
                raise SourceError(f"'{state.rel}': '{name}' has the shape {shape!r} in param_shapes")
            shapes[expect(name, str, "param_shapes: a parameter name", state.rel)] = shape
        out.append(shapes)
    return out


def listed_names(state: Loaded, key: str) -> set[str]:
    """A list of names in the model states (``buffer_names``); absent: none."""
    names = field(state.obj, key, list, state.rel, default=None) or []
    return {expect(n, str, f"{key}: an entry", state.rel) for n in names}


# --------------------------------------------------------------------------------------------- optimizer files

def optimizer_state_dict(loaded: Loaded) -> dict:
    """The ``optimizer_state_dict`` of an optimizer states file, or an error naming the file."""
    osd = loaded.obj.get("optimizer_state_dict") if isinstance(loaded.obj, dict) else None
    if not isinstance(osd, dict):
        raise SourceError(f"'{loaded.rel}': no 'optimizer_state_dict'; not a DeepSpeed optimizer states file")
    return osd


def read_optim_ranks(root: Path, tag: str, group: list[tuple[int, int, str, str]], *, scan: Scan) -> tuple[
        dict[int, tuple[Loaded, dict]], int, str, str]:
    """Scan every rank's optimizer file; check their number against the recorded partition count.

    Returns the present ranks, the partition count, the file-name prefix and the mp rank's name template.
    """
    present = {rank: scan(root, step_rel(tag, name)) for _, rank, _, name in group}
    prefixes = sorted({prefix for _, _, prefix, _ in group})
    if len(prefixes) > 1:
        raise SourceError(f"'{step_rel(tag, '')}': optimizer files of different kinds ({', '.join(p or 'fp32' for p in prefixes)}) "
                          "side by side; is it two checkpoints in one directory?")
    ranks = {rank: (loaded, optimizer_state_dict(loaded)) for rank, loaded in present.items()}
    counts = {}
    for rank, (loaded, osd) in ranks.items():
        count = osd.get("partition_count")
        if isinstance(count, list):
            values = dims(count, "partition_count", loaded.rel)
            if len(set(values)) > 1:
                raise SourceError(f"'{loaded.rel}': partition_count {count} differs between param groups "
                                  "(expert data parallelism: a DeepSpeed MoE checkpoint), but no per-expert files "
                                  "(layer_*_expert_*_mp_rank_*_model_states.pt) lie beside it; is it complete?"
                                  + universal_instead(root / tag if tag else root))
            count = values[0] if values else count
        if not isinstance(count, int) or count < 1:
            raise SourceError(f"'{loaded.rel}': partition_count is {count!r}")
        counts[rank] = count
    if len(set(counts.values())) != 1:
        listed = ", ".join(f"{count} in '{ranks[r][0].rel}'" for r, count in sorted(counts.items()))
        raise SourceError(f"the optimizer files disagree on partition_count: {listed}")
    count = next(iter(counts.values()))
    if count > 64 * len(ranks):  # each missing rank's region is named: not for a count no save could make
        raise SourceError(f"partition_count is {count} (in '{ranks[min(ranks)][0].rel}'), but {len(ranks)} optimizer "
                          f"files were found; expected {count} files for ranks 0..{count - 1}")
    mp_rank = group[0][0]
    extra = sorted(r for r in ranks if r >= count)
    if extra:
        raise SourceError(
            f"partition_count is {count} (in '{ranks[min(ranks)][0].rel}'), but {len(ranks)} optimizer files were "
            f"found, among them rank {extra[0]} ('{ranks[extra[0]][0].rel}'); expected {count} files for ranks "
            f"0..{count - 1}. Is it a mix of two checkpoints?"
        )
    return ranks, count, prefixes[0], f"{prefixes[0]}zero_pp_rank_{{rank}}_mp_rank_{mp_rank:02d}_optim_states.pt"
