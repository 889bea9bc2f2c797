"""Live gather: the final HuggingFace checkpoint written straight from a running TP/PP/EP/FSDP job.

Every rank of the job calls :func:`save_hf`. What each rank holds becomes the pieces of one layout: a DTensor's
placements (``Shard``, ``Replicate``, ``_StridedShard``) give its region of the global tensor, and plain local
tensors come with a :class:`~ckpttool.sidecar.PieceSpec` (partition, global shape, padding to strip, expert
ids, stage), the sidecar's vocabulary. The ranks exchange these descriptions (metadata only) and each builds
the same coverage-checked plan the offline merge builds, so a missing piece stops every rank with the same
message before a byte moves, and the output is the offline merge's, byte for byte.

Output files are shared out among the ranks by bytes. Each writer gathers the pieces of its own tensors,
bucket by bucket, with point-to-point sends from the ranks that hold them (uneven pieces need no padding;
gloo's all_gather could not take them) and streams them to disk with the merge's writer while the next
bucket arrives. At most two buckets are alive per rank: peak extra memory is about ``bucket_bytes`` plus one
tensor larger than half a bucket. On GPU, data travels on the job's NCCL group, and each bucket is copied to
a pinned host arena on a side stream, so the copy of bucket k+1 overlaps the disk write of bucket k.

Rank 0 writes the index, config and audit once every file is written and checked, then renames the staging
directory into place. A rank that dies or never arrives makes the others stop within ``timeout`` seconds
with an error naming it; the destination never holds a partial checkpoint.
"""

from __future__ import annotations

import itertools
import logging
import math
import re
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .distributed import Group, ProcessGroupError, share_out
from .dtypes import cast_dtype, dtype_name, itemsize, torch_dtype
from .errors import CkptError, ConfigError, SourceError
from .findings import Report
from .layout import Box, Layout, LayoutBuilder, Piece
from .merge import finish_output
from .models import hf_specs, model_info
from .plan import Copy, Plan, Target, identity_specs, plan_merge
from .sidecar import PieceSpec
from .stream import Reader, buffer_sizes, write_file
from .destination import Staging
from .writer import OutputFile, assign_files, check_written, file_layout

#: default bytes of gathered tensors a rank holds at once (two buckets of half this)
BUCKET_BYTES = 512 * 2**20
#: default seconds a rank waits for the others at any step
TIMEOUT = 600.0
#: how long the ranks that noticed a failure watch the others' heartbeats before naming the silent ones
WATCH_SECONDS = 3.0

log = logging.getLogger(__name__)
_calls = itertools.count()  # every rank calls save_hf in the same order: the n-th call is the same save


class LiveGatherError(CkptError):
    """The live gather could not finish: a rank failed, died or never arrived; nothing was published."""


@dataclass(frozen=True, slots=True)
class LiveResult:
    """What :func:`save_hf` wrote; the same on every rank."""

    output: str
    plan: Plan
    files: tuple[OutputFile, ...]
    writers: dict[str, int]
    extras: tuple[str, ...]
    audit: Report | None


