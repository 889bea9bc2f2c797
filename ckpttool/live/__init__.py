"""Live gather: the final HuggingFace checkpoint written straight from a running TP/PP/EP/FSDP job.

Every rank of the job calls :func:`save_hf`. What each rank holds becomes the pieces of one layout: a DTensor's
placements (``Shard``, ``Replicate``, ``_StridedShard``) give its region of the global tensor, and plain local
tensors come with a :class:`~ckpttool.io.sidecar.PieceSpec` (partition, global shape, padding to strip, expert
ids, stage), the sidecar's vocabulary. The ranks exchange these descriptions (metadata only) and each builds
the same coverage-checked plan the offline merge builds, so a missing piece stops every rank with the same
message before a byte moves, and the output is the offline merge's, byte for byte.

FP8 weights travel as bytes beside their scales (gloo's collectives refuse float8; point-to-point sends do not care),
and a piece of an FP8 weight that does not start on a block boundary of the config's ``weight_block_size`` stops
every rank with the offline merge's message, naming the tensor, the split and the block size.

Output files are shared out among the ranks by bytes. Each writer gathers the pieces of its own tensors,
bucket by bucket, with point-to-point sends from the ranks that hold them (uneven pieces need no padding;
gloo's all_gather could not take them) and streams them to disk with the merge's writer while the next
bucket arrives. At most two buckets are alive per rank: peak extra memory is about ``bucket_bytes`` plus one
tensor larger than half a bucket. On GPU, data travels on the job's NCCL group, and each bucket is copied to
a pinned host arena on a side stream, so the copy of bucket k+1 overlaps the disk write of bucket k.

Rank 0 writes the index, config and audit once every file is written and checked, then renames the staging
directory into place. A rank that dies or never arrives makes the others stop within ``timeout`` seconds
with an error naming it; the destination never holds a partial checkpoint.

The package: this module (:func:`save_hf`, its steps in order), ``pieces`` (what each rank holds, the plan),
``gather`` (the rounds of buckets, their memory, the writing) and ``watch`` (heartbeats, the error naming the
rank that went silent).
"""

from __future__ import annotations

import importlib
import itertools
import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpttool.families import reduced_layers
from ckpttool.model.architecture import model_info
from ckpttool.execute.distributed import Group, share_out
from ckpttool.io.dtypes import cast_dtype
from ckpttool.plan.plan import Plan
from ckpttool.errors import ConfigError
from ckpttool.findings import Report
from ckpttool.commands.finish import finish_output
from ckpttool.io.sidecar import PieceSpec
from ckpttool.writers.staging import Staging
from ckpttool.writers.files import OutputFile
from ckpttool.writers.hf import assign_files
from ckpttool.live.gather import Gather
from ckpttool.live.pieces import describe_held, Held, plan_gather
from ckpttool.live.watch import WATCH_SECONDS, LiveGatherError, collect, Watch

__all__ = ["BUCKET_BYTES", "TIMEOUT", "WATCH_SECONDS", "LiveGatherError", "LiveResult", "save_hf"]

#: default bytes of gathered tensors a rank holds at once (two buckets of half this)
BUCKET_BYTES = 512 * 2**20
#: default seconds a rank waits for the others at any step
TIMEOUT = 600.0

log = logging.getLogger(__name__)
_calls = itertools.count()  # every rank calls save_hf in the same order: the n-th call is the same save


@dataclass(frozen=True, slots=True)
class LiveResult:
    """What :func:`save_hf` wrote; the same on every rank."""

    output: str
    plan: Plan
    files: tuple[OutputFile, ...]
    writers: dict[str, int]
    extras: tuple[str, ...]
    audit: Report | None


