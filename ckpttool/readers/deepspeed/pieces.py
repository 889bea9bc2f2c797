"""How DeepSpeed's whole tensors become layout pieces, shared by every variant of the reader.

A tensor saved whole (in the module state dict, a pipeline layer file, a frozen parameter, a universal
``fp32.pt``) is one RAW piece at its byte offset; pipeline names lose their layer index when asked; and
:class:`SharingBuilder` remembers the pieces it was given, so a shared (tied) parameter can be written from its owner's.
The flat fp32 partitions of ZeRO are cut in :mod:`.zero`.
"""

from __future__ import annotations

from typing import Any

from ckpttool.io.dtypes import itemsize
from ckpttool.layout.layout import RAW, Box, Piece
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.errors import SourceError
from ckpttool.io.torch_save import StoredTensor
from ckpttool.readers.validate import expect
from ckpttool.readers.deepspeed.files import Loaded


def whole_piece(rel: str, key: str, tensor: StoredTensor) -> Piece:
    """A tensor saved whole at ``key`` of ``rel`` as one RAW piece at its byte offset."""
    offset = tensor.required_offset(rel, key)
    return Piece(rel, key, Box.whole(tensor.shape), tensor.dtype, RAW, offset, tensor.numel * itemsize(tensor.dtype))


def add_module(state: Loaded, builder: LayoutBuilder, names: set[str] | None, why: str,
                strip_layer: bool = False) -> None:
    """Tensors of the module state dict (all of them, or ``names``) as whole pieces."""
    module = state.obj.get("module")
    if not isinstance(module, dict):
        raise SourceError(f"'{state.rel}': no 'module' state dict ({why})")
    for key, tensor in module.items():
        if names is not None and key not in names:
            continue
        if not isinstance(tensor, StoredTensor):
            continue
        key = expect(key, str, "module: a tensor name", state.rel)
        name = strip_layer_index(key) if strip_layer else key
        if builder.declare(name, tensor.shape, tensor.dtype, where=f"'{state.rel}'"):
            builder.add(name, whole_piece(state.rel, f"module.{key}", tensor))


def strip_layer_index(name: str) -> str:
    """A pipeline parameter's name less its layer index ('3.model.norm.weight' -> 'model.norm.weight')."""
    head, _, rest = name.partition(".")
    return rest if head.isdigit() and rest else name


class SharingBuilder(LayoutBuilder):
    """A layout builder that remembers what it was given, so a shared parameter can reuse its owner's pieces."""

    def __init__(self, root: str, fmt: str) -> None:
        super().__init__(root, fmt)
        self.given: dict[str, list[tuple[Piece, bool]]] = {}
        self.shapes: dict[str, tuple[int, ...]] = {}

    def declare(self, fqn: str, global_shape: Any, dtype: str, **kwargs: Any) -> bool:  # type: ignore[override]
        ok = super().declare(fqn, global_shape, dtype, **kwargs)
        if ok:
            self.shapes.setdefault(fqn, tuple(global_shape))
        return ok

    def add(self, fqn: str, piece: Piece, *, present: bool = True) -> None:
        self.given.setdefault(fqn, []).append((piece, present))
        super().add(fqn, piece, present=present)


def add_shared(state: Loaded, builder: SharingBuilder) -> None:
    """Declare each tied parameter of ``shared_params`` with its owner's pieces, with a note."""
    shared = state.obj.get("shared_params") or {}
    if not isinstance(shared, dict):
        return
    declared = set(builder.declared)
    for alias, owner in shared.items():
        expect(alias, str, "shared_params: a parameter name", state.rel)
        expect(owner, str, f"shared_params: the owner of '{alias}'", state.rel)
        if alias in declared or owner not in declared:
            continue
        builder.note(f"'{alias}' is shared with '{owner}' (shared_params): written with the same weights")
        if builder.declare(alias, builder.shapes[owner], builder.dtype_of(owner), where=f"'{state.rel}' shared_params"):
            for piece, present in list(builder.given.get(owner, ())):
                builder.add(alias, piece, present=present)
