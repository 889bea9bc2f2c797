"""The gather: every writer's tensors moved to it bucket by bucket, and written while the next bucket arrives.

Each round, every writer receives its next bucket with point-to-point sends from the ranks that hold the pieces
(uneven pieces need no padding) while its writer thread streams the bucket before to disk. At most two buckets
are alive per rank. On GPU, data travels on the job's NCCL group and each bucket is copied to a pinned host arena
on a side stream, so the copy of bucket k+1 overlaps the disk write of bucket k.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ckpttool.execute.distributed import Group
from ckpttool.io.dtypes import dtype_name, itemsize, torch_dtype
from ckpttool.execute.reads import Reader
from ckpttool.execute.buffers import buffer_sizes
from ckpttool.execute.executor import write_file
from ckpttool.layout.layout import Box, Piece
from ckpttool.plan.tiling import Copy
from ckpttool.plan.plan import Plan, Target
from ckpttool.writers.files import OutputFile
from ckpttool.writers.hf import check_written, file_layout
from ckpttool.live.pieces import rank_of
from ckpttool.live.watch import LiveGatherError

log = logging.getLogger(__name__)


class Gather:
    """Moves every writer's tensors to it, bucket by bucket, and writes its files while the next bucket arrives."""

    def __init__(self, plan: Plan, files: Sequence[OutputFile], owner: Sequence[int], group: Group,
                 views: Mapping[tuple[str, tuple[int, ...]], torch.Tensor], bucket_bytes: int) -> None:
        self.group = group
        self.views = views
        self.rank = group.rank
        self.timeline = Timeline()
        self.device = _data_device(views)
        by_writer: dict[int, list[Target]] = {}
        for out, rank in zip(files, owner):
            by_writer.setdefault(rank, []).extend(out.targets)
        half = max(1, bucket_bytes // 2)
        self.rounds = _rounds({w: _buckets(ts, half) for w, ts in by_writer.items()})
        self.arena_bytes = max((bucket_nbytes(b) for r in self.rounds for b in r.values()), default=0)
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
        arenas: list[Arena] = []
        clock = self.timeline
        reader = _BucketReader(ready, cond, slots, {out.name: file_layout(out) for out in mine}, clock)
        writer = threading.Thread(target=self._write, args=(mine, directory, reader, failed), daemon=True)
        writer.start()
        taken = 0
        try:
            for number, buckets in enumerate(self.rounds):
                bucket = buckets.get(self.rank)
                if bucket is None:
                    with clock.timing("sending"):
                        self.exchange(number, buckets, None)
                    continue
                with clock.timing("waiting for the writer"):
                    _acquire(slots, writer, failed)  # the bucket before the last one is written: its arena is free
                if len(arenas) < 2:
                    arenas.append(Arena(self.arena_bytes, self.device))
                arena = arenas[taken % 2].reset()
                taken += 1
                with clock.timing("receiving"):
                    data = self.exchange(number, buckets, arena)
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
        log.info("live gather, rank %d: %s", self.rank, clock)
        if failed:
            raise failed[0]

    def exchange(self, number: int, buckets: Mapping[int, list[Target]], arena: Arena | None) -> dict[Piece, list[tuple[Box, torch.Tensor]]]:
        """One round: send what other writers need from this rank; receive (or take locally) this rank's bucket."""
        import torch.distributed as dist

        ops = []
        received: dict[Piece, list[tuple[Box, torch.Tensor]]] = {}
        for writer, targets in buckets.items():
            for tag, copy in enumerate(_copies(targets), start=self.tags[number][writer]):
                holder = rank_of(copy.piece)
                if writer == self.rank:
                    assert arena is not None
                    if holder == self.rank:
                        data = arena.local(self._region(copy))
                    else:
                        data = arena.receive(copy.src.sizes, copy.piece.dtype)
                        ops.append(dist.P2POp(dist.irecv, _wire(data), holder, self._data_group(), tag))
                    received.setdefault(copy.piece, []).append((copy.src, data))
                elif holder == self.rank:
                    region = self._region(copy).to(self.device).contiguous()
                    ops.append(dist.P2POp(dist.isend, _wire(region), writer, self._data_group(), tag))
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
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            for out in mine:
                prefix, chunk_list = reader.layouts[out.name]
                write_file(directory / out.name, prefix, chunk_list, reader)
                check_written(directory / out.name, out, len(prefix))
            if mine:  # a rank writing nothing (its files shared out to others) only sends
                self.timeline.add("writing", time.perf_counter() - start, time.thread_time() - cpu)
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

    reads_files = False  # its pieces ("rank N") are no files: every chunk is built from the buckets

    def __init__(self, ready: list[_Bucket], cond: threading.Condition, slots: threading.Semaphore,
                 layouts: dict[str, tuple[bytes, list[Any]]], clock: Timeline) -> None:
        every = [c for _, chunk_list in layouts.values() for c in chunk_list]
        sizes = buffer_sizes(every)
        sizes["read"] = 0  # nothing is read from files
        super().__init__(".", Counter(), sizes)
        self.layouts = layouts
        self._ready, self._cond, self._slots = ready, cond, slots
        self._current: _Bucket | None = None
        self._clock = clock
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
        with self._clock.timing("writer waiting for buckets"), self._cond:
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


class Timeline:
    """Where a rank's gather spent its time, wall and CPU seconds by step, logged (INFO) once it is done: whether
    the network waited on the disk (``waiting for the writer``) or the writer on the network (``writer waiting for
    buckets``), and what the writing cost. Each step is timed on one thread only."""

    def __init__(self) -> None:
        self.seconds: dict[str, list[float]] = {}

    @contextlib.contextmanager
    def timing(self, step: str) -> Iterator[None]:
        """Add the wall and this thread's CPU seconds of the ``with`` block to ``step``."""
        start, cpu = time.perf_counter(), time.thread_time()
        try:
            yield
        finally:
            self.add(step, time.perf_counter() - start, time.thread_time() - cpu)

    def add(self, step: str, wall: float, cpu: float) -> None:
        """Add ``wall`` and ``cpu`` seconds to ``step``."""
        total = self.seconds.setdefault(step, [0.0, 0.0])
        total[0] += wall
        total[1] += cpu

    def __str__(self) -> str:
        return "; ".join(f"{step} {wall:.2f} s (CPU {cpu:.2f} s)" for step, (wall, cpu) in self.seconds.items())


class Arena:
    """One bucket's memory, allocated once: received pieces and (on GPU) the pinned host copy of the bucket."""

    def __init__(self, nbytes: int, device: torch.device) -> None:
        self.device = device
        self.buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self.host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) if device.type == "cuda" else None
        self.used = 0
        self.event: Any = None

    def reset(self) -> Arena:
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
    """The copies a bucket needs, each region of a piece once, in a order every rank agrees on: a dequantized
    target's scales travel with its values (the writer computes it from both)."""
    seen: set[tuple[Piece, Box]] = set()
    for target in targets:
        for copy in (*target.copies, *(target.scale.copies if target.scale is not None else ()),
                     *(c for aux in target.aux for c in aux.copies)):
            if (copy.piece, copy.src) not in seen:
                seen.add((copy.piece, copy.src))
                yield copy


