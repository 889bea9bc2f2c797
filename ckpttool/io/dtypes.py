"""Element types by their safetensors names, the one spelling ckpttool uses in layouts and plans.

Stdlib only: torch is imported when a torch dtype is asked for (:func:`torch_dtype`), so planning from headers
(``merge --dry-run``, ``audit --no-data``) runs without it.
"""

from __future__ import annotations

import functools
import sys
from collections import Counter
from collections.abc import Iterable
from typing import TYPE_CHECKING

from ckpttool.errors import ArgumentError, SourceError

if TYPE_CHECKING:
    import torch

#: safetensors dtype name -> (the name of its torch dtype, bytes per element)
_TORCH_NAMES: dict[str, tuple[str, int]] = {
    "F64": ("float64", 8),
    "F32": ("float32", 4),
    "F16": ("float16", 2),
    "BF16": ("bfloat16", 2),
    "I64": ("int64", 8),
    "I32": ("int32", 4),
    "I16": ("int16", 2),
    "I8": ("int8", 1),
    "U8": ("uint8", 1),
    "BOOL": ("bool", 1),
    "F8_E4M3": ("float8_e4m3fn", 1),
    "F8_E5M2": ("float8_e5m2", 1),
    "F8_E8M0": ("float8_e8m0fnu", 1),  # power-of-two scales (OCP MX E8M0; 0xFF is NaN)
}
#: the safetensors dtype names ckpttool stores
SAFETENSORS_DTYPES = frozenset(_TORCH_NAMES)
#: bytes per element by safetensors dtype name (what :func:`itemsize` answers, for loops over 90k tensors)
ITEMSIZES: dict[str, int] = {name: size for name, (_, size) in _TORCH_NAMES.items()}


def _loaded_torch_dtype(value: object) -> bool:
    """Whether ``value`` is a torch dtype: it can be one only once torch is imported, so this never imports it."""
    torch_module = sys.modules.get("torch")
    return torch_module is not None and isinstance(value, torch_module.dtype)


@functools.cache
def _names() -> dict[torch.dtype, str]:
    return {torch_dtype(name): name for name in _TORCH_NAMES}


#: spellings users type on the command line or find in configs -> safetensors name
_ALIASES = {
    "float64": "F64", "double": "F64", "fp64": "F64",
    "float32": "F32", "float": "F32", "fp32": "F32",
    "float16": "F16", "half": "F16", "fp16": "F16",
    "bfloat16": "BF16", "bf16": "BF16",
    "int64": "I64", "long": "I64", "int32": "I32", "int": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
    "float8_e8m0fnu": "F8_E8M0",
}


def dtype_name(value: str | torch.dtype) -> str:
    """Return the safetensors name of a dtype given as a torch dtype, a safetensors name or an alias.

    Raises:
        SourceError: the dtype is not one ckpttool can store.
    """
    if _loaded_torch_dtype(value):
        if value in _names():
            return _names()[value]
        raise SourceError(f"dtype {value} cannot be stored in safetensors by ckpttool")
    text = str(value).strip()
    if text.startswith("torch."):
        text = text[len("torch."):]
    if text.upper() in _TORCH_NAMES:
        return text.upper()
    if text.lower() in _ALIASES:
        return _ALIASES[text.lower()]
    known = ", ".join(sorted(set(_ALIASES) | set(_TORCH_NAMES)))
    raise SourceError(f"unknown dtype {value!r}; known: {known}")


#: what ``merge(dtype=...)``, ``save_hf(dtype=...)`` and ``--dtype`` cast floating-point tensors to, by the names
#: a user gives (lower case; ``torch.`` may precede them); the last three are aliases of the first three
CAST_DTYPES: dict[str, str] = {
    "bfloat16": "BF16", "float16": "F16", "float32": "F32", "bf16": "BF16", "fp16": "F16", "fp32": "F32",
}


def cast_dtype(value: str | torch.dtype | None) -> str | None:
    """The safetensors name of the dtype to cast floating-point tensors to, or None to keep the source's.

    Only bfloat16, float16 and float32: a cast to an integer type would turn every weight into zeros, and
    float8 needs scales that a plain cast does not compute, so both are refused rather than written.

    Raises:
        ArgumentError: ``value`` is not one of :data:`CAST_DTYPES` (or the torch dtype of one).
    """
    if value is None:
        return None
    if _loaded_torch_dtype(value):
        text = str(value).removeprefix("torch.")
    else:
        text = str(value).strip().lower().removeprefix("torch.")
    if text in CAST_DTYPES:
        return CAST_DTYPES[text]
    raise ArgumentError(
        f"dtype={value!r} is not a dtype ckpttool casts to: choose bfloat16, float16 or float32 (aliases bf16, "
        "fp16, fp32), or dtype=None to keep the source's dtypes; integer tensors are never cast"
    )


def prevailing_float(dtypes: Iterable[str]) -> str | None:
    """The floating-point dtype most tensors have (safetensors names, one per tensor), or None when none is
    floating: what a config's ``dtype`` must say, as transformers loads every weight in it."""
    counts = Counter(d for d in dtypes if d in FLOAT_DTYPES)
    return counts.most_common(1)[0][0] if counts else None


def itemsize(name: str) -> int:
    """Bytes per element of the dtype with this safetensors name."""
    return ITEMSIZES[name]


def torch_dtype_name(name: str) -> str:
    """The name of the torch dtype of this safetensors name (``"BF16"`` -> ``"bfloat16"``: ``torch.bfloat16``),
    without importing torch (what a pickle naming the dtype needs)."""
    return _TORCH_NAMES[name][0]


@functools.cache
def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of this safetensors name (imports torch)."""
    import torch

    return getattr(torch, _TORCH_NAMES[name][0])


#: floating-point safetensors dtypes (the ones ``--dtype`` casts and the audit's dtype-mix check compares)
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
