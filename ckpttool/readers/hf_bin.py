"""HuggingFace ``.bin`` weights: ``pytorch_model.bin``, or ``pytorch_model-0000i-of-0000N.bin`` shards named by
``pytorch_model.bin.index.json``, as ``save_pretrained(..., safe_serialization=False)`` of transformers 4 writes
them (the default before safetensors; many released and fine-tuned checkpoints still come this way).

Each file is ``torch.save`` of a plain dict of tensors: a zip archive of stored entries, ``<name>/data.pkl`` the
pickled dict and ``<name>/data/<key>`` each storage's bytes. :func:`read_bin` walks the pickle with
:func:`ckpttool.io.torch_save.scan`, which builds nothing but tensors, containers and dtypes and refuses any other
class by name (nothing in the file runs), and locates every tensor's bytes in the file, so the file reads like a
safetensors file: a :class:`~ckpttool.io.safetensors_format.Header` of entries with absolute byte ranges.

Tensors that share a storage (a tied embedding and head, when transformers kept both names) are entries over the
same bytes; a view that is not contiguous in its storage is refused, naming it.
"""

from __future__ import annotations

import os

from ckpttool.errors import SourceError
from ckpttool.io.dtypes import itemsize
from ckpttool.io.paths import open_source, source_os_error
from ckpttool.io.safetensors_format import Entry, Header
from ckpttool.io.torch_save import StoredTensor, scan

#: transformers' names (``WEIGHTS_NAME``, ``WEIGHTS_INDEX_NAME``)
BIN_SINGLE = "pytorch_model.bin"
BIN_INDEX = "pytorch_model.bin.index.json"
#: how a ``torch.save`` file of the legacy format (torch < 1.6, a pickle stream, not a zip) starts: the pickled
#: magic number 0x1950a86a20f9469cfc6c (protocol 2)
LEGACY_MAGIC = b"\x80\x02\x8a\x0al\xfc\x9cF\xf9 j\xa8P\x19."
#: the files of a sharded save an index should name (``pytorch_model-00001-of-00003.bin``); never
#: ``training_args.bin`` or ``optimizer.bin``, which the Trainer saves beside the weights
BIN_PATTERN = "pytorch_model*.bin"


def read_bin(path: str | os.PathLike[str], name: str | None = None) -> Header:
    """Every tensor of a ``.bin`` state dict, with the byte range of its elements in the file; no tensor is loaded.

    Args:
        path: the file.
        name: how to call the file in messages (default: the path).

    Raises:
        UnsafePickleError: the pickle asks for a class that is not a tensor or a plain container (named).
        PickleBombError: reading the pickle would take work without bound.
        SourceError: not a ``torch.save`` archive (truncated, garbage, the legacy pre-1.6 format: named so), not a
            dict of tensors, a key that is not a string, or a tensor whose bytes are not in place in the file
            (compressed, big-endian, a strided view).

    Example:
        >>> read_bin("pytorch_model.bin").entries["lm_head.weight"].shape  # doctest: +SKIP
        (96, 16)
    """
    label = str(path) if name is None else name
    with open_source(path, label) as f:
        try:
            start = f.read(len(LEGACY_MAGIC))
        except OSError as e:
            raise source_os_error(label, e) from None
        if start == LEGACY_MAGIC:
            raise SourceError(
                f"'{label}': written in torch.save's legacy format (torch < 1.6, not a zip archive), which ckpttool "
                "does not read; save it again with torch 1.6 or later (from_pretrained, then save_pretrained)")
        state = scan(f, label=label)
    if not isinstance(state, dict):
        raise SourceError(f"'{label}': holds a {type(state).__name__}, not a state dict (a dict of tensor names to "
                          "tensors, as save_pretrained writes)")
    entries: dict[str, Entry] = {}
    for key, tensor in state.items():
        if not isinstance(key, str):
            raise SourceError(f"'{label}': a state dict key {key!r:.60} that is not a tensor name")
        if not isinstance(tensor, StoredTensor):
            raise SourceError(f"'{label}': '{key}' is a {type(tensor).__name__}, not a tensor; transformers' state "
                              "dicts hold only tensors")
        begin = tensor.required_offset(label, key)
        entries[key] = Entry(tensor.dtype, tensor.shape, begin, begin + tensor.numel * itemsize(tensor.dtype))
    return Header(entries, {}, 0)
