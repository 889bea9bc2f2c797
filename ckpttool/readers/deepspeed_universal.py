"""Where DeepSpeed's universal checkpoint of a step lies, to name it when the step itself cannot be read.

``ds_to_universal`` writes ``<tag>_universal/`` beside the step and names it in ``latest_universal``. A step
saved with tensor parallelism or MoE expert parallelism does not record how its tensors are cut, so the
DeepSpeed reader refuses it; when its universal form is already there, the error names that folder instead of
advising to run the conversion again.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import SourceError
from ..paths import inside

#: the tag file ``ds_to_universal`` writes beside ``latest``
LATEST_UNIVERSAL = "latest_universal"
#: the most bytes of a tag file read: a tag is a folder name
_TAG_BYTES = 256


def way_out(step: Path) -> str:
    """How to read a step whose tensor-parallel cuts are not recorded: its universal checkpoint when one lies
    beside it, else the conversion that writes one."""
    return universal_instead(step).removeprefix("; ") or (
        "convert the checkpoint with DeepSpeed's ds_to_universal (which applies the model's split patterns) and "
        "merge the result")


def universal_instead(step: Path) -> str:
    """``"; its universal checkpoint ... merge that instead"`` when one lies beside ``step``, else ``""``: the
    end of an error refusing the step."""
    universal = universal_beside(step)
    if universal is None:
        return ""
    return f"; its universal checkpoint '{universal}' (ds_to_universal's output) lies beside it: merge that instead"


def universal_beside(step: Path) -> Path | None:
    """The universal checkpoint next to ``step``: the one ``latest_universal`` names, else ``<step>_universal``,
    else the only ``*_universal`` folder; None when there is none (or several and no way to choose).

    Only a folder that exists is returned; a tag file naming anything else (a path out of the checkpoint, a
    file) is ignored, and its content is never shown.
    """
    folder = step.parent
    try:
        named = _tagged(folder)
        if named is not None:
            return named
        own = folder / f"{step.name}_universal"
        if own.is_dir() and not own.is_symlink():
            return own
        found = [p for p in folder.iterdir() if p.name.endswith("_universal") and p.is_dir() and not p.is_symlink()]
    except OSError:
        return None
    return found[0] if len(found) == 1 else None


def _tagged(folder: Path) -> Path | None:
    tag_file = folder / LATEST_UNIVERSAL
    if tag_file.is_symlink() or not tag_file.is_file():
        return None
    with open(tag_file, "rb") as f:
        raw = f.read(_TAG_BYTES + 1)
    try:
        tag = raw.decode().strip()
    except UnicodeDecodeError:
        return None
    if len(raw) > _TAG_BYTES or not tag or "/" in tag or tag in (".", ".."):
        return None
    try:
        path = inside(folder, tag, named_by=LATEST_UNIVERSAL)
    except SourceError:
        return None
    return path if path.is_dir() else None
