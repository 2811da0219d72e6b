"""One worker of a pool, as the router sees it, and the picks among them: pure functions, no Ray,
no Redis.

Each worker is seen through its last heartbeat and through `load`, what this router has sent
it and not yet seen finish (cluster.inflight). Decode is picked by in-flight streams (the
heartbeat's count when that is higher: other routers), then free blocks. Prefill is picked by
estimated time to first token:

    ttft(w) = (queued prefill tokens on w + this prompt's tokens not cached on w) * w's s/token

so a cache hit wins exactly while it saves more than the queue it waits behind costs, with no
cliff. cluster.routing puts the picks together into a route.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.inflight import WorkerLoad


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
    load: WorkerLoad = field(default_factory=WorkerLoad)

    @property
    def free(self) -> int:
        """Free blocks, counting what was reserved here since the heartbeat."""
        return min(self.free_blocks, self.num_blocks - self.load.blocks)

    @property
    def streams(self) -> int:
        return max(self.load.streams, self.running + self.waiting)

    @classmethod
    def of(cls, worker_id: str, info: Mapping[str, Any], load: WorkerLoad | None = None) -> WorkerView:
        return cls(
            worker_id=worker_id,
            role=str(info.get("role", "")),
            free_blocks=int(info.get("free_blocks", 0)),
            num_blocks=max(int(info.get("num_blocks", 1)), 1),
            running=int(info.get("running", 0)),
            waiting=int(info.get("waiting", 0)),
            healthy=bool(info.get("healthy", True)),
            draining=bool(info.get("draining", False)),
            load=load or WorkerLoad(),
        )


def decode_with_room(
    workers: Sequence[WorkerView], blocks_needed: int, exclude: frozenset[str] = frozenset()
) -> list[WorkerView]:
    """The live decode workers with room for `blocks_needed` blocks."""
    return [w for w in live(workers, "decode", exclude) if w.free >= blocks_needed]


def live(workers: Sequence[WorkerView], role: str, exclude: frozenset[str] = frozenset()) -> list[WorkerView]:
    """The healthy, non-draining workers of `role`, but those in `exclude`."""
    return [w for w in workers if w.role == role and w.healthy and not w.draining and w.worker_id not in exclude]


def pick_decode(workers: Sequence[WorkerView], blocks_needed: int, exclude: frozenset[str] = frozenset()) -> str | None:
    """The decode worker with room for `blocks_needed` blocks that has the fewest streams in
    flight, then the most free blocks. None when none has room."""
    fits = decode_with_room(workers, blocks_needed, exclude)
    if not fits:
        return None
    return min(fits, key=lambda w: (w.streams, -w.free, w.worker_id)).worker_id


def prefill_eta(w: WorkerView, cached_tokens: int, prompt_tokens: int) -> float:
    """Estimated seconds until `w` has computed this prompt (the first token's time, roughly)."""
    uncached = max(prompt_tokens - cached_tokens, 1)  # a fully cached prompt still computes its last token
    return (w.load.prefill_tokens + uncached) * w.load.prefill_s_per_token


def pick_prefill(
    workers: Sequence[WorkerView],
    cached_blocks: Mapping[str, int],
    prompt_tokens: int = 0,
    block_size: int = 1,
    exclude: frozenset[str] = frozenset(),
) -> str | None:
    """The prefill worker with the earliest estimated first token (`prefill_eta`); ties go to
    the longer cached prefix, then the shorter queue."""
    prefills = live(workers, "prefill", exclude)
    if not prefills:
        return None

    def key(w: WorkerView) -> tuple[float, int, int, str]:
        cached = min(cached_blocks.get(w.worker_id, 0) * block_size, prompt_tokens)
        return (prefill_eta(w, cached, prompt_tokens), -cached, w.waiting + w.running, w.worker_id)

    return min(prefills, key=key).worker_id


def pick_colocated(
    workers: Sequence[WorkerView], blocks_needed: int, exclude: frozenset[str] = frozenset()
) -> str | None:
    """As `pick_decode`, over the colocated pool."""
    as_decode = [replace(w, role="decode") for w in workers if w.role == "colocated"]
    return pick_decode(as_decode, blocks_needed, exclude)


def pick_local(
    workers: Sequence[WorkerView],
    cached_blocks: Mapping[str, int],
    prompt_tokens: int,
    blocks_needed: int,
    block_size: int,
    below_tokens: int,
    exclude: frozenset[str] = frozenset(),
) -> tuple[str, int] | None:
    """The decode worker with room (as `pick_decode`) holding the longest cached prefix of the
    prompt (none is fine), with fewer than `below_tokens` tokens left to prefill, and that
    prefix; ties go to the fewest streams, then the most free blocks. None when no decode worker
    qualifies."""
    best: tuple[tuple[int, int, int, str], str, int] | None = None
    for w in decode_with_room(workers, blocks_needed, exclude):
        cached = min(cached_blocks.get(w.worker_id, 0) * block_size, prompt_tokens)
        if prompt_tokens - cached >= below_tokens:
            continue
        key = (-cached, w.streams, -w.free, w.worker_id)
        if best is None or key < best[0]:
            best = (key, w.worker_id, cached)
    return None if best is None else (best[1], best[2])
