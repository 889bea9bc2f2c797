"""Megatron-LM checkpoints of FP8 training: what they hold on disk, and what the Megatron readers do with it.

From the sources of megatron-core ``core_v0.16.1``, which pins Transformer Engine ``>=2.9,<2.12``:

- ``--ckpt-format torch_dist``: with ``--fp8-param-gather`` the weights of TE's modules are TE quantized tensors
  (``Float8Tensor``, ``MXFP8Tensor``, ``Float8BlockwiseQTensor``). The torch_dist writer moves each to the host with
  ``tensor.to("cpu")`` (``FileSystemWriterAsync.preload_tensors``), which TE 2.9-2.11 answer by dequantizing to the
  tensor's nominal dtype (``QuantizedTensor.__torch_dispatch__``'s default branch), and records that dtype: the files
  hold plain BF16/FP32 weights, the FP8 values times their scales. They merge as any weights do; the output is not
  an FP8 checkpoint (``--quantize fp8`` makes one).
- Every TE module also saves ``_extra_state``: under an FP8 recipe, its scaling state (recipe, amax history, scales
  of each GEMM's inputs and outputs), pickled with TE's classes, as bytes. It is training state with no place in a
  HuggingFace checkpoint; the readers skip it and say so (:func:`notes`).
- Transformer Engine 2.16 and later keep the quantized class when a parameter is copied to the host
  (``QuantizedTensor.__torch_dispatch__``'s ``_to_copy`` branch), so torch_dist would then ``torch.save`` TE's own
  tensors: such items are refused (:func:`refuse_te_items`), as ckpttool runs no TE code.
- ``--ckpt-format torch`` (legacy): ``model_optim_rng.pt`` pickles the parameters themselves, so with
  ``--fp8-param-gather`` it holds TE's own tensor classes (``Float8Tensor.__reduce_ex__`` -> its raw FP8 bytes and
  one ``scale_inv`` per tensor, rebuilt by TE's code on load). ckpttool runs no TE code: such a file is refused
  (:func:`refusal`), naming the class and the way out.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

from ckpttool.io import torch_pickle, torch_save, torch_zip
from ckpttool.layout.layout import TORCH_SAVE, Layout, Piece
from ckpttool.errors import UnsafePickleError
from ckpttool.io.paths import open_inside, read_source
from ckpttool.io.safe_pickle import load_metadata_pickle

#: the packages whose classes a Transformer Engine pickle names (TE's tensors; its C++ extension's enums)
TE_MODULES = ("transformer_engine", "transformer_engine_torch")
EXTRA_STATE = "._extra_state"
#: the training arguments that record FP8 training (``megatron.fp8_flags`` reads them)
FP8_ARGS = ("fp8", "fp8_recipe", "fp8_param_gather")


def is_te(module: str) -> bool:
    """Whether a pickle's ``module`` is one of Transformer Engine's."""
    return module.split(".", 1)[0] in TE_MODULES


def refusal(label: str, qualified: str) -> str:
    """The message refusing a legacy checkpoint file that pickles a Transformer Engine class (``qualified``)."""
    return (
        f"'{label}': holds Transformer Engine quantized parameters (its pickle asks for '{qualified}'): Megatron-LM "
        "wrote FP8 weights as TE's own tensors, as --fp8-param-gather does with --ckpt-format torch. ckpttool runs "
        "none of TE's code to rebuild them (nothing was executed). Save the checkpoint with --ckpt-format torch_dist, "
        "where Megatron-Core writes these weights dequantized to their training dtype, and merge that"
    )


def refuse_te_items(layout: Layout, directory: Path, prefix: str, root: Path | None = None,
                    extents: Mapping[tuple[str, int], int] | None = None) -> None:
    """Scan the pieces of a torch_dist ``layout`` whose bytes were not found raw in their ``torch.save`` items (plain
    tensors are; TE's tensors are not): a pickle asking for a Transformer Engine class is refused here, before
    anything is planned, naming the tensor and the file (``prefix`` + the file, relative to ``directory``). No
    link out of ``root`` (the source, ``directory`` by default) is followed.

    ``extents``: the layout was read with its items unlocated (a dry run: :func:`ckpttool.readers.dcp.read`'s
    ``extents``, each item's storage entry). Each item is then screened from its first bytes alone (one positioned
    read, :func:`ckpttool.io.torch_zip.read_first_pickle`): a ``data.pkl`` that pickles one plain tensor of the
    piece's dtype and shape names no class to refuse; any other item is located and, unlocated, scanned as the run
    that reads it does, so a dry run refuses the same items with the same message.

    Raises:
        UnsafePickleError: such an item (or one asking for any other class ckpttool does not allow).
    """
    handles: dict[str, BinaryIO] = {}
    try:
        for piece in (p for t in layout.tensors.values() for p in t.pieces):
            length = None if extents is None else extents.get((piece.file, piece.byte_offset))
            if length is None and piece.encoding != TORCH_SAVE:
                continue
            label = f"{prefix}{piece.file}"
            handle = handles.get(piece.file)
            if handle is None:
                handle = handles[piece.file] = open_inside(directory, piece.file, label, within=root)
            if length is None:
                torch_save.scan(handle, piece.byte_offset, piece.byte_length, label=label,
                                allow=_TeItems(label, piece.key))
            elif not _plain(handle, piece, length, label):
                torch_save.scan(handle, piece.byte_offset, length, label=label, allow=_TeItems(label, piece.key))
    finally:
        for handle in handles.values():
            handle.close()


def _plain(f: BinaryIO, piece: Piece, length: int, label: str) -> bool:
    """Whether the unlocated item of ``piece`` (``length`` bytes at its ``byte_offset``) holds one plain tensor of its
    dtype and shape: told from its first bytes, else located as the reading run locates it (the DCP reader)."""
    pickled = torch_zip.read_first_pickle(f, piece.byte_offset, length)
    found = torch_pickle.plain_tensor(pickled) if isinstance(pickled, bytes) else None
    if found is not None and found.storage.dtype == piece.dtype and found.shape == piece.box.sizes:
        return True
    located = torch_save.locate(f, piece.byte_offset, length, label=label, item=piece.key)
    return located is not None and located.dtype == piece.dtype and located.shape == piece.box.sizes


class RefusingAllowList(Mapping[tuple[str, str], Any]):
    """An allow-list of pickled classes whose lookup may refuse a class by name: ``in`` lets the refusal
    (:class:`UnsafePickleError`) through rather than answering False, so the message names the class."""

    def __contains__(self, name: object) -> bool:
        try:
            self[name]  # type: ignore[index]
        except UnsafePickleError:
            raise
        except (KeyError, TypeError, ValueError):
            return False
        return True


class _TeItems(RefusingAllowList):
    """The allow-list of a torch_dist item: nothing beyond tensors; Transformer Engine's classes refused by name."""

    def __init__(self, label: str, key: str) -> None:
        self.label, self.key = label, key

    def __getitem__(self, name: tuple[str, str]) -> Any:
        if is_te(name[0]):
            raise UnsafePickleError(
                f"'{self.label}': '{self.key}' is a Transformer Engine quantized tensor (its pickle asks for "
                f"'{name[0]}.{name[1]}'): torch_dist saved TE's own class, not the dequantized values it writes with "
                "Transformer Engine 2.9-2.15 (megatron-core 0.16.1 supports 2.9-2.11; from 2.16, TE keeps FP8 "
                "parameters quantized when they are copied to the host for saving). ckpttool runs none of TE's code "
                "(nothing was executed); save with Transformer Engine before 2.16, or without --fp8-param-gather"
            )
        raise KeyError(name)

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(())

    def __len__(self) -> int:
        return 0

    def __bool__(self) -> bool:  # empty, yet given: torch_save.scan takes a falsy allow-list for none
        return True


def notes(flags: Mapping[str, Any], dtypes: set[str], extra_states: int) -> list[str]:
    """What a reader says of a checkpoint whose training ``flags`` (:data:`FP8_ARGS`) record FP8 training (nothing
    when they do not): the weights, of ``dtypes``, are merged as stored; ``extra_states`` TE entries are skipped."""
    fp8 = flags.get("fp8")
    if not fp8:
        return []
    recipe, gather = flags.get("fp8_recipe"), bool(flags.get("fp8_param_gather"))
    said = f"fp8={fp8!r}" + (f", fp8_recipe={recipe!r}" if recipe else "") + (", fp8_param_gather" if gather else "")
    how = " (FP8 parameters dequantized by Megatron-Core's torch_dist writer)" if gather else ""
    skipped = (f"; its {extra_states} Transformer Engine _extra_state entries (FP8 scaling state: recipe, amax "
               "history, scales) are training state, skipped" if extra_states else "")
    return [f"trained in FP8 ({said}): the weights are stored in their training dtype ({'/'.join(sorted(dtypes))})"
            f"{how} and merged as stored, not as FP8 (--quantize fp8 writes FP8){skipped}"]


def dcp_extra_states(metadata: Any) -> int:
    """How many entries of a DCP ``.metadata`` (as :func:`~ckpttool.io.safe_pickle.load_metadata_pickle` gives it) are
    TE ``_extra_state`` objects (keys ``<module>._extra_state/shard_<offsets>_<shape>``, Megatron's ShardedObject)."""
    entries = metadata.get("state_dict_metadata") if getattr(metadata, "kind", None) == "Metadata" else None
    if not isinstance(entries, dict):
        return 0
    return sum(1 for key in entries if isinstance(key, str) and (EXTRA_STATE + "/" in key or key.endswith(EXTRA_STATE)))


def torch_dist_notes(flags: Mapping[str, Any], dtypes: set[str], metadata: Path, label: str) -> list[str]:
    """:func:`notes` for a torch_dist iteration, whose ``metadata`` file (DCP's ``.metadata``, read again only when
    the flags record FP8) counts the ``_extra_state`` entries."""
    if not flags.get("fp8"):
        return []
    return notes(flags, dtypes, dcp_extra_states(load_metadata_pickle(read_source(metadata, label), label)))


def with_notes(layout: Layout, flags: Mapping[str, Any]) -> Layout:
    """``layout`` with :func:`notes` of its weights' dtypes (a legacy checkpoint: its ``_extra_state`` entries are
    counted by the reader's own note)."""
    found = notes(flags, {t.dtype for t in layout.tensors.values()}, 0)
    return replace(layout, notes=(*layout.notes, *found)) if found else layout
