"""A pickle's stand-in (``Record``) keeps the attributes the pickle sets, but never lets them replace ``_args``, its
own record of the positional arguments it was called with; an object the pickle made without calling it has none.
Found by tests/test_fuzz_readers.py: a Megatron ``args`` value whose state named ``_args`` (or an enum stand-in
built by NEWOBJ alone) crashed the reader with a TypeError / AttributeError instead of reading or refusing it."""

from __future__ import annotations

from ckpttool.io.safe_pickle import Record
from ckpttool.readers.megatron.allow import Opaque


def test_a_state_naming_args_does_not_replace_them():
    record = Record(7)
    record.__setstate__({"_args": Record(), "lr": 0.1})
    assert record._args == (7,) and record.lr == 0.1
    record.__setstate__(({"_args": "x", "seed": 3}, None))  # (dict state, slots state)
    assert record._args == (7,) and record.seed == 3


def test_an_opaque_value_made_without_a_call_has_no_value():
    made = Opaque.__new__(Opaque)
    made.__setstate__({"_args": Record()})
    assert made._args == () and made.value is None
    assert Opaque("bf16").value == "bf16"

