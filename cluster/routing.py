"""Routing policy: pure functions over a snapshot of worker state. No Ray, no Redis.

Each worker is seen through its last heartbeat and through `load`, what this router has sent
it and not yet seen finish (cluster.inflight). Decode is picked by in-flight streams (the
heartbeat's count when that is higher: other routers), then free blocks. Prefill is picked by
estimated time to first token:

    ttft(w) = (queued prefill tokens on w + this prompt's tokens not cached on w) * w's s/token

so a cache hit wins exactly while it saves more than the queue it waits behind costs, with no
cliff. `plan_route` puts them together, with conditional disaggregation:

    local       a decode worker holds more of the prompt than any prefill worker (a conversation's
                history and the last answer, which it wrote) and the rest is short: the request
                runs whole there, prefilling only the rest (`pick_local`)
    spill       the decode worker has more streams than the prefill worker by a margin, and the
                prefill worker has no long prefill to stall them with: a short prompt runs whole
                on the prefill worker, whose core otherwise idles between short prefills (`spills`)
    colocated   the prompt's uncached part is short: it runs whole on a colocated worker
    P/D         otherwise: prefill on a prefill worker, KV to a decode worker

A local or colocated route moves no KV: where the transfer costs more than it saves.
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


@dataclass(frozen=True)
class RoutingPolicy:
    """Knobs of `plan_route`.

    colocate_below_tokens: a prompt whose uncached part (after the best prefill worker's
    cached prefix) is shorter than this runs whole on a colocated worker, with no KV transfer,
    when one is up with room; 0 turns conditional disaggregation off.

    local_below_tokens: a prompt whose uncached part on a decode worker is shorter than this
    runs whole on that decode worker (0 turns the local route off) when that saves time: the
    decode worker holds a longer prefix than the prefill pool (a conversation's next turn), or
    the prefill worker it would go to has `busy_prefill_tokens` queued (a short chat would
    wait behind long prompts), or no prefill worker is up. The bound is what the running
    streams there pay: the rest is prefilled in the decode engine's steps, and 256 tokens (a
    chat message and its template) fit in one step's chunk of a prompt (EngineConfig.prefill_chunk,
    512 on the CPU) and cost about as much compute as that many decode tokens, one stretched
    step for the batch, where P/D would recompute the answer and move the whole history's KV.
    Keep it under the decode engines' prefill_chunk, so that it never takes more than one step.

    busy_prefill_tokens: tokens queued on a prefill worker from which a short prompt runs local
    instead: 1024 is about a second of waiting on one CPU core, against one stretched step for
    the decode worker's streams. Lower, and a prefill-heavy load moves its prefills into the
    decode steps and their TPOT (measured: 256 let 1 request in 8 miss a 2x TPOT SLO).

    spill_streams: the decode worker's streams over the prefill worker's from which a prompt
    shorter than `local_below_tokens` runs whole on the prefill worker (0, the default, turns
    spilling off; 2 is what was measured, README "P/D vs colocated"),
    when neither what is queued there (`prefill_eta`) nor any prefill there lately
    (`WorkerLoad.longest_prefill_s`) takes `spill_stall_s`: every prefill step there stalls the
    streams it decodes, and a 2K-token prompt on one CPU core is a 5 s stall. Decode-heavy
    traffic (short prompts, long answers) then decodes on both workers' cores, as colocated
    serving does; traffic with long prompts keeps its streams on the decode worker. Off by
    default until a clean full compare settles what it buys: it also puts streams where P/D
    operators do not look for them (a prefill worker's drain waits for them, the autoscaler
    counts them as prefill load).

    cross_pool: when one P/D pool has no live worker for a request (all dead, draining, or
    excluded after a failure), the other pool's worker runs it whole, rather than the request
    failing: a new request or a replay of a dead decode worker's streams on 1P+1D, a long
    prompt while the prefill pool is replaced. Full pools are not a reason: that is backpressure.
    On by default; `tandem serve --no-cross-pool` turns it off (a 503 instead).
    """

    colocate_below_tokens: int = 0
    local_below_tokens: int = 256
    busy_prefill_tokens: int = 1024
    spill_streams: int = 0
    spill_stall_s: float = 0.5
    cross_pool: bool = True

    def __post_init__(self) -> None:
        if self.colocate_below_tokens < 0:
            raise ValueError("colocate_below_tokens must be >= 0")
        if self.local_below_tokens < 0 or self.busy_prefill_tokens < 0:
            raise ValueError("local_below_tokens and busy_prefill_tokens must be >= 0")
        if self.spill_streams < 0 or self.spill_stall_s < 0:
            raise ValueError("spill_streams and spill_stall_s must be >= 0")


@dataclass(frozen=True)
class Route:
    """Where one request runs. `prefill` None: the whole request runs on `decode` with no
    transfer: a colocated worker, or with `local` a decode worker or a prefill worker it spilled
    to (`WorkerBase.start`). `cached_tokens`: the prefix the index says `prefill` (`decode` when
    local) holds."""

    decode: str
    prefill: str | None = None
    cached_tokens: int = 0
    local: bool = False
    fallback: bool = False  # RoutingPolicy.cross_pool: the one P/D pool left runs it whole

    def __post_init__(self) -> None:
        if self.local and self.prefill is not None:
            raise ValueError("a local route runs on its decode worker alone: no prefill worker")

    @property
    def workers(self) -> frozenset[str]:
        return frozenset(w for w in (self.prefill, self.decode) if w is not None)


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


def spills(prefill: WorkerView, decode: WorkerView, uncached: int, blocks_needed: int, policy: RoutingPolicy) -> bool:
    """Whether a prompt with `uncached` tokens to compute runs whole on `prefill` rather than
    on the pair (see RoutingPolicy.spill_streams)."""
    return (
        policy.spill_streams > 0
        and uncached < policy.local_below_tokens
        and prefill_eta(prefill, 0, 0) < policy.spill_stall_s
        and prefill.load.longest_prefill_s < policy.spill_stall_s
        and prefill.free >= blocks_needed
        and decode.streams - prefill.streams >= policy.spill_streams
    )


def plan_route(
    workers: Sequence[WorkerView],
    cached_blocks: Mapping[str, int],
    prompt_tokens: int,
    max_tokens: int,
    block_size: int,
    policy: RoutingPolicy | None = None,
    exclude: frozenset[str] = frozenset(),
) -> Route | None:
    """Decode (capacity) and prefill (cached prefix, then queue) for one request; or the whole
    request on a decode worker, when what it lacks of the prompt is short and it holds more of it
    than the prefill pool or the prefill worker is busy (local, see RoutingPolicy), or on the
    prefill worker, when the decode worker has the more streams by a margin (spill); or on a
    colocated worker when the uncached part is short or no P/D pair is available; or local when
    nothing else is; or whole on the one P/D pool left (cross_pool). `cached_blocks`: the prefix
    index's answer for prefill and decode workers. None: nowhere to run."""
    policy = policy or RoutingPolicy()
    by_id = {w.worker_id: w for w in workers}
    blocks = -(-(prompt_tokens + max_tokens) // block_size)
    prefill = pick_prefill(workers, cached_blocks, prompt_tokens, block_size, exclude)
    cached = min(cached_blocks.get(prefill, 0) * block_size, prompt_tokens) if prefill is not None else 0
    found = pick_local(workers, cached_blocks, prompt_tokens, blocks, block_size, policy.local_below_tokens, exclude)
    local = Route(decode=found[0], cached_tokens=found[1], local=True) if found is not None else None
    if (
        local is not None
        and prefill is not None
        and (local.cached_tokens > cached or by_id[prefill].load.prefill_tokens >= policy.busy_prefill_tokens)
    ):
        return local
    colocated = pick_colocated(workers, blocks, exclude)
    if colocated is not None and prompt_tokens - cached < policy.colocate_below_tokens:
        return Route(decode=colocated)
    decode = pick_decode(workers, blocks, exclude)
    if prefill is not None and decode is not None:
        if spills(by_id[prefill], by_id[decode], prompt_tokens - cached, blocks, policy):
            return Route(decode=prefill, cached_tokens=cached, local=True)
        return Route(decode=decode, prefill=prefill, cached_tokens=cached)
    if colocated is not None:
        return Route(decode=colocated)
    if local is not None or not policy.cross_pool:
        return local  # no prefill worker up: a short prompt still runs
    # a P/D pool with no worker to take it (dead, draining, excluded after a failure): the other runs it whole
    if prefill is not None and not live(workers, "decode", exclude) and by_id[prefill].free >= blocks:
        return Route(decode=prefill, cached_tokens=cached, local=True, fallback=True)
    if prefill is None and not live(workers, "prefill", exclude):
        found = pick_local(workers, cached_blocks, prompt_tokens, blocks, block_size, prompt_tokens + 1, exclude)
        return Route(found[0], cached_tokens=found[1], local=True, fallback=True) if found is not None else None
    return None
