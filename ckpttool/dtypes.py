"""Element types by their safetensors names, the one spelling ckpttool uses in layouts and plans."""

from __future__ import annotations

import torch

from .errors import SourceError

#: safetensors dtype name -> torch dtype
TORCH_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
_NAMES: dict[torch.dtype, str] = {v: k for k, v in TORCH_DTYPES.items()}

#: spellings users type on the command line or find in configs -> safetensors name
_ALIASES = {
    "float64": "F64", "double": "F64", "fp64": "F64",
    "float32": "F32", "float": "F32", "fp32": "F32",
    "float16": "F16", "half": "F16", "fp16": "F16",
    "bfloat16": "BF16", "bf16": "BF16",
    "int64": "I64", "long": "I64", "int32": "I32", "int": "I32", "int16": "I16", "int8": "I8", "uint8": "U8",
    "bool": "BOOL", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2",
}


def dtype_name(value: str | torch.dtype) -> str:
    """Return the safetensors name of a dtype given as a torch dtype, a safetensors name or an alias.

    Raises:
        SourceError: the dtype is not one ckpttool can store.
    """
    if isinstance(value, torch.dtype):
        if value in _NAMES:
            return _NAMES[value]
        raise SourceError(f"dtype {value} cannot be stored in safetensors by ckpttool")
    text = str(value).strip()
    if text.startswith("torch."):
        text = text[len("torch."):]
    if text.upper() in TORCH_DTYPES:
        return text.upper()
    if text.lower() in _ALIASES:
        return _ALIASES[text.lower()]
    known = ", ".join(sorted(set(_ALIASES) | set(TORCH_DTYPES)))
    raise SourceError(f"unknown dtype {value!r}; known: {known}")


def itemsize(name: str) -> int:
    """Bytes per element of the dtype with this safetensors name."""
    return TORCH_DTYPES[name].itemsize


def torch_dtype(name: str) -> torch.dtype:
    return TORCH_DTYPES[name]


#: floating-point safetensors dtypes (the ones ``--dtype`` casts and the audit's dtype-mix check compares)
FLOAT_DTYPES = frozenset({"F64", "F32", "F16", "BF16"})
