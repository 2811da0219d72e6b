"""Routing policy: where one request runs, from the picks of cluster.worker_view (pure functions
over a snapshot of worker state; no Ray, no Redis). `plan_route` puts the picks together, with
conditional disaggregation:

    local       a decode worker holds more of the prompt than any prefill worker (a conversation's
                history and the last answer, which it wrote) and the rest is short: the request
                runs whole there, prefilling only the rest (`pick_local`)
    overflow    the prefill worker is busy and the prompt is not long: it runs whole on the decode
                worker when its first token comes sooner there (`overflows`)
    spill       the decode worker has more streams than the prefill worker by a margin, and the
                prefill worker has no long prefill to stall them with: a short prompt runs whole
                on the prefill worker, whose core otherwise idles between short prefills (`spills`)
    colocated   the prompt's uncached part is short: it runs whole on a colocated worker
    P/D         otherwise: prefill on a prefill worker, KV to a decode worker

A local or colocated route moves no KV: where the transfer costs more than it saves.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from cluster.worker_view import WorkerView, live, pick_colocated, pick_decode, pick_local, pick_prefill, prefill_eta

# The room a request plans for on its worker: its prompt and its answer up to this many tokens.
# A longer answer takes blocks as it goes (heartbeats report them), and a full engine makes room
# by preemption (recompute, engine/scheduler.py), as vLLM's does for every request. Planning
# for max_tokens whole, a chat that names none (the rest of the context, ~8K tokens) had held
# an eleventh of a worker's blocks (93,200 tokens) from its first token.
ANSWER_PLAN_TOKENS = 1024


def planned_blocks(prompt_tokens: int, max_tokens: int, block_size: int) -> int:
    """Blocks a request is counted for where it decodes (ANSWER_PLAN_TOKENS)."""
    return -(-(prompt_tokens + min(max_tokens, ANSWER_PLAN_TOKENS)) // block_size)


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

    overflow_below_tokens: a prompt whose uncached part on a decode worker is shorter than this
    runs whole on that decode worker when the prefill worker it would go to has
    `busy_prefill_tokens` queued and the decode worker's own queue (the prompts sent to run whole
    there, not yet at their first token) would give it its first token sooner (`prefill_eta` on
    both). Prefill-heavy traffic then prefills on the decode workers' cores too, as colocated
    serving does, while the prefill pool is backlogged; light traffic stays disaggregated. The
    bound is the stall a prefill puts on the decode worker's streams: 1024 tokens is about a
    second on one CPU core, so a 2K-token document always goes to the prefill pool. 0 turns it
    off.

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
    overflow_below_tokens: int = 0
    spill_streams: int = 0
    spill_stall_s: float = 0.5
    cross_pool: bool = True

    def __post_init__(self) -> None:
        if self.colocate_below_tokens < 0:
            raise ValueError("colocate_below_tokens must be >= 0")
        if self.local_below_tokens < 0 or self.busy_prefill_tokens < 0 or self.overflow_below_tokens < 0:
            raise ValueError("local_below_tokens, busy_prefill_tokens and overflow_below_tokens must be >= 0")
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


def overflows(
    workers: Sequence[WorkerView],
    prefill: WorkerView,
    prefill_cached: int,
    cached_blocks: Mapping[str, int],
    prompt_tokens: int,
    blocks_needed: int,
    block_size: int,
    policy: RoutingPolicy,
    exclude: frozenset[str] = frozenset(),
) -> Route | None:
    """The whole request on a decode worker instead of `prefill` (which holds `prefill_cached`
    tokens of the prompt), when that is busy and the decode worker gets the prompt to its first
    token sooner (see RoutingPolicy.overflow_below_tokens)."""
    if not policy.overflow_below_tokens or prefill.load.prefill_tokens < policy.busy_prefill_tokens:
        return None
    found = pick_local(
        workers, cached_blocks, prompt_tokens, blocks_needed, block_size, policy.overflow_below_tokens, exclude
    )
    if found is None:
        return None
    decode = next(w for w in workers if w.worker_id == found[0])
    if prefill_eta(decode, found[1], prompt_tokens) >= prefill_eta(prefill, prefill_cached, prompt_tokens):
        return None
    return Route(decode=decode.worker_id, cached_tokens=found[1], local=True)


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
    blocks = planned_blocks(prompt_tokens, max_tokens, block_size)
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
    if prefill is not None:
        over = overflows(
            workers, by_id[prefill], cached, cached_blocks, prompt_tokens, blocks, block_size, policy, exclude
        )
        if over is not None:
            return over
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
