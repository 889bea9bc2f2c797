"""Failure detection of the live gather: heartbeats on the job's store name the rank that died or never came.

Every rank bumps a counter in the job's ``torch.distributed`` store every half second. When a collective breaks
(a peer died, hung or never arrived), :func:`collect` turns the error into a :class:`LiveGatherError` naming the
ranks whose counters stopped moving over :data:`WATCH_SECONDS`.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable
from typing import Any

from ckpttool.execute.distributed import Group, LostProcessError, ProcessGroupError
from ckpttool.errors import CkptError

#: how long the ranks that noticed a failure watch the others' heartbeats before naming the silent ones
WATCH_SECONDS = 3.0


class LiveGatherError(CkptError):
    """The live gather could not finish: a rank failed, died or never arrived; nothing was published."""


def collect(group: Group, watch: Watch, step: str, work: Callable[[], Any], *, rank0: bool = False) -> list[Any]:
    """``work`` on every rank (or rank 0), its results shared; a rank that fails, dies or does not arrive is named."""
    try:
        return [group.on_rank0(work)] if rank0 else group.on_all(work)
    except LostProcessError as e:  # the heartbeats name the silent rank better than the broken connection does
        raise watch.failure(step, e.transport) from None
    except (CkptError, ProcessGroupError):
        raise
    except Exception as e:  # a collective broke: a peer died, or one did not arrive in time
        raise watch.failure(step, e) from None


class Watch:
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


def _store() -> Any:
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:  # noqa: BLE001 (no store: failures are still raised, without naming the rank)
        return None
