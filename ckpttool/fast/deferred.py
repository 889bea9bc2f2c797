"""torch, imported when a tensor is first touched rather than when a module that handles tensors is imported.

Importing torch takes a second or more, and ``merge --dry-run`` and ``audit --no-data`` of a safetensors source
read only headers: they import the executor, the codecs and the data checks (which name torch in their function
bodies) but never call them. Those modules write ``from ..deferred import torch`` instead of ``import torch``:
the name is a stand-in module that imports torch on its first attribute read and keeps each attribute it hands
out, so later reads are plain attribute reads. Code that runs at import time must not read an attribute of it
(a module-level ``torch.float32`` would import torch at once; ``tests/test_torch_free.py`` catches that). An
attribute is kept once read: a test that replaces one of torch's functions must patch this stand-in's.

Stdlib only.
"""

from __future__ import annotations

import importlib
import types
from typing import TYPE_CHECKING, Any


class _Deferred(types.ModuleType):
    """A module imported on its first attribute read; ``repr`` says whether it has been."""

    def __getattr__(self, name: str) -> Any:
        value = getattr(importlib.import_module(self.__name__), name)
        setattr(self, name, value)
        return value


if TYPE_CHECKING:
    import torch
else:
    torch = _Deferred("torch")