@dataclass(frozen=True, slots=True)
class _Held:
    """One piece a rank holds, as exchanged between ranks (plain data)."""

    fqn: str
    global_shape: tuple[int, ...]
    dtype: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    spec: PieceSpec | None


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
            ``"fp16"``, ``"fp32"``); integer tensors are never cast; ``config.json`` names the dtype written.
        bucket_bytes: gathered bytes a rank holds at once, in two buckets (one written while the next arrives).
        timeout: seconds any rank waits for another before all of them give up.
        force: replace a non-empty destination.
        audit: audit what was written and refuse to publish on errors (as ``ckpttool merge`` does).

    Raises:
        CoverageError: the ranks' pieces do not cover every tensor exactly once (the same message on every rank).
        ConfigError: the tensors do not match the config.
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
    watch = _Watch(call)
    try:
        group = Group(timeout=timeout)
    except Exception as e:  # the gloo group is built by all ranks together: one did not arrive
        watch.stop()
        raise watch.failure("start the save together", e) from None
    staging: Staging | None = None
    try:
        local: dict[str, Any] = {}

        def describe() -> list[_Held]:  # a rank's bad tensor stops every rank with its message
            held, local["views"], local["notes"] = _describe(state, specs or {})
            return held

        everyone = _collect(group, watch, "exchange what each rank holds", describe)
        plan = _collect(group, watch, "plan", lambda: _plan(everyone, config_dict, dtype, local["notes"]))[group.rank]
        files = tuple(assign_files(plan, max_shard_size))
        owner = share_out([f.nbytes for f in files], group.world)
        staging = Staging(dest, force=force)

        def enter() -> str:
            return str(staging.open())

        path = Path(_collect(group, watch, "prepare the destination", enter, rank0=True)[0])
        mine = [f for f, rank in zip(files, owner) if rank == group.rank]
        gather = _Gather(plan, files, owner, group, local["views"], bucket_bytes)
        log.info("live gather: %d tensors, %d bytes, %d files, %d rounds", len(plan.targets), plan.nbytes,
                 len(files), len(gather.rounds))
        _collect(group, watch, "gather and write the tensors", lambda: gather.run(mine, path))
        info = model_info(config_dict, label="config") if config_dict is not None else None
        extras, report = _collect(group, watch, "publish the checkpoint", lambda: finish_output(
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


def _config_dict(config: Any) -> dict[str, object] | None:
    if config is None:
        return None
    if isinstance(config, Mapping):
        return dict(config)
    to_dict = getattr(config, "to_dict", None)
    if to_dict is None:
        raise ConfigError(f"config: expected a transformers config or a dict, got {type(config).__name__}")
    return dict(to_dict())


def _describe(state: Mapping[str, Any], specs: Mapping[str, PieceSpec]) -> tuple[list[_Held], dict[tuple[str, tuple[int, ...]], torch.Tensor], list[str]]:
    """This rank's pieces: what to tell the others, and the local tensors by ``(fqn, offsets)``."""
    held: list[_Held] = []
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
        if local.numel() == 0:
            continue
        held.append(_Held(fqn, global_shape, dtype, offsets, tuple(local.shape), spec))
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
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        if any(p.is_partial() for p in value.placements):
            raise SourceError(f"'{fqn}': a DTensor with a Partial placement holds unreduced sums; redistribute it first")

        global_shape = tuple(value.shape)
        _, offsets = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
        return value.to_local(), global_shape, tuple(int(o) for o in offsets)
    if spec is not None:
        return value, tuple(spec.global_shape), tuple(spec.offsets)
    return value, tuple(value.shape), tuple(0 for _ in value.shape)


def _plan(everyone: Sequence[list[_Held]], config: dict[str, object] | None, dtype: str | None, notes: list[str]) -> Plan:
    """The plan every rank builds from everyone's pieces: the offline merge's, with ranks for files."""
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
    info = model_info(config, label="config") if config is not None else None
    if info is None:
        specs = identity_specs(layout)
        notes = [*notes, "no config: tensor names kept as the model has them"]
    else:
        specs, found = hf_specs(layout, info)
        notes = [*notes, *found]
    specs = sorted(specs, key=lambda s: [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", s.name)])
    return plan_merge(layout, specs, dtype=cast_dtype(dtype), notes=notes)


def _rank_file(rank: int) -> str:
    return f"rank {rank}"


def _rank_of(piece: Piece) -> int:
    return int(piece.file.removeprefix("rank "))


class _Gather:
    """Moves every writer's tensors to it, bucket by bucket, and writes its files while the next bucket arrives."""

    def __init__(self, plan: Plan, files: Sequence[OutputFile], owner: Sequence[int], group: Group,
                 views: Mapping[tuple[str, tuple[int, ...]], torch.Tensor], bucket_bytes: int) -> None:
        self.group = group
        self.views = views
        self.rank = group.rank
        self.device = _data_device(views)
        by_writer: dict[int, list[Target]] = {}
        for out, rank in zip(files, owner):
            by_writer.setdefault(rank, []).extend(out.targets)
        half = max(1, bucket_bytes // 2)
        self.rounds = _rounds({w: _buckets(ts, half) for w, ts in by_writer.items()})
        self.arena_bytes = max((_bucket_bytes(b) for r in self.rounds for b in r.values()), default=0)
        # each message of a round has its own tag: the writer's running count of copies before it
        self.tags: list[dict[int, int]] = []
        sent = Counter[int]()
        for buckets in self.rounds:
            self.tags.append({w: sent[w] for w in buckets})
            for w, targets in buckets.items():
                sent[w] += sum(1 for _ in _copies(targets))

    def run(self, mine: Sequence[OutputFile], directory: Path) -> None:
        """Take part in every round (sending to the other writers) and write ``mine``."""
        ready: list[_Bucket] = []
        cond = threading.Condition()
        slots = threading.Semaphore(2)  # two buckets alive: one being written, one arriving
        failed: list[BaseException] = []
        arenas: list[_Arena] = []
        reader = _BucketReader(ready, cond, slots, {out.name: file_layout(out) for out in mine})
        writer = threading.Thread(target=self._write, args=(mine, directory, reader, failed), daemon=True)
        writer.start()
        taken = 0
        try:
            for number, buckets in enumerate(self.rounds):
                bucket = buckets.get(self.rank)
                if bucket is None:
                    self._exchange(number, buckets, None)
                    continue
                _acquire(slots, writer, failed)  # the bucket before the last one is written: its arena is free
                if len(arenas) < 2:
                    arenas.append(_Arena(self.arena_bytes, self.device))
                arena = arenas[taken % 2].reset()
                taken += 1
                data = self._exchange(number, buckets, arena)
                if not failed:  # a failed writer takes no more: the round was still served for the others
                    with cond:
                        ready.append(_Bucket(bucket, data, arena.event))
                        cond.notify_all()
            with cond:
                ready.append(_Bucket([], {}, None))  # the end: nothing more arrives
                cond.notify_all()
            writer.join()
        finally:
            reader.closed = True
        if failed:
            raise failed[0]

    def _exchange(self, number: int, buckets: Mapping[int, list[Target]], arena: _Arena | None) -> dict[Piece, list[tuple[Box, torch.Tensor]]]:
        """One round: send what other writers need from this rank; receive (or take locally) this rank's bucket."""
        import torch.distributed as dist

        ops = []
        received: dict[Piece, list[tuple[Box, torch.Tensor]]] = {}
        for writer, targets in buckets.items():
            for tag, copy in enumerate(_copies(targets), start=self.tags[number][writer]):
                holder = _rank_of(copy.piece)
                if writer == self.rank:
                    assert arena is not None
                    if holder == self.rank:
                        data = arena.local(self._region(copy))
                    else:
                        data = arena.receive(copy.src.sizes, copy.piece.dtype)
                        ops.append(dist.P2POp(dist.irecv, data, holder, self._data_group(), tag))
                    received.setdefault(copy.piece, []).append((copy.src, data))
                elif holder == self.rank:
                    region = self._region(copy).to(self.device).contiguous()
                    ops.append(dist.P2POp(dist.isend, region, writer, self._data_group(), tag))
        if ops:
            for work in dist.batch_isend_irecv(ops):
                work.wait()
        if arena is not None:
            arena.to_host(received)
        return received

    def _region(self, copy: Copy) -> torch.Tensor:
        local = self.views[(copy.piece.key, copy.piece.box.offsets)]
        return local[tuple(slice(o, o + s) for o, s in zip(copy.src.offsets, copy.src.sizes))]

    def _data_group(self) -> Any:
        return None if self.device.type == "cuda" else self.group.gloo  # NCCL: the job's own group

    def _write(self, mine: Sequence[OutputFile], directory: Path, reader: _BucketReader, failed: list[BaseException]) -> None:
        try:
            for out in mine:
                prefix, chunk_list = reader.layouts[out.name]
                write_file(directory / out.name, prefix, chunk_list, reader)
                check_written(directory / out.name, out, len(prefix))
        except BaseException as e:  # noqa: BLE001 (raised by the main thread after the rounds)
            failed.append(e)
            reader.release_all()


@dataclass
class _Bucket:
    targets: list[Target]
    data: dict[Piece, list[tuple[Box, torch.Tensor]]]
    event: Any


class _BucketReader(Reader):
    """The streaming writer's reader, serving regions from the buckets gathered in memory, in order."""

    def __init__(self, ready: list[_Bucket], cond: threading.Condition, slots: threading.Semaphore,
                 layouts: dict[str, tuple[bytes, list[Any]]]) -> None:
        every = [c for _, chunk_list in layouts.values() for c in chunk_list]
        sizes = buffer_sizes(every)
        sizes["read"] = 0  # nothing is read from files
        super().__init__(".", Counter(), sizes)
        self.layouts = layouts
        self._ready, self._cond, self._slots = ready, cond, slots
        self._current: _Bucket | None = None
        self.closed = False

    def region(self, piece: Piece, box: Box, sizes: tuple[int, ...], dims: tuple[int | None, ...]) -> torch.Tensor:
        while True:
            if self._current is not None:
                for src, data in self._current.data.get(piece, ()):
                    if src.intersect(box) == box:
                        part = box.shift(src.offsets)
                        return data[tuple(slice(o, o + s) for o, s in zip(part.offsets, part.sizes))].reshape(sizes)
            self._advance()

    def _advance(self) -> None:
        if self._current is not None:
            self._current = None
            self._slots.release()
        with self._cond:
            while not self._ready:
                if self.closed:
                    raise LiveGatherError("the gather stopped before this rank's tensors arrived")
                self._cond.wait(timeout=1.0)
            bucket = self._ready.pop(0)
        if not bucket.targets:
            raise LiveGatherError("internal: a tensor was asked for after the last bucket")
        if bucket.event is not None:
            bucket.event.synchronize()  # its device-to-host copy is done
        self._current = bucket

    def release_all(self) -> None:
        if self._current is not None:
            self._current = None
            self._slots.release()


class _Arena:
    """One bucket's memory, allocated once: received pieces and (on GPU) the pinned host copy of the bucket."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if device.type == "cuda" else None
        self.used = 0
        self.event: Any = None

    def reset(self) -> _Arena:
        self.used = 0
        self.event = None
        return self

    def receive(self, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        return self._carve(self.buffer, shape, dtype)

    def local(self, region: torch.Tensor) -> torch.Tensor:
        """A region this rank holds itself: used in place on CPU, copied into the arena on GPU."""
        if not region.is_cuda:
            return region
        out = self._carve(self.buffer, tuple(region.shape), dtype_name(region.dtype))
        return out.copy_(region)

    def to_host(self, received: dict[Piece, list[tuple[Box, torch.Tensor]]]) -> None:
        """On GPU: copy the bucket to the pinned host arena on a side stream; the writer waits for the event."""
        if self.host is None:
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.host[: self.used].copy_(self.buffer[: self.used], non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record(stream)
        base = self.buffer.data_ptr()
        for entries in received.values():
            for i, (src, data) in enumerate(entries):
                start = data.data_ptr() - base
                flat = self.host[start: start + data.numel() * data.element_size()]
                entries[i] = (src, flat.view(data.dtype).view(data.shape))

    def _carve(self, buffer: torch.Tensor, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
        size = itemsize(dtype)
        start = -(-self.used // 16) * 16  # aligned for every dtype
        nbytes = math.prod(shape) * size
        self.used = start + nbytes
        return buffer[start: start + nbytes].view(torch_dtype(dtype)).view(shape)


def _copies(targets: Sequence[Target]) -> Iterator[Copy]:
    """The copies a bucket needs, each region of a piece once, in a order every rank agrees on."""
    seen: set[tuple[Piece, Box]] = set()
    for target in targets:
        for copy in target.copies:
            if (copy.piece, copy.src) not in seen:
                seen.add((copy.piece, copy.src))
                yield copy


def _bucket_bytes(targets: Sequence[Target]) -> int:
    return sum(-(-(c.src.numel * itemsize(c.piece.dtype)) // 16) * 16 for c in _copies(targets))


def _buckets(targets: Sequence[Target], limit: int) -> list[list[Target]]:
    """Consecutive targets in groups of at most ``limit`` bytes (a larger target is a group of its own)."""
    out: list[list[Target]] = []
    size = 0
    for target in targets:
        n = _bucket_bytes([target])
        if not out or size + n > limit:
            out.append([])
            size = 0
        out[-1].append(target)
        size += n
    return out


def _rounds(buckets: Mapping[int, list[list[Target]]]) -> list[dict[int, list[Target]]]:
    """Round k: every writer's k-th bucket."""
    count = max((len(b) for b in buckets.values()), default=0)
    return [{w: b[k] for w, b in sorted(buckets.items()) if k < len(b)} for k in range(count)]


def _acquire(slots: threading.Semaphore, writer: threading.Thread, failed: list[BaseException]) -> None:
    while not slots.acquire(timeout=1.0):
        if failed or not writer.is_alive():
            return


def _collect(group: Group, watch: _Watch, step: str, work: Callable[[], Any], *, rank0: bool = False) -> list[Any]:
    """``work`` on every rank (or rank 0), its results shared; a rank that fails, dies or does not arrive is named."""
    try:
        return [group.on_rank0(work)] if rank0 else group.on_all(work)
    except (CkptError, ProcessGroupError):
        raise
    except Exception as e:  # a collective broke: a peer died, or one did not arrive in time
        raise watch.failure(step, e) from None


class _Watch:
    """Heartbeats on the job's store: every rank bumps a counter; a counter that stops names a dead rank."""

    def __init__(self, call: int) -> None:
        import torch.distributed as dist

        running = dist.is_available() and dist.is_initialized()
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if running else (0, 1)
        self.prefix = f"ckpttool/live/{call}/beat/"
        self.store = _store() if self.world > 1 else None
        self._stop = threading.Event()
        if self.store is not None:
            self.store.set(f"{self.prefix}{self.rank}", "0")
            threading.Thread(target=self._beat, args=(self.rank,), daemon=True).start()

    def failure(self, step: str, error: BaseException) -> LiveGatherError:
        """The error for a broken collective, naming the ranks that went silent."""
        silent = self.silent()
        who = ", ".join(f"rank {r}" for r in silent) if silent else "another rank"
        text = re.sub(r"\[[^\]]*\](:\d+)?:?\s*", "", str(error)).strip()  # gloo prefixes source paths and addresses
        why = re.split(r"(?<=[.!?])\s", text, maxsplit=1)[0] if text else type(error).__name__
        return LiveGatherError(
            f"{who} stopped responding (died, hung or never arrived) when the ranks were to {step}: {why}; "
            "nothing was published"
        )

    def _beat(self, rank: int) -> None:
        n = 0
        while not self._stop.wait(0.5):
            n += 1
            try:
                self.store.set(f"{self.prefix}{rank}", str(n))
            except Exception:  # noqa: BLE001 (the store went away with the job: nothing left to tell)
                return

    def _counters(self) -> dict[int, str | None]:
        out: dict[int, str | None] = {}
        for r in range(self.world):
            key = f"{self.prefix}{r}"
            try:
                out[r] = self.store.get(key).decode() if self.store.check([key]) else None
            except Exception:  # noqa: BLE001
                out[r] = None
        return out

    def silent(self) -> list[int]:
        """Ranks whose heartbeat does not move over :data:`WATCH_SECONDS` (or never started)."""
        if self.store is None:
            return []
        before = self._counters()
        time.sleep(WATCH_SECONDS)
        after = self._counters()
        if after[self.rank] is None:  # the store itself is gone: it cannot tell
            return []
        return [r for r in range(self.world) if r != self.rank and (after[r] is None or after[r] == before[r])]

    def stop(self) -> None:
        self._stop.set()


def _data_device(views: Mapping[Any, torch.Tensor]) -> torch.device:
    """Where gathered pieces travel: the GPU when the tensors are there and the job talks NCCL (or is alone)."""
    import torch.distributed as dist

    cuda = next((v.device for v in views.values() if v.is_cuda), None)
    if cuda is None:
        return torch.device("cpu")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "nccl":
        return cuda
    return torch.device("cpu")


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 (no store: failures are still raised, without naming the rank)
        return None
