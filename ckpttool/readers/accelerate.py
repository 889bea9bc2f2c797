"""accelerate's ``Accelerator.save_state`` folder with FSDP: a DCP directory per model, or the model whole.

``save_state(DIR)`` writes ``DIR/pytorch_model_fsdp_N/`` (the N-th prepared model, a DCP directory),
``DIR/optimizer_N/`` (its optimizer, another DCP directory) and pickles of RNG, scheduler and sampler state
(``random_states_R.pkl``, ``scheduler.bin``...). Given ``DIR``, the model folder is the checkpoint: the optimizer
folder is never read nor offered as a model, and the pickles are never opened. With several models the user
picks one. The DCP reader (:mod:`.dcp`) reads the folder chosen here.

With ``FULL_STATE_DICT`` rank 0 saves the model whole instead, ``DIR/pytorch_model_fsdp.bin`` (``_N.bin`` for the
N-th model, one ``torch.save`` of the state dict), beside ``optimizer.bin`` (never read); the HuggingFace reader
(:mod:`.hf`) reads the file chosen here as it reads ``pytorch_model.bin``.
"""

from __future__ import annotations

import re
from pathlib import Path

from ckpttool.errors import SourceError
from ckpttool.io.paths import contained

#: accelerate's ``FSDP_MODEL_NAME`` with the model's index
MODEL_FOLDER = re.compile(r"pytorch_model_fsdp_\d+")
#: accelerate's ``OPTIMIZER_NAME`` with the optimizer's index: optimizer state, never a model
OPTIMIZER_FOLDER = re.compile(r"optimizer_\d+")
#: what save_state's other files start with: the model (a folder, or a file without FSDP), the RNG states
MODEL_PREFIX = "pytorch_model_fsdp"
RNG_FILE = re.compile(r"random_states_\d+\.pkl")
#: accelerate's FULL_STATE_DICT model file (``FSDP_MODEL_NAME.bin``, ``_N`` for the N-th model): rank 0's
#: ``torch.save`` of the whole model's state dict, beside ``optimizer.bin``
WHOLE_MODEL_FILE = re.compile(r"pytorch_model_fsdp(?:_(\d+))?\.bin")
METADATA = ".metadata"


def model_folders(root: Path) -> list[Path]:
    """The ``pytorch_model_fsdp_N/`` DCP directories directly in ``root``, sorted by N (none when ``root``
    cannot be listed)."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return []
    found = [p for p in entries if MODEL_FOLDER.fullmatch(p.name) and (p / METADATA).is_file()]
    return sorted(found, key=lambda p: int(p.name.rsplit("_", 1)[1]))


def is_optimizer_folder(folder: Path) -> bool:
    """True for accelerate's ``optimizer_N/`` in a ``save_state`` folder (beside a ``pytorch_model_fsdp*`` entry or
    ``random_states_*.pkl``, by name only: no pickle is opened): optimizer state, never a model to offer."""
    if not OPTIMIZER_FOLDER.fullmatch(folder.name):
        return False
    try:
        return any(p.name.startswith(MODEL_PREFIX) or RNG_FILE.fullmatch(p.name) for p in folder.parent.iterdir())
    except OSError:
        return False


def the_model_folder(root: Path) -> Path:
    """The one ``pytorch_model_fsdp_N/`` in ``root``.

    Raises:
        SourceError: ``root`` holds several (several models were prepared): the message names each; none is
            guessed.
        LinkOutError: the folder is a symlink out of ``root`` (links are followed only inside the source).
    """
    found = model_folders(root)
    if len(found) != 1:
        listed = "\n".join(f"  - '{p}'" for p in found)
        raise SourceError(
            f"'{root}': accelerate's save_state folder holds {len(found)} models; give the one to merge as the "
            f"source:\n{listed}"
        )
    return contained(root, found[0].name)


def note(root: Path, folder: Path) -> str:
    """What the user reads about the folder merged in place of ``root``."""
    return (f"merged '{folder.name}/', the model of accelerate's save_state folder '{root}' "
            "(the optimizer folder and the RNG/scheduler pickles are not read)")


def whole_model_files(root: Path) -> list[str]:
    """The ``pytorch_model_fsdp[_N].bin`` files directly in ``root`` (FULL_STATE_DICT), sorted by N."""
    try:
        names = [p.name for p in root.iterdir() if WHOLE_MODEL_FILE.fullmatch(p.name) and p.is_file()]
    except OSError:
        return []
    return sorted(names, key=lambda n: int(WHOLE_MODEL_FILE.fullmatch(n)[1] or 0))


def the_whole_model_file(root: Path) -> str:
    """The one ``pytorch_model_fsdp[_N].bin`` in ``root``.

    Raises:
        SourceError: ``root`` holds several (several models were prepared): the message names each; none is
            guessed.
    """
    found = whole_model_files(root)
    if len(found) != 1:
        listed = "\n".join(f"  - '{root / name}'" for name in found)
        raise SourceError(
            f"'{root}': accelerate's save_state folder holds {len(found)} whole models; move the one to merge into a "
            f"folder of its own (with config.json) as pytorch_model.bin:\n{listed}"
        )
    return found[0]


def whole_note(root: Path, name: str) -> str:
    """What the user reads about the whole-model file merged from the save_state folder ``root``."""
    return (f"merged '{name}', the whole model (FULL_STATE_DICT) of accelerate's save_state folder '{root}' "
            "(optimizer.bin and the RNG/scheduler pickles are not read)")
