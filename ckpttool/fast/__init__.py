"""The speed tricks, gathered in one place, each kept because a benchmark showed what it buys.

- :mod:`.frozen`: frozen dataclasses built in half the time (layouts and plans of 90k tensors are built in well
  under a second: ``benchmarks/many_tensors_bench.py``).
- :mod:`.jsontext`: ``--json`` documents written as text, exactly as ``json.dumps(indent=2)`` would write them.
- :mod:`.deferred`: torch imported when a tensor is first touched, so ``ckpttool --help`` and a dry run start
  without it (``tests/test_startup.py``, ``tests/test_torch_free.py``).
- :mod:`.crc`: CRC-32 through libdeflate where the system has it, zlib's values 3x faster (every DCP item and
  every digest token is CRC'd: ``benchmarks/split_bench.py``; ``tests/test_split_speed.py``).

Everything else reads plainly; code elsewhere uses these and does not repeat them.
"""
