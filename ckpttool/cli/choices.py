"""The names the command line offers as choices (``--format``, ``split --to``), without importing what they name.

The readers and writers import torch; ``ckpttool --help`` must not (a second or more). These tuples repeat the
names of :data:`ckpttool.readers.READERS` and :data:`ckpttool.commands.split.TARGETS`, and ``tests/test_startup.py``
checks that they agree, so adding a reader or a split target without naming it here fails a test.

Stdlib only.
"""

from __future__ import annotations

#: reader names, in the detection order of :data:`ckpttool.readers.READERS`
FORMAT_NAMES = (
    "sidecar", "deepspeed", "verl", "colossalai", "megatron-dist", "megatron-legacy", "lightning", "dcp", "hf-distributed",
    "hf",
)
#: what ``split --to`` writes: :data:`ckpttool.commands.split.TARGETS`
SPLIT_TARGETS = ("dcp", "megatron")
#: the names ``split --to dcp --names`` writes: :data:`ckpttool.commands.split_dcp.NAMES`
SPLIT_NAMES = ("hf", "torchtitan", "torchtitan-0.2")
