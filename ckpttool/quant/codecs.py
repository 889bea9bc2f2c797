"""The computations a plan's computed target may name (:class:`~ckpttool.plan.plan.Dequantize`), in one table.

Every codec has the same calls, in this order, for rows ``start..stop`` of its target:

1. ``align(rows)``: the rows a chunk may hold (a multiple of the block rows where a row of blocks is needed whole);
2. ``stored_rows(start, stop)``: the rows of the source tensor it reads;
3. ``scale_rows(start, stop)``: the rows of the scale tensor it reads (decoders only; encoders compute scales);
4. ``decode(stored, scales, start, out, scratch)``: writes the target's rows into ``out``; an encoder returns how
   far the round trip is from the source (:class:`~ckpttool.quant.encode.RoundTrip`);
5. ``scratch_bytes(stored, scales, out_dtype)``: the largest each temporary gets, for the memory prediction.
"""

from __future__ import annotations

from functools import lru_cache

from ckpttool.quant.decode import Fp8Blocks, Mxfp4Groups, decoder
from ckpttool.quant.encode import Fp8Scales, Fp8Values, encoder
from ckpttool.quant.on_grid import GridInt, GridNvfp4, ReleaseRows, grid_encoder
from ckpttool.quant.pack_encode import IntRows, IntZeroPoints, Nvfp4Part, WeightShape, pack_encoder
from ckpttool.quant.packed_decode import Fp8Tensor, Nvfp4, PackedInt, packed_decoder

Codec = (Fp8Blocks | Mxfp4Groups | Fp8Values | Fp8Scales | PackedInt | Nvfp4 | IntRows | IntZeroPoints | WeightShape
         | Nvfp4Part | GridInt | GridNvfp4 | ReleaseRows | Fp8Tensor)


def codec(method: str, params: tuple[tuple[str, object], ...]) -> Codec:
    """The encoder or decoder ``method`` names, with ``params`` (e.g. the block size).

    Raises:
        ValueError: an unknown method (a bug: plans are made by :mod:`ckpttool.families`).
    """
    try:  # codecs are frozen and hold only their parameters: one object per (method, params), not one per chunk
        return _cached(method, params)
    except TypeError:  # parameters that cannot be hashed (a list for a block): made each time
        return _made(method, params)


def _made(method: str, params: tuple[tuple[str, object], ...]) -> Codec:
    found = encoder(method, params)
    if found is None:
        found = pack_encoder(method, dict(params))
    if found is None:
        found = grid_encoder(method, dict(params))
    if found is None:
        found = packed_decoder(method, dict(params))
    return found if found is not None else decoder(method, params)


_cached = lru_cache(maxsize=256)(_made)
