"""Rows of the embedding and head beyond the tokenizer that are copies of real rows, not padding.

A vocab padded for tensor parallelism or for speed (``make_vocab_size_divisible_by``) has rows no token id
reaches. Padding holds zeros or values of its own; a row that repeats a real token's row byte for byte is no
padding: the rows were put together from the wrong pieces (a shard's rows tiled, a resize that copied rows), so
the real rows may be wrong too, and a head with such rows gives untokenisable ids the same logits as real tokens.
Rows are hashed one by one in the executor's streamed chunks (16 bytes a row kept, never the tensor).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

from ckpttool.fast.deferred import torch
from ckpttool.io.dtypes import torch_dtype
from ckpttool.plan.plan import Plan, Target
from ckpttool.findings import Finding, finding
from ckpttool.audit.stats import fold

#: names of the embedding and output layers (and an MTP layer's copies of them) whose rows are token ids
VOCAB_TENSORS = ("embed_tokens.weight", "lm_head.weight", "shared_head.head.weight", "wte.weight")
#: copied rows named in a message
_SHOWN = 3


def copied_row_findings(plan: Plan, tokens: int) -> list[Finding]:
    """A ``vocab-rows-copied`` finding for each vocab tensor whose rows past ``tokens`` repeat real rows."""
    targets = tuple(t for t in plan.targets
                    if t.name.endswith(VOCAB_TENSORS) and len(t.shape) == 2 and t.shape[0] > tokens)
    if not targets:
        return []
    found = []
    for target, digests in zip(targets, fold(replace(plan, targets=targets), _RowDigests)):
        zero = hashlib.blake2b(bytes(_row_bytes(target)), digest_size=16).digest()
        real: dict[bytes, int] = {}
        for row, digest in enumerate(digests[:tokens]):
            if digest != zero:
                real.setdefault(digest, row)
        copies = [(row, real[d]) for row, d in enumerate(digests[tokens:], start=tokens) if d in real]
        if not copies:
            continue
        shown = ", ".join(f"row {row} = row {of}" for row, of in copies[:_SHOWN])
        found.append(finding(
            "vocab-rows-copied",
            f"'{target.name}': {len(copies)} of the {target.shape[0] - tokens} rows past the tokenizer's {tokens} "
            f"token ids repeat real rows ({shown}{', ...' if len(copies) > _SHOWN else ''}): not padding; were "
            "the rows assembled from the wrong pieces?",
            tensor=target.name, detail=(("cause", f"rows past the tokenizer's {tokens} token ids copy real rows"),),
        ))
    return found


def _row_bytes(target: Target) -> int:
    return math.prod(target.shape[1:]) * torch.empty(0, dtype=torch_dtype(target.dtype)).element_size()


class _RowDigests:
    """A 16-byte blake2b digest of each row of the target, from its chunks in C order."""

    def __init__(self, target: Target) -> None:
        self._width = _row_bytes(target)
        self._pending = b""
        self._digests: list[bytes] = []

    def add(self, chunk: torch.Tensor) -> None:
        data = self._pending + chunk.reshape(-1).view(torch.uint8).numpy().tobytes()
        whole = len(data) - len(data) % self._width
        self._digests.extend(hashlib.blake2b(data[i:i + self._width], digest_size=16).digest()
                             for i in range(0, whole, self._width))
        self._pending = data[whole:]

    def result(self) -> list[bytes]:
        return self._digests