def bucket_nbytes(targets: Sequence[Target]) -> int:
    """The bytes a bucket of ``targets`` takes in an :class:`Arena`: each region it needs once, 16-byte aligned."""
    return sum(-(-(c.src.numel * itemsize(c.piece.dtype)) // 16) * 16 for c in _copies(targets))


def _buckets(targets: Sequence[Target], limit: int) -> list[list[Target]]:
    """Consecutive targets in groups of at most ``limit`` bytes (a larger target is a group of its own)."""
    out: list[list[Target]] = []
    size = 0
    for target in targets:
        n = bucket_nbytes([target])
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


def _wire(tensor: torch.Tensor) -> torch.Tensor:
    """What travels for ``tensor``: its bytes for float8 (FP8 weights, E8M0 scales), which not every backend takes
    as a dtype (gloo's collectives refuse them); the tensor itself otherwise."""
    if tensor.element_size() == 1 and tensor.dtype.is_floating_point:
        return tensor.view(torch.uint8)
    return tensor


def _acquire(slots: threading.Semaphore, writer: threading.Thread, failed: list[BaseException]) -> None:
    while not slots.acquire(timeout=1.0):
        if failed or not writer.is_alive():
            return


def _data_device(views: Mapping[Any, torch.Tensor]) -> torch.device:
    """Where gathered pieces travel: the GPU when the tensors are there and the job talks NCCL (or is alone)."""
    import torch.distributed as dist

    cuda = next((v.device for v in views.values() if v.is_cuda), None)
    if cuda is None:
        return torch.device("cpu")
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "nccl":
        return cuda
    return torch.device("cpu")

