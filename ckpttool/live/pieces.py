"""What each rank of a live job holds, as plain data, and the plan every rank builds from everyone's pieces.

A DTensor's region of the global tensor comes from its placements, by torch's own
``compute_local_shape_and_global_offset`` (the rule torch itself places and redistributes live DTensors by; the
same arithmetic for checkpoint files is :mod:`ckpttool.layout.placements`, compared with torch's in its tests). A plain
tensor's region comes from its :class:`~ckpttool.io.sidecar.PieceSpec`, or it is taken whole (a replica).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ckpttool.model.architecture import model_info
from ckpttool.io.dtypes import cast_dtype, dtype_name
from ckpttool.layout.layout import Box, Layout, Piece
from ckpttool.layout.builder import LayoutBuilder
from ckpttool.plan.plan import Plan
from ckpttool.errors import ConfigError, SourceError
from ckpttool.families import reduced_layers
from ckpttool.families.source import plan_layout
from ckpttool.io.sidecar import PieceSpec


@dataclass(frozen=True, slots=True)
class Held:
    """One piece a rank holds, as exchanged between ranks (plain data)."""

    fqn: str
    global_shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    spec: PieceSpec | None


def describe_held(state: Mapping[str, Any], specs: Mapping[str, PieceSpec]) -> tuple[list[Held], dict[tuple[str, tuple[int, ...]], torch.Tensor], list[str]]:
    """This rank's pieces: what to tell the others, and the local tensors by ``(fqn, offsets)``."""
    held: list[Held] = []
    views: dict[tuple[str, tuple[int, ...]], torch.Tensor] = {}
    skipped = 0
    for fqn, value in state.items():
        if not isinstance(value, torch.Tensor):
            skipped += 1
            continue
        spec = specs.get(fqn)
        local, global_shape, offsets = _placement(fqn, value, spec)
        try:
            dtype = dtype_name(local.dtype)
        except SourceError as e:
            raise SourceError(f"'{fqn}': {e}") from None
        if not len(offsets) == local.dim() == len(global_shape) or any(
            o < 0 or o + s > n for o, s, n in zip(offsets, local.shape, global_shape)
        ):
            raise SourceError(
                f"'{fqn}': the local tensor of shape {list(local.shape)} at offsets {list(offsets)} does not fit "
                f"the global shape {list(global_shape)}"
            )
        if local.numel() == 0 and math.prod(global_shape) != 0:
            continue  # this rank's empty share of an unevenly split tensor: the others hold all of it
        held.append(Held(fqn, global_shape, dtype, offsets, tuple(local.shape), spec))
        views[(fqn, offsets)] = local.detach()
    notes = [f"skipped {skipped} entries that are not tensors"] if skipped else []
    return held, views, notes


def _placement(fqn: str, value: torch.Tensor, spec: PieceSpec | None) -> tuple[torch.Tensor, tuple[int, ...], tuple[int, ...]]:
    """The local tensor, the global shape and the local tensor's offsets in it."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without DTensor
        DTensor = ()  # noqa: N806
    if isinstance(value, DTensor):
        from torch.distributed.tensor._utils import (
            compute_local_shape_and_global_offset,
        )

        if any(p.is_partial() for p in value.placements):
            raise SourceError(f"'{fqn}': a DTensor with a Partial placement holds unreduced sums; redistribute it first")

        global_shape = tuple(value.shape)
        _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return value.to_local(), global_shape, tuple(int(o) for o in offsets)
    if spec is not None:
        return value, tuple(spec.global_shape), tuple(spec.offsets)
    return value, tuple(value.shape), tuple(0 for _ in value.shape)


def plan_gather(everyone: Sequence[list[Held]], config: dict[str, object] | None, dtype: str | None, notes: list[str],
                raw_names: bool = False) -> Plan:
    """The plan every rank builds from everyone's pieces: the offline merge's, with ranks for files.

    The family's transforms (torchtitan's Q/K rows from Meta's RoPE pairs to HF's halves, gpt-oss's Megatron-Core
    experts interleaved and transposed) are in that plan and applied by the merge's writer, as offline.

    Raises:
        ConfigError: as the offline merge refuses; and, without ``raw_names``, tensors named in a convention of
            their own (torchtitan, Megatron-Core, DeepSpeed MoE) with no config to map them: written as they are,
            transformers could load none of them (nor use torchtitan's Q/K rows, still in Meta's order).
        CoverageError: a tensor not covered exactly once.
    """
    builder = LayoutBuilder("", "live")
    for rank, held in enumerate(everyone):
        for h in held:
            spec = h.spec
            padding = spec.padding if spec is not None else ()
            fusion = spec.fusion if spec is not None else None
            if h.fqn not in builder.declared:
                builder.declare(h.fqn, h.global_shape, h.dtype, where=f"rank {rank}", padding=padding, fusion=fusion)
            elif not builder.declare(h.fqn, h.global_shape, h.dtype, where=f"rank {rank}", padding=padding, fusion=fusion):
                continue
            tags = (("rank", rank), *(spec.coordinates if spec is not None else ()))
            builder.add(h.fqn, Piece(_rank_file(rank), h.fqn, Box(h.offsets, h.sizes), h.dtype, tags=tags))
    layout: Layout = builder.build()
    info = model_info(config, label="config", reduce=reduced_layers) if config is not None else None
    planned = plan_layout(layout, config_path=None, config=config, model=info, dtype=cast_dtype(dtype), notes=notes,
                          no_config="no config given")
    planned.refuse()
    if planned.raw_names is not None and not raw_names:
        raise _raw_names_refusal(planned.raw_names, config)
    return planned.plan


def _raw_names_refusal(convention: str, config: dict[str, object] | None) -> ConfigError:
    """The live form of the merge's refusal of a convention's own names (no paths: the source is the job)."""
    why = "no config was given" if config is None else (
        f"transformers has no causal LM for the config's model_type {config.get('model_type')!r}")
    order = " and its Q/K rows in Meta's RoPE order" if convention == "torchtitan" else ""
    return ConfigError(
        f"the live tensors are named in the {convention} convention, not HuggingFace's, and {why}, so the gather "
        f"would write {convention} names{order}, which transformers cannot load. Pass config= (the HuggingFace "
        f"model's config: a transformers config, or the dict of its config.json) to write HuggingFace names, or "
        f"raw_names=True to keep the {convention} names")


def _rank_file(rank: int) -> str:
    return f"rank {rank}"


def rank_of(piece: Piece) -> int:
    """The rank holding a live piece (its ``file`` is ``"rank N"``: the ranks stand where files stand offline)."""
    return int(piece.file.removeprefix("rank "))