def save_hf(
    model_or_state_dict: torch.nn.Module | Mapping[str, torch.Tensor],
    out_dir: str | Path,
    *,
    config: Any = None,
    specs: Mapping[str, PieceSpec] | None = None,
    max_shard_size: str | int = "5GB",
    dtype: str | None = None,
    bucket_bytes: int = BUCKET_BYTES,
    timeout: float = TIMEOUT,
    force: bool = False,
    audit: bool = True,
    raw_names: bool = False,
) -> LiveResult:
    """Write a HuggingFace safetensors checkpoint of a model sharded over the ranks of a running job.

    Call on every rank of the default process group, with the same arguments. Returns on every rank once the
    checkpoint is written, checked and in place.

    Args:
        model_or_state_dict: a module (its ``state_dict()``; DTensor parameters carry their layout) or a state
            dict of this rank's tensors (DTensors, or plain tensors described by ``specs``).
        out_dir: the destination directory; must not exist or be empty unless ``force``.
        config: the model's config (a transformers ``PretrainedConfig``, a dict, or None): tensors get the
            on-disk HuggingFace names of its architecture and are checked against it, and ``config.json`` is
            written. Without one, names are kept as they are.
        specs: for plain (non-DTensor) tensors, where this rank's tensor sits in the global one, by name. A
            plain tensor without a spec is taken as whole (a replica).
        max_shard_size: largest output file (``"5GB"``, bytes); files are shared out among the ranks.
        dtype: cast floating-point tensors to ``"bfloat16"``, ``"float16"`` or ``"float32"`` (aliases ``"bf16"``,
            ``"fp16"``, ``"fp32"``); integer tensors are never cast; ``config.json`` names the dtype written. FP8
            weights (with their ``weight_scale_inv`` and a config whose ``quantization_config`` gives the block
            size) are dequantized, as ``ckpttool merge --dtype`` does; without ``dtype`` they are written as they
            are, scales beside them, and ``config.json`` keeps the ``quantization_config``.
        bucket_bytes: gathered bytes a rank holds at once, in two buckets (one written while the next arrives).
        timeout: seconds any rank waits for another before all of them give up.
        force: replace a non-empty destination.
        audit: audit what was written and refuse to publish on errors (as ``ckpttool merge`` does).
        raw_names: with no config to map them, write tensors named in a framework's own convention (torchtitan,
            Megatron-Core, DeepSpeed MoE) under those names, unchanged (transformers loads none of them); without
            it such a save is refused, as ``ckpttool merge`` refuses it. With a config, the family's names and
            transforms apply (torchtitan's Q/K rows permuted to HF's RoPE halves, gpt-oss's Megatron-Core experts
            interleaved and transposed), exactly as the offline merge applies them.

    Raises:
        CoverageError: the ranks' pieces do not cover every tensor exactly once (the same message on every rank).
        ConfigError: the tensors do not match the config, or (without ``raw_names``) are named in a convention of
            their own and no config maps them.
        LiveGatherError: a rank failed, died or did not arrive within ``timeout``; it is named.
        ArgumentError: ``dtype`` is not one ckpttool casts to.

    Example:
        >>> save_hf(model, "out/hf", config=model.config)  # doctest: +SKIP
    """
    dest = Path(out_dir)
    cast_dtype(dtype)  # every rank refuses a bad dtype= alike, before any collective
    call = next(_calls)
    state = model_or_state_dict.state_dict() if isinstance(model_or_state_dict, torch.nn.Module) else model_or_state_dict
    config_dict = _config_dict(config)
    watch = Watch(call)
    try:
        group = Group(timeout=timeout)
    except Exception as e:  # the gloo group is built by all ranks together: one did not arrive
        watch.stop()
        raise watch.failure("start the save together", e) from None
    staging: Staging | None = None
    try:
        local: dict[str, Any] = {}

        def describe() -> list[Held]:  # a rank's bad tensor stops every rank with its message
            held, local["views"], local["notes"] = describe_held(state, specs or {})
            return held

        everyone = collect(group, watch, "exchange what each rank holds", describe)
        # every rank builds the same plan from the same pieces: what travels is only whether it could (the plans
        # themselves, pickled to every rank, were ~0.25 s of CPU on each rank at 75 tensors, more with more)
        planned: list[Plan] = []
        collect(group, watch, "plan", lambda: planned.append(plan_gather(everyone, config_dict, dtype, local["notes"], raw_names)))
        plan = planned[0]
        files = tuple(assign_files(plan, max_shard_size))
        owner = share_out([f.nbytes for f in files], group.world)
        staging = Staging(dest, force=force)

        def enter() -> str:
            return str(staging.open())

        path = Path(collect(group, watch, "prepare the destination", enter, rank0=True)[0])
        mine = [f for f, rank in zip(files, owner) if rank == group.rank]
        if audit and group.rank == 0:  # the audit's modules load while the tensors travel, not after
            threading.Thread(target=_load_audit, daemon=True).start()
        gather = Gather(plan, files, owner, group, local["views"], bucket_bytes)
        log.info("live gather: %d tensors, %d bytes, %d files, %d rounds", len(plan.targets), plan.nbytes,
                 len(files), len(gather.rounds))
        collect(group, watch, "gather and write the tensors", lambda: gather.run(mine, path))
        info = model_info(config_dict, label="config", reduce=reduced_layers) if config_dict is not None else None
        extras, report = collect(group, watch, "publish the checkpoint", lambda: finish_output(
            staging, plan, files, config=config_dict, model=info, config_label="config" if config_dict else None,
            search=[], dtype=dtype, audit=audit,
        ), rank0=True)[0]
    except BaseException as e:
        if group.rank == 0 and staging is not None:
            staging.abandon(e)
        raise
    finally:
        watch.stop()
        group.close()
    writers = {f.name: rank for f, rank in zip(files, owner)}
    return LiveResult(str(dest), plan, files, writers, tuple(extras), report)


def _load_audit() -> None:
    """Import the audit's modules (0.3 s of CPU, more on a busy machine) ahead of the publish that uses them; an
    import that fails here fails again, and is reported, where the publish imports it."""
    try:
        importlib.import_module("ckpttool.audit.causes")
    except Exception:  # noqa: BLE001 (raised again by the publish's own import)
        pass


def _config_dict(config: Any) -> dict[str, object] | None:
    if config is None:
        return None
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        raise ConfigError(f"config: expected a transformers config or a dict, got {type(config).__name__}")
    return dict(to_dict())

