"""PyTorch Lightning checkpoints (``Trainer.save_checkpoint``, ``ModelCheckpoint``) of a HuggingFace model held by a
LightningModule.

Lightning writes one of two things under a ``.ckpt`` name:

- a **file** (``DDPStrategy``, ``FSDPStrategy(state_dict_type="full")``, one device): ``torch.save`` of a dict whose
  ``state_dict`` is the LightningModule's, so the HF model's names carry the attribute that holds it
  (``model.model.layers.0.self_attn.q_proj.weight`` for ``self.model = LlamaForCausalLM(...)``), beside
  ``optimizer_states``, ``lr_schedulers``, ``hyper_parameters``, ``callbacks``, ``loops``, ``epoch``, ``global_step``
  and ``pytorch-lightning_version``;
- a **folder** (``FSDPStrategy(state_dict_type="sharded")``, ``ModelParallelStrategy``): a DCP checkpoint of
  ``{"model": state_dict, "optimizer_0": ...}`` (names ``model.`` + the LightningModule's) and ``meta.pt``, the rest of
  the dict ``torch.save``d by rank 0.

The source is the folder holding one ``.ckpt`` (``ModelCheckpoint``'s ``dirpath``, with the model's config.json
beside), or a ``.ckpt`` folder itself. Only the model is read: the optimizer state is never read nor offered as a
model. The LightningModule's attribute prefix is stripped, with a note, so the names are the HF model's own. Every
pickle (the ``.ckpt`` file, ``meta.pt``) is walked with :func:`ckpttool.io.torch_save.scan` and the allow-list of
:mod:`.classes`: a class no Lightning release ckpttool knows writes is refused, naming it and the Lightning version
the checkpoint records; nothing runs.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from ckpttool.console.terminal import escaped
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.io.dtypes import itemsize
from ckpttool.io.paths import contained, open_inside
from ckpttool.io.torch_save import StoredTensor, scan
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.layout.layout import RAW, Box, Layout, Piece
from ckpttool.model.description import ModelInfo
from ckpttool.readers import dcp
from ckpttool.readers.base import FormatReader
from ckpttool.readers.lightning.classes import CkptAllow, recorded_version

NAME = "lightning"
LOOKS_FOR = "a Lightning .ckpt file, or a .ckpt folder with meta.pt (PyTorch Lightning)"
SUFFIX = ".ckpt"
#: what Lightning's sharded save writes beside the DCP files: the checkpoint dict without the model and optimizer
META = "meta.pt"
#: the DCP keys Lightning's sharded saves put the LightningModule's state dict under, and which strategy does
DCP_MODEL = {"state_dict": "ModelParallelStrategy", "model": "FSDPStrategy(state_dict_type='sharded')"}
#: the checkpoint dict's keys that are training state, never read (named in the note)
STATE_KEYS = ("optimizer_states", "lr_schedulers", "callbacks", "loops")


def _is_sharded(folder: Path) -> bool:
    return (folder / META).is_file() and (folder / dcp.METADATA).is_file()


def _ckpts(root: Path) -> list[Path]:
    """The ``.ckpt`` files and ``.ckpt`` folders (with ``meta.pt``) directly in ``root``, by name."""
    try:
        entries = sorted(root.iterdir())
    except OSError:
        return []
    return [p for p in entries if p.name.endswith(SUFFIX) and (p.is_file() or _is_sharded(p))]


def matches(root: Path) -> bool:
    return _is_sharded(root) or bool(_ckpts(root))


def _the_ckpt(root: Path) -> Path:
    """The one ``.ckpt`` in ``root`` (links to one another, as ``save_last="link"`` writes, count once).

    Raises:
        SourceError: several checkpoints; each is named, none is guessed.
    """
    found = _ckpts(root)
    distinct = {contained(root, p.name).resolve(): p for p in reversed(found)}
    if len(distinct) != 1:
        listed = "\n".join(f"  - '{escaped(str(p))}'" for p in found)
        raise SourceError(
            f"'{root}': holds {len(found)} Lightning checkpoints; ckpttool merges one. Move the one to merge into a "
            f"folder of its own (with config.json), or give a .ckpt folder itself as the source:\n{listed}")
    return next(iter(distinct.values()))


def read(root: Path, model: ModelInfo | None) -> Layout:
    """The model of the Lightning checkpoint in ``root`` under the HF model's own names (the LightningModule's
    attribute prefix stripped); the optimizer and the rest of the training state are never read.

    Raises:
        SourceError: several checkpoints in ``root``; not a Lightning checkpoint dict; a class no Lightning release
            ckpttool knows pickles (:mod:`.classes`); a state dict whose names share no attribute (several modules).
    """
    if _is_sharded(root):
        return _read_sharded(root, root, model, within=None)
    if not _ckpts(root):
        raise SourceNotFoundError(f"'{root}': no Lightning checkpoint (a *{SUFFIX} file, or a folder with {META} and "
                                  f"{dcp.METADATA})")
    ckpt = _the_ckpt(root)
    if ckpt.is_dir():
        return _read_sharded(root, ckpt, model, within=root)
    return _read_file(root, ckpt.name)


def _scan(root: Path, rel: str, within: Path | None = None, label: str | None = None) -> tuple[dict, str | None]:
    """The checkpoint dict pickled in ``rel`` (tensors as :class:`StoredTensor`), and the Lightning version it
    records; ``label`` names the file in messages (default ``rel``)."""
    label = rel if label is None else label
    with open_inside(root, rel, label, within=within) as f:
        version = recorded_version(f, label)
        state = scan(f, label=label, allow=CkptAllow(label, version))
    if not isinstance(state, dict):
        raise SourceError(f"'{label}': holds a {type(state).__name__}, not a Lightning checkpoint dict")
    return state, version


def _read_file(root: Path, rel: str) -> Layout:
    state, version = _scan(root, rel)
    tensors = state.get("state_dict")
    if not isinstance(tensors, dict):
        keys = ", ".join(repr(k)[:40] for k in list(state)[:6])
        raise SourceError(f"'{rel}': no 'state_dict' in it (keys: {keys}); not a Lightning checkpoint")
    for key, tensor in tensors.items():
        if not isinstance(key, str) or not isinstance(tensor, StoredTensor):
            raise SourceError(f"'{rel}': state_dict entry {key!r:.80} is a {type(tensor).__name__}, not a tensor")
    attribute = _attribute(rel, list(tensors))
    builder = LayoutBuilder(str(root), NAME)
    names, pieces, wheres = [], [], []
    for key, tensor in tensors.items():
        begin = tensor.required_offset(rel, key)
        names.append(key[len(attribute) + 1:])
        pieces.append(Piece(rel, key, Box.whole(tensor.shape), tensor.dtype, RAW, begin,
                            tensor.numel * itemsize(tensor.dtype)))
        wheres.append(f"'{rel}'")
    builder.add_wholes(names, pieces, wheres)
    return builder.build([_note(rel, "a .ckpt file", version, attribute, [k for k in STATE_KEYS if state.get(k)])])


def _read_sharded(root: Path, folder: Path, model: ModelInfo | None, within: Path | None) -> Layout:
    named = f"{folder.name}/{META}" if within is not None else META
    _, version = _scan(folder, META, within=within, label=named)  # a class outside the table: refused before the DCP
    layout = dcp.read(folder, model, within=within)
    label = folder.name if within is not None else str(folder)
    heads = sorted({fqn.partition(".")[0] for fqn in layout.tensors} & set(DCP_MODEL))
    if len(heads) != 1:
        found = ", ".join(f"'{h}.*'" for h in heads) or "neither"
        raise SourceError(
            f"'{label}': its DCP files hold {found} of {' and '.join(repr(k + '.*') for k in DCP_MODEL)} (Lightning's "
            "sharded saves put the LightningModule's state dict under one of them); not a Lightning checkpoint")
    head = heads[0] + "."
    ours = [fqn for fqn in layout.tensors if fqn.startswith(head)]
    others = sorted({fqn.partition(".")[0] for fqn in layout.tensors if not fqn.startswith(head)})
    attribute = _attribute(label, [fqn[len(head):] for fqn in ours])
    cut = len(head) + len(attribute) + 1
    under = f"{folder.name}/" if within is not None else ""
    moved = (lambda p: replace(p, file=under + p.file)) if under else (lambda p: p)
    # the layout's root is the source given, so every file is judged (links) and named from there
    tensors = {fqn[cut:]: replace(t, fqn=fqn[cut:], pieces=tuple(map(moved, t.pieces)))
               for fqn, t in layout.tensors.items() if fqn.startswith(head)}
    absent = {fqn[cut:]: tuple(map(moved, pieces)) for fqn, pieces in layout.absent.items() if fqn.startswith(head)}
    skipped = [f"{', '.join(others)}, {len(layout.tensors) - len(ours)} tensors"] if others else []
    note = _note(label, f"{DCP_MODEL[heads[0]]}'s DCP folder, key '{heads[0]}'", version, attribute, skipped)
    missing = tuple(under + m for m in layout.missing)
    return replace(layout, root=str(root), format=NAME, tensors=tensors, absent=absent, missing=missing,
                   notes=(note, *(n for n in layout.notes if "optimizer/training-state" not in n)))


def _attribute(label: str, keys: list[str]) -> str:
    """The LightningModule attribute holding the HF model: the first name component every key shares.

    Raises:
        SourceError: the keys share none (the module holds tensors under several attributes): each is named."""
    counts: dict[str, int] = {}
    for key in keys:
        head, dot, _ = key.partition(".")
        counts[head if dot else ""] = counts.get(head if dot else "", 0) + 1
    if len(counts) == 1 and "" not in counts:
        return next(iter(counts))
    listed = ", ".join(f"'{escaped(a[:60])}' ({n} tensor{'s' if n > 1 else ''})" if a else f"top-level ({n})"
                       for a, n in sorted(counts.items()))
    raise SourceError(
        f"'{label}': the LightningModule's state dict holds tensors under {len(counts)} attributes: {listed}; "
        "ckpttool reads a LightningModule that holds the HF model under one attribute (self.model = "
        "AutoModelForCausalLM...). Save that model alone (lit.model.save_pretrained) or report the layout")


def _note(label: str, how: str, version: str | None, attribute: str, skipped: list[str]) -> str:
    """What the user reads about the checkpoint ``label`` (``how`` it was saved) and what was taken from it."""
    written = f"Lightning {version}" if version else "no pytorch-lightning_version recorded"
    rest = f"; not read: {', '.join(skipped)} (training state, never a model)" if skipped else ""
    shown = escaped(attribute)
    return (f"read '{escaped(label)}' ({how}; {escaped(written)}): the LightningModule's '{shown}' attribute, its "
            f"prefix '{shown}.' stripped from every name{rest}")


READER = FormatReader(NAME, LOOKS_FOR, matches, read)

