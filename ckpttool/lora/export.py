"""A LoRA adapter written as PEFT's ``save_pretrained`` writes it: ``adapter_config.json`` and
``adapter_model.safetensors`` whose keys are ``base_model.model.<module>.lora_A.weight`` / ``lora_B.weight``, the
modules named as transformers holds them in memory (what ``PeftModel.from_pretrained(base, folder)`` looks for).

The safetensors file is laid out as the safetensors library lays one out (tensors by dtype, widest first, then by
name; ``__metadata__`` ``{"format": "pt"}``), so an adapter read from a sharded source is written with the bytes
``save_pretrained`` of the same adapter writes. The config is PEFT's own (``json.dumps(indent=2, sort_keys=True)``),
``inference_mode`` set as ``save_pretrained`` sets it.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from ckpttool.errors import OutputError
from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import itemsize
from ckpttool.io.safetensors_format import encode_header
from ckpttool.lora.adapter import CONFIG, PREFIX, WEIGHTS, Adapter
from ckpttool.writers.destination import Output
from ckpttool.writers.trust import create_file

#: what ``merge --adapter-only`` writes: ``force`` replaces a folder holding these alone (and PEFT's model card)
ADAPTER_OUTPUT = Output("merge --adapter-only", re.compile("|".join(map(re.escape, (CONFIG, WEIGHTS[0], "README.md")))))


def write_adapter_folder(adapter: Adapter, folder: Path) -> list[str]:
    """Write ``adapter`` into ``folder`` (a staging directory) as PEFT saves one. Returns the file names written.

    Raises:
        SourceError: an adapter tensor cannot be read; OutputError: a file cannot be written.
    """
    tensors = {}
    for module, delta in adapter.deltas.items():
        tensors[f"{PREFIX}{module}.lora_A.weight"] = delta.a
        tensors[f"{PREFIX}{module}.lora_B.weight"] = delta.b
    order = sorted(tensors, key=lambda k: (-itemsize(tensors[k].dtype), k))  # the safetensors library's order
    prefix, _ = encode_header({k: (tensors[k].dtype, tuple(tensors[k].shape)) for k in order}, {"format": "pt"})
    config = {**adapter.config, "inference_mode": True}
    try:
        with os.fdopen(create_file(folder / WEIGHTS[0]), "wb") as f:
            f.write(prefix)
            for key in order:
                t = tensors[key]
                f.write(t.read_rows(0, t.shape[0]).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        with os.fdopen(create_file(folder / CONFIG), "w") as f:
            f.write(json.dumps(config, indent=2, sort_keys=True))
    except OSError as e:
        raise OutputError(f"'{e.filename or folder}': cannot write the adapter: {e.strerror or e}") from None
    return [CONFIG, WEIGHTS[0]]
