"""Megatron-Core ``torch_dist`` (``--ckpt-format torch_dist``): a PyTorch DCP directory plus Megatron's files.

On disk, per saved iteration (``iter_0000010/``, named by ``latest_checkpointed_iteration.txt`` one level up)::

    metadata.json        {"sharded_backend": "torch_dist", "common_backend": "torch", ...}
    .metadata            DCP metadata: every ShardedTensor's global shape and chunks
    __R_I.distcp         the chunks rank R wrote
    common.pt            torch.save of the non-sharded state: args (argparse.Namespace), iteration, ...

The sharded keys are Megatron-Core's global names, not module paths: the layers of a pipeline stage are stacked
with a leading global layer axis (``decoder.layers.self_attention.linear_qkv.weight`` is ``(L, rows, H)``; each
stage fills its layers), experts get a second axis (``decoder.layers.mlp.experts.linear_fc1.weight`` is
``(L, E, 2F, H)``; each EP rank fills its experts), a SwiGLU ``linear_fc1`` is ``[gate; up]`` over the whole FFN
(each TP rank's ``[gate_r; up_r]`` is saved as two chunks), and norms of the local layer spec are saved under
Transformer Engine's names (``linear_qkv.layer_norm_weight``). With ``singleton_local_shards`` layers and experts
are named by index instead (``decoder.layers.3.mlp.experts.5.linear_fc1.weight_w``). ``_extra_state`` entries
and the RNG ``ShardedObject`` are bytes, skipped.

The DCP parsing is :mod:`.dcp`'s; this reader adds the args check (the source convention's, which the reader is
told: :class:`~.common.ConventionTables`), vocab padding and the parallel layout; the cut into HuggingFace tensors
is the Megatron-Core convention's.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from ckpttool.io import jsonfile
from ckpttool.model.description import ModelInfo
from ckpttool.layout.layout import Layout, Piece
from ckpttool.errors import SourceError
from ckpttool.io.paths import JSON_LIMIT, open_inside, read_inside
from ckpttool.io.safe_pickle import Record
from ckpttool.readers.validate import expect
from ckpttool.readers import dcp
from ckpttool.readers.megatron import common as megatron
from ckpttool.readers.megatron.common import ConventionTables
from ckpttool.readers.megatron import fp8 as megatron_fp8
from ckpttool.readers.base import FormatReader

NAME = "megatron-dist"
LOOKS_FOR = "metadata.json with sharded_backend torch_dist, .metadata and *.distcp (Megatron-Core torch_dist)"
COMMON = "common.pt"
METADATA_JSON = "metadata.json"

def matches(root: Path) -> bool:
    directory = megatron.matched_iteration(root)
    if directory is None:
        return False
    try:
        return _backend(directory, root) == "torch_dist"
    except SourceError:  # Megatron's metadata.json beside DCP metadata, but unreadable: read() says why
        return (directory / dcp.METADATA).is_file()


def _backend(directory: Path, root: Path) -> str | None:
    """``sharded_backend`` from ``metadata.json``; None when there is no such file or it does not say.

    Raises:
        SourceError: the file is there but not a regular file, unreadable, or not JSON (or nested too deeply).
    """
    path = directory / METADATA_JSON
    if not os.path.lexists(path):
        return None
    raw = read_inside(directory, METADATA_JSON, str(path), limit=JSON_LIMIT, within=root)  # never a FIFO or a device
    try:
        doc = jsonfile.loads(raw)
    except ValueError as e:
        raise SourceError(f"'{path}': cannot read it: {e}") from None
    return doc.get("sharded_backend") if isinstance(doc, dict) else None


def read(root: Path, model: ModelInfo | None, *, tables: ConventionTables | None = None) -> Layout:
    """The ``torch_dist`` checkpoint in ``root`` as a layout; ``tables``: what the source convention tells the
    reader (its args checks; without them, the args are not compared with ``model``'s config, and a note says so).

    Raises:
        SourceError: the checkpoint is malformed.
        ConfigError: the args contradict ``model``'s config (before any vocab padding is checked).
    """
    directory = megatron.iteration_dir(root)
    backend = _backend(directory, root)
    if backend != "torch_dist":
        raise SourceError(
            f"'{directory / METADATA_JSON}': sharded_backend is {backend!r}; ckpttool reads Megatron's torch_dist"
        )
    # a dry run leaves the items unlocated, as for DCP, and screens each for Transformer Engine's tensors instead
    extents: dict[tuple[str, int], int] | None = {} if dcp.deferring() else None
    layout = dcp.read(directory, model, within=root, locate=extents is None, extents=extents)
    args = _common_args(directory, root)
    prefix = "" if directory == root else f"{directory.relative_to(root)}/"
    megatron_fp8.refuse_te_items(layout, directory, prefix, root, extents)
    where = f"{prefix}{COMMON}"
    if model is not None and tables is not None:
        tables.check_args(megatron.args_view(args), model, f"{prefix}{COMMON}")
    padding = {}
    for fqn in megatron.VOCAB_TENSORS:
        tensor = layout.tensors.get(fqn)
        if tensor is not None and tensor.global_shape:
            found = megatron.vocab_padding(fqn, tensor.global_shape[0], args, model, where)
            if found:
                padding[fqn] = found
    layout = megatron.with_padding(layout, padding)
    notes = list(layout.notes)
    notes += megatron_fp8.torch_dist_notes(megatron.fp8_flags(args), {t.dtype for t in layout.tensors.values()},
                                           directory / dcp.METADATA, f"{prefix}{dcp.METADATA}")
    if args is None:
        notes.append(f"no args in '{prefix}{COMMON}': parallel layout unknown, nothing checked against the config")
    elif model is not None and tables is None:
        notes.append(f"the args in '{prefix}{COMMON}' were not checked against the config (the reader was not told "
                     "the convention's checks: ckpttool.read_layout tells it)")
    if prefix:
        layout = _rebase(layout, prefix, root)
    return replace(layout, format=NAME, notes=tuple(notes),
                   parallel=megatron.parallel_of(args, where) if args is not None else {})


def _common_args(directory: Path, root: Path) -> object | None:
    """The training args from ``common.pt`` (None when the file or the entry is absent); no link out of ``root``."""
    path = directory / COMMON
    if not path.is_file():
        return None
    with open_inside(directory, COMMON, within=root) as f:
        common = megatron.scan_checkpoint(f, label=COMMON)
    args = common.get("args") if isinstance(common, dict) else None
    return None if args is None else expect(args, (Record, dict), "args (the training arguments)", COMMON)


def _rebase(layout: Layout, prefix: str, root: Path) -> Layout:
    """Piece files relative to ``root`` (the directory the user named), so messages say ``iter_.../__1_0.distcp``."""
    def moved(pieces):  # built directly: dataclasses.replace costs ~0.5 s at 92k pieces
        return tuple(Piece(prefix + p.file, p.key, p.box, p.dtype, p.encoding, p.byte_offset, p.byte_length, p.tags)
                     for p in pieces)

    tensors = {fqn: replace(t, pieces=moved(t.pieces)) for fqn, t in layout.tensors.items()}
    absent = {fqn: moved(pieces) for fqn, pieces in layout.absent.items()}
    missing = tuple(prefix + f for f in layout.missing)
    return replace(layout, root=str(root), tensors=tensors, absent=absent, missing=missing)


READER = FormatReader(NAME, LOOKS_FOR, matches, read)
