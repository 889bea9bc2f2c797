"""Several processes merging one checkpoint: ``torchrun --nproc_per_node N -m ckpttool merge SRC OUT``.

Every process plans the same merge; output files are shared out by bytes; each process writes its own into
the one staging directory that rank 0 prepared; rank 0 writes the index, config and audit and publishes. The
processes talk only through ``torch.distributed`` collectives on a gloo group (no home-made RPC), and every
phase ends with all of them learning whether any failed, so one failing process makes all of them stop with
its message instead of waiting forever.
"""

from __future__ import annotations

import os
import re
import socket
import sys
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, TypeVar

from ckpttool.errors import CkptError

T = TypeVar("T")

#: seconds a process waits for the others at a collective before giving up (CKPTTOOL_DIST_TIMEOUT)
TIMEOUT = int(os.environ.get("CKPTTOOL_DIST_TIMEOUT", "1800"))


class ProcessGroupError(CkptError):
    """Another process of the merge failed; the message names it and says why."""


class LostProcessError(ProcessGroupError):
    """Another process stopped answering (its node killed, out of memory, the network down): the collective
    failed instead of returning. Every surviving process says so, rank 0 or not, since rank 0 may be the lost one."""

    every_rank_tells = True

    def __init__(self, message: str, transport: BaseException) -> None:
        super().__init__(message)
        self.transport = transport  # the collective's own error (the live gather names the silent rank from it)


class Group:
    """This process's place among the processes of one merge; a group of one outside ``torchrun``."""

    def __init__(self, timeout: float | None = None) -> None:
        self.rank, self.world = 0, 1
        self.places = [(os.environ.get("GROUP_RANK", "0"), socket.gethostname())]  # (node, host) of each rank
        self._group: Any = None
        self._owned = False
        # a group can run only once torch.distributed is imported: a merge outside torchrun (a dry run, an HF
        # source) need not import torch for this
        dist = sys.modules.get("torch.distributed")
        running = dist is not None and dist.is_available() and dist.is_initialized()
        if not running and int(os.environ.get("WORLD_SIZE", "1")) <= 1:
            return
        import torch.distributed as dist

        wait = timedelta(seconds=timeout if timeout is not None else TIMEOUT)
        if not running:
            dist.init_process_group("gloo", timeout=wait)
            self._owned = True
            self._group = dist.group.WORLD
        else:  # a running job's group may be NCCL: objects travel on a gloo group of the same processes
            self._group = dist.new_group(backend="gloo", timeout=wait)
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        # where every rank runs, so that a lost one can be named by its node and host (torchrun's GROUP_RANK is
        # the node's index in the rendezvous; node_rank is ignored by a c10d rendezvous)
        if self._owned:  # init_process_group met every rank already: one more exchange cannot wait on a missing one
            self.places = self.places * self.world  # what lost() names if this very exchange fails
            self.places = [tuple(p) for p in self._gather(self.places[0])]
        else:  # a running job (the live gather): no collective here, the hosts are unknown; torchrun's nodes are even
            per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", self.world)))
            self.places = [(str(r // per_node), "") for r in range(self.world)]

    @property
    def gloo(self) -> Any:
        """The gloo process group of these processes (None for a group of one)."""
        return self._group

    def on_rank0(self, work: Callable[[], T]) -> T:
        """``work()`` on rank 0 only; every process gets its result, or raises if it failed."""
        mine = _attempt(work) if self.rank == 0 else (None, None)
        shared = [mine] if self.world == 1 else [self._broadcast((mine[0], _describe(mine[1])))]
        return _settle(mine, shared)[0]

    def on_all(self, work: Callable[[], T]) -> list[T]:
        """``work()`` on every process; everyone gets all results, or raises if any process failed."""
        mine = _attempt(work)
        everyone = [mine] if self.world == 1 else self._gather((mine[0], _describe(mine[1])))
        return _settle(mine, everyone)

    def close(self) -> None:
        if not self._owned and self._group is None:  # a group of one: nothing to destroy
            return
        import torch.distributed as dist

        try:  # every rank done with its last message before any tears its side down (gloo can abort otherwise)
            dist.barrier(group=self._group)
        except Exception:  # noqa: BLE001 - a peer already gone; tearing down is all that is left to do
            pass
        if self._owned:
            dist.destroy_process_group()
        elif self._group is not None:  # the gloo group made beside a running job's own
            dist.destroy_process_group(self._group)
        self._group = None

    def _broadcast(self, value: Any) -> Any:
        import torch.distributed as dist

        box = [value]
        try:
            dist.broadcast_object_list(box, src=0, group=self._group)
        except RuntimeError as e:  # gloo's errors (DistBackendError too) are RuntimeErrors
            raise LostProcessError(self.lost(e), e) from None
        return box[0]

    def _gather(self, value: Any) -> list[Any]:
        import torch.distributed as dist

        everyone: list[Any] = [None] * self.world
        try:
            dist.all_gather_object(everyone, value, group=self._group)
        except RuntimeError as e:
            raise LostProcessError(self.lost(e), e) from None
        return everyone

    def lost(self, error: BaseException) -> str:
        """What to say when a collective failed: the processes this one lost contact with (those on other nodes;
        all others when every rank runs on this node), by rank, node and host, and the transport's own words."""
        mine = self.places[self.rank] if self.rank < len(self.places) else ("0", "")
        others = [r for r in range(self.world) if r != self.rank and self.places[r] != mine] or \
            [r for r in range(self.world) if r != self.rank]
        named = []
        for node, host in sorted({self.places[r] for r in others}, key=lambda p: (len(p[0]), p)):
            ranks = [str(r) for r in others if self.places[r] == (node, host)]
            where = f" on {host}" if host else ""
            named.append(f"node {node}{where} (rank{'s' if len(ranks) > 1 else ''} {', '.join(ranks)})")
        return (f"rank {self.rank} (node {mine[0]}) lost contact with {'; '.join(named)}: {_transport(error)}. That node stopped "
                "(killed, out of memory, its network down) or did not answer within "
                f"{TIMEOUT} s (CKPTTOOL_DIST_TIMEOUT); nothing was published")


def share_out(sizes: Sequence[int], world: int) -> list[int]:
    """The rank writing each file: largest files first, each to the rank with the fewest bytes so far."""
    load = [0] * world
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        rank = min(range(world), key=lambda r: (load[r], r))
        owner[i] = rank
        load[rank] += sizes[i]
    return owner


def _attempt(work: Callable[[], T]) -> tuple[T | None, Exception | None]:
    try:
        return work(), None
    except Exception as e:  # noqa: BLE001 (carried to every process, then raised there)
        return None, e


def _settle(mine: tuple[Any, Exception | None], everyone: list[tuple[Any, Any]]) -> list[Any]:
    """Raise this process's own error first, then another process's; else the results, by rank."""
    if mine[1] is not None:
        raise mine[1]
    for rank, (_, error) in enumerate(everyone):
        if error is not None:
            raise ProcessGroupError(f"rank {rank} failed: {error}")
    return [result for result, _ in everyone]


def _transport(error: BaseException) -> str:
    """gloo's message without its source path and its closing advice: '... Connection reset by peer'."""
    text = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    text = re.sub(r"^\[[^\]]*\.cc:\d+\]\s*", "", text)
    return text.split(". This is typically caused")[0].rstrip(". ")


def _describe(error: BaseException | None) -> str | None:
    return None if error is None else (str(error) if isinstance(error, CkptError) else f"{type(error).__name__}: {error}")
