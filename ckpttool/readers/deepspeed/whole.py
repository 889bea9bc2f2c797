"""DeepSpeed checkpoints whose tensors are saved whole, one file per layer or per parameter: the pipeline
layer files (``layer_XX-model_states.pt``, read for ``weights="module"``) and a universal checkpoint
(``ds_to_universal``'s ``zero/<param name>/fp32.pt``). No flat partition to reassemble: each tensor is one piece.
Finding a universal checkpoint beside a step that cannot be read is :mod:`.universal`'s.
"""

from __future__ import annotations

from pathlib import Path

from ckpttool.console.terminal import quoted
from ckpttool.io.paths import contained, list_inside
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import SourceError, SourceNotFoundError
from ckpttool.io.torch_save import StoredTensor
from ckpttool.readers.deepspeed.files import Scan, step_rel
from ckpttool.readers.deepspeed.pieces import whole_piece

#: the file of one parameter in a universal checkpoint
_UNIVERSAL_WEIGHT = "fp32.pt"

# ------------------------------------------------------------------------------------------------ pipeline

def read_layers(root: Path, step: Path, tag: str, layers: list[tuple[int, str]], builder: LayoutBuilder, *,
                 scan: Scan) -> None:
    """Module weights of a pipeline checkpoint: one state dict per layer file."""
    loaded = [(index, scan(root, step_rel(tag, name))) for index, name in layers]
    names: dict[str, list[str]] = {}
    for index, layer in loaded:
        if not isinstance(layer.obj, dict):
            raise SourceError(f"'{layer.rel}': not a state dict")
        for key in layer.obj:
            names.setdefault(key, []).append(layer.rel)
    # the layers' own names when they do not collide (the HF names, in a pipeline that wraps HF modules),
    # else '<layer index>.<name>' as the PipelineModule names its parameters
    unique = all(len(v) == 1 for v in names.values())
    for index, layer in loaded:
        for key, tensor in layer.obj.items():
            if not isinstance(tensor, StoredTensor):
                continue
            name = key if unique else f"{index}.{key}"
            if builder.declare(name, tensor.shape, tensor.dtype, where=f"'{layer.rel}'"):
                builder.add(name, whole_piece(layer.rel, key, tensor))
    builder.note(f"module weights from {len(loaded)} pipeline layer files"
                         + ("" if unique else " (names prefixed with the layer index: they collide)"))


# ------------------------------------------------------------------------------------------------ universal

def read_universal(root: Path, step: Path, tag: str, builder: LayoutBuilder, *, scan: Scan) -> None:
    """A universal checkpoint (``ds_to_universal``): ``zero/<param name>/fp32.pt`` holds the whole fp32
    parameter as ``{'param': tensor, ...}``.

    The folder names come from the file system: every message shows them escaped (:func:`quoted`), and every
    folder and file is reached through :mod:`ckpttool.io.paths` (no link out of ``root`` is followed)."""
    count = 0
    for directory in (p for p in list_inside(root, step_rel(tag, "zero")) if p.is_dir()):
        rel = step_rel(tag, f"zero/{directory.name}/{_UNIVERSAL_WEIGHT}")
        if not contained(root, rel).is_file():
            raise SourceNotFoundError(f"{quoted(rel)}: missing (the fp32 weights of {quoted(directory.name)})")
        loaded = scan(root, rel)
        tensor = loaded.obj.get("param") if isinstance(loaded.obj, dict) else loaded.obj
        if not isinstance(tensor, StoredTensor):
            raise SourceError(f"{quoted(rel)}: no 'param' tensor")
        if builder.declare(directory.name, tensor.shape, tensor.dtype, where=quoted(rel)):
            builder.add(directory.name, whole_piece(rel, "param", tensor))
            count += 1
    if not count:
        raise SourceError(f"'{step_rel(tag, 'zero')}': no parameter directories")
    builder.set_parallel(tp=1, pp=1, dp=1)
    builder.note(f"universal checkpoint: {count} fp32 parameters from zero/<name>/fp32.pt")
