"""Routing policy: pure functions over a snapshot of worker state. No Ray, no Redis.

Decode first (reserve its blocks before any prefill starts), then prefill by the longest
cached prefix, ties and overload broken by queued prefill work. `plan_route` puts them
together, with conditional disaggregation: a prompt whose uncached part is short runs whole on
a colocated worker, where paying for a KV transfer would cost more than it saves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class RoutingPolicy:
    """Knobs of `plan_route`.

    colocate_below_tokens: a prompt whose uncached part (after the best prefill worker's
    cached prefix) is shorter than this runs whole on a colocated worker, with no KV transfer,
    when one is up with room; 0 turns conditional disaggregation off.
    overload_waiting: a prefill worker with this many queued requests loses its cache preference.
    """

    colocate_below_tokens: int = 0
    overload_waiting: int = 8

    def __post_init__(self) -> None:
        if self.colocate_below_tokens < 0 or self.overload_waiting < 1:
            raise ValueError("colocate_below_tokens must be >= 0 and overload_waiting >= 1")


@dataclass(frozen=True)
class Route:
    """Where one request runs. `prefill` None: the whole request runs on `decode`, a colocated
    worker, with no transfer. `cached_tokens`: the prefix the index says `prefill` holds."""

    decode: str
    prefill: str | None = None
    cached_tokens: int = 0

    @property
    def workers(self) -> frozenset[str]:
        return frozenset(w for w in (self.prefill, self.decode) if w is not None)


def pick_colocated(
    workers: Sequence[WorkerView], blocks_needed: int, exclude: frozenset[str] = frozenset()
) -> str | None:
    """As `pick_decode`, over the colocated pool."""
    as_decode = [replace(w, role="decode") for w in workers if w.role == "colocated"]
    return pick_decode(as_decode, blocks_needed, exclude)


def plan_route(
    workers: Sequence[WorkerView],
    cached_blocks: Mapping[str, int],
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    policy: RoutingPolicy | None = None,
    exclude: frozenset[str] = frozenset(),
) -> Route | None:
    """Decode (capacity) and prefill (cached prefix, then queue) for one request, or a colocated
    worker when the uncached part is short or no P/D pair is available. None: nowhere to run."""
    policy = policy or RoutingPolicy()
    blocks = -(-(prompt_tokens + max_tokens) // block_size)
    prefill = pick_prefill(workers, cached_blocks, policy.overload_waiting, exclude)
    cached = min(cached_blocks.get(prefill, 0) * block_size, prompt_tokens) if prefill is not None else 0
    colocated = pick_colocated(workers, blocks, exclude)
    if colocated is not None and prompt_tokens - cached < policy.colocate_below_tokens:
        return Route(decode=colocated)
    decode = pick_decode(workers, blocks, exclude)
    if prefill is not None and decode is not None:
        return Route(decode=decode, prefill=prefill, cached_tokens=cached)
    return Route(decode=colocated) if colocated is not None else None


def retry_exclusions(failed: Sequence[Route]) -> list[frozenset[str]]:
    """Workers to avoid when retrying after `failed` routes broke before their first token,
    strictest first: every worker of a failed route; then only their prefill workers; then only
    their decode workers (a failure does not say which side of a pair broke)."""
    every = frozenset().union(*(r.workers for r in failed))
    prefill = frozenset(r.prefill for r in failed if r.prefill is not None)
    decode = frozenset(r.decode for r in failed)
    out: list[frozenset[str]] = []
    for ex in (every, prefill, decode):
        if ex and ex not in out:
            out.append(ex)
    return out
