"""Routing policy: pure functions over a snapshot of worker state. No Ray, no Redis.

Decode first (reserve its blocks before any prefill starts), then prefill by the longest
cached prefix, ties and overload broken by queued prefill work.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class WorkerView:
    worker_id: str
    role: str
    free_blocks: int = 0
    num_blocks: int = 1
    running: int = 0
    waiting: int = 0
    healthy: bool = True
    draining: bool = False

    @classmethod
    def of(cls, worker_id: str, info: Mapping[str, Any]) -> WorkerView:
        return cls(
            worker_id=worker_id,
            role=str(info.get("role", "")),
            free_blocks=int(info.get("free_blocks", 0)),
            num_blocks=max(int(info.get("num_blocks", 1)), 1),
            running=int(info.get("running", 0)),
            waiting=int(info.get("waiting", 0)),
            healthy=bool(info.get("healthy", True)),
            draining=bool(info.get("draining", False)),
        )


def pick_decode(workers: Sequence[WorkerView], blocks_needed: int, exclude: frozenset[str] = frozenset()) -> str | None:
    """The healthy, non-draining decode worker with room for `blocks_needed` blocks that has
    the most free blocks, then the smallest running batch. None when none has room."""
    fits = [
        w
        for w in workers
        if w.role == "decode"
        and w.healthy
        and not w.draining
        and w.free_blocks >= blocks_needed
        and w.worker_id not in exclude
    ]
    if not fits:
        return None
    return min(fits, key=lambda w: (-w.free_blocks, w.running + w.waiting, w.worker_id)).worker_id


def pick_prefill(
    workers: Sequence[WorkerView],
    cached_blocks: Mapping[str, int],
    overload_waiting: int = 8,
    exclude: frozenset[str] = frozenset(),
) -> str | None:
    """The prefill worker holding the longest cached prefix, unless it is overloaded
    (`overload_waiting` or more queued); ties and overload broken by the queue length."""
    live = [w for w in workers if w.role == "prefill" and w.healthy and not w.draining and w.worker_id not in exclude]
    if not live:
        return None
    ok = [w for w in live if w.waiting < overload_waiting] or live
    return min(ok, key=lambda w: (-cached_blocks.get(w.worker_id, 0), w.waiting + w.running, w.worker_id)).worker_id
