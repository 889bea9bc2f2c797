"""Which format a directory holds, when more than one reader recognises it.

Every reader is asked. Some formats hold another by construction, and then the more specific one is the
checkpoint: a Megatron-Core ``torch_dist`` iteration is a PyTorch DCP directory plus Megatron's files, and a
ColossalAI checkpoint of plain shards has the index a HuggingFace directory has. Any other pair (a DCP
``.metadata`` set and a ckpttool sidecar set in one folder, DeepSpeed's ``global_step*/`` beside a HuggingFace
``model.safetensors``) is two checkpoints: reading one would silently leave out the other, so the user names
the one meant.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from ckpttool.errors import SourceError
from ckpttool.readers.base import Reader

#: format -> formats whose files are part of it (a less specific reading of the same checkpoint)
CONTAINS: dict[str, tuple[str, ...]] = {
    "megatron-dist": ("dcp",),
    "colossalai": ("hf",),
    "lightning": ("dcp",),
}

#: format -> the names of the entries of its directory that made it recognisable, to say what was found
EVIDENCE: dict[str, tuple[str, ...]] = {
    "sidecar": ("*.ckpttool.json",),
    "deepspeed": ("latest", "latest_universal", "global_step*"),
    "verl": ("model_world_size_*_rank_*.pt",),
    "colossalai": ("tmp_index_files", "*-stage-*-shard-*", "*.index.json"),
    "megatron-dist": ("latest_checkpointed_iteration.txt", "iter_*", "release", "metadata.json", ".metadata"),
    "megatron-legacy": ("latest_checkpointed_iteration.txt", "iter_*", "release", "mp_rank_*"),
    "lightning": ("*.ckpt", "meta.pt"),
    "dcp": (".metadata", "*.distcp"),
    "hf-distributed": ("shard-*-model-*-of-*.safetensors",),
    "hf": ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json"),
}

#: entries named per format in the message
SHOWN = 3


def claimed_format(root: Path, readers: Mapping[str, Reader]) -> str | None:
    """The one format ``root`` holds, None when no reader recognises it.

    Raises:
        SourceError: two formats claim ``root`` and neither holds the other: the message names both, what was
            found for each, and asks for ``format='NAME'``.
    """
    matched = [name for name, reader in readers.items() if reader.matches(root)]
    contained = {inner for name in matched for inner in CONTAINS.get(name, ())}
    formats = [name for name in matched if name not in contained]
    if len(formats) <= 1:
        return formats[0] if formats else None
    listed = "\n".join(f"  - {name}: {_found(root, name)}" for name in formats)
    raise SourceError(
        f"'{root}': holds checkpoints of {len(formats)} formats:\n{listed}\n"
        "Merging one would silently leave out the other. Pass format='NAME' with the one you mean "
        f"({' or '.join(formats)}), or move the other checkpoint to a folder of its own."
    )


def _found(root: Path, name: str) -> str:
    """The entries of ``root`` that show ``name``'s format, e.g. ``'.metadata', '__0_0.distcp' and 1 more``."""
    entries = sorted({p.name + ("/" if p.is_dir() else "") for pattern in EVIDENCE.get(name, ()) for p in root.glob(pattern)})
    if not entries:
        return "recognised"
    shown = ", ".join(f"'{e}'" for e in entries[:SHOWN])
    return shown + (f" and {len(entries) - SHOWN} more" if len(entries) > SHOWN else "")
