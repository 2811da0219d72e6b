"""A discrete-event simulation of the router and its pools, driven by step costs and a trace.

    arrival --route--> prefill worker: FIFO queue; each step runs chunks of the queue's head
                       requests (each at most `prefill_chunk` tokens), up to the token budget;
                       the last chunk's step end is the first token (TTFT), then the KV
                       transfer starts
            --transfer (fixed + per token)--> decode worker: joins the batch at the next step
                       boundary with room (max_batch, KV reserved for prompt + output); each step
                       gives every running request a token
    colocated worker:  one step decodes every running request and spends the rest of the token
                       budget on prefill chunks (chunked prefill), as the engine does

Workers of one host (WorkerSpec.host >= 0) lend each other their cores while idle, as
engine/core_ledger.py does: a step that starts while every other worker of its host is idle costs
`lent` (the profile with all the host's threads), one that starts while a peer is busy costs
`contended` (the profile measured beside a busy peer: `tandem profile --beside-busy-peer`; the
peers share memory bandwidth and caches), any other `costs`. (With more than two workers a host,
the ledger also lends some idle cores to each of several busy workers; this model lends only to
a worker that is busy alone.)

Routing: the least loaded worker of the pool (prefill: queued uncached tokens; decode: reserved
KV tokens; colocated: queued prefill tokens, then reserved KV), of all when a pool has up to
EXACT_ROUTE_MAX workers, else of ROUTE_CHOICES drawn at random (power of choices: a large
router samples too, and a full scan per request would make 1,000 workers slow to simulate).

A step's time is StepCosts' (planner.step_costs). Events: arrivals (from the trace, in order),
step ends and transfer ends, on one heap; a decode step is O(1) but for its finishing requests.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from dataclasses import dataclass

from planner.step_costs import StepCosts, attention_work
from planner.trace import Trace

EXACT_ROUTE_MAX = 16
ROUTE_CHOICES = 2


@dataclass(frozen=True)
class WorkerSpec:
    costs: StepCosts
    kv_tokens: int = 2048 * 16  # KV capacity; a request reserves prompt + output tokens
    max_batch: int = 128  # requests decoding at once (max_num_seqs)
    token_budget: int = 2048  # tokens a step (max_num_batched_tokens)
    prefill_chunk: int = 512  # tokens of one prompt a step (EngineConfig.prefill_chunk on the CPU); 0: the budget
    host: int = -1  # workers with the same host >= 0 share its cores; -1: a host of its own
    lent: StepCosts | None = None  # with a host: its costs on all the host's cores (its peers idle)
    contended: StepCosts | None = None  # with a host: its costs while a peer there is busy too


@dataclass(frozen=True)
class ClusterSpec:
    """P/D (prefill and decode workers) or colocated workers, not both."""

    prefill: tuple[WorkerSpec, ...] = ()
    decode: tuple[WorkerSpec, ...] = ()
    colocated: tuple[WorkerSpec, ...] = ()
    transfer_fixed_s: float = 0.0  # a P/D request's hand-off: commit, calls
    transfer_s_per_token: float = 0.0  # KV bytes a prompt token / transfer bandwidth

    def __post_init__(self) -> None:
        pd = bool(self.prefill) and bool(self.decode)
        if pd == bool(self.colocated) or bool(self.prefill) != bool(self.decode):
            raise ValueError("a cluster is P/D (prefill and decode workers) or colocated, not both or neither")


@dataclass(frozen=True)
class Outcome:
    """Per request, in trace order: first token and last token times (seconds from its arrival)."""

    ttft: tuple[float, ...]
    e2e: tuple[float, ...]
    tpot: tuple[float, ...]  # (e2e - ttft) / (output - 1); 0 for one-token answers
    makespan_s: float  # last event's time


class _Worker:
    __slots__ = ("batch", "busy", "context", "done", "kv_used", "load", "peers", "prefilling", "queue", "reserved",
                 "role", "running", "spec", "started", "steps")  # fmt: skip

    def __init__(self, role: str, spec: WorkerSpec) -> None:
        self.role = role
        self.spec = spec
        self.queue: deque[int] = deque()  # waiting for prefill (prefill, colocated) or to join (decode)
        self.done: dict[int, int] = {}  # prefill progress: uncached tokens computed so far
        self.started: set[int] = set()  # colocated: requests whose prefill began (their KV is taken)
        self.running: list[tuple[int, int]] = []  # heap of (step of its last token, request)
        self.batch = 0
        self.context = 0
        self.steps = 0
        self.kv_used = 0
        self.reserved = 0  # KV tokens promised: running, joining and queued
        self.load = 0  # queued uncached tokens (prefill, colocated)
        self.busy = False
        self.prefilling: list[tuple[int, int]] = []  # this step's chunks: (request, tokens)
        self.peers: list[_Worker] = []  # the other workers of its host


class Simulator:
    def __init__(self, spec: ClusterSpec, trace: Trace, seed: int = 0) -> None:
        self.spec, self.trace = spec, trace
        self.rng = random.Random(seed)
        self.prefill = [_Worker("prefill", s) for s in spec.prefill]
        self.decode = [_Worker("decode", s) for s in spec.decode]
        self.colocated = [_Worker("colocated", s) for s in spec.colocated]
        everyone = self.prefill + self.decode + self.colocated
        for w in everyone:
            if w.spec.host >= 0:
                w.peers = [p for p in everyone if p is not w and p.spec.host == w.spec.host]
        n = len(trace)
        self.first = [math.nan] * n
        self.last = [math.nan] * n
        self.dest: list[_Worker | None] = [None] * n  # a P/D request's decode worker
        self.events: list[tuple[float, int, int, object]] = []  # (time, seq, kind, payload)
        self.seq = 0
        self.now = 0.0

    def run(self) -> Outcome:
        tr, events = self.trace, self.events
        arrivals, i, n = tr.arrival, 0, len(tr)
        while i < n or events:
            if i < n and (not events or arrivals[i] <= events[0][0]):
                self.now = arrivals[i]
                self._arrive(i)
                i += 1
                continue
            self.now, _, kind, payload = heapq.heappop(events)
            if kind == _STEP:
                self._step_end(payload)  # type: ignore[arg-type]
            else:
                self._join(payload)  # type: ignore[arg-type]
        ttft = tuple(f - a for f, a in zip(self.first, arrivals, strict=True))
        e2e = tuple(f - a for f, a in zip(self.last, arrivals, strict=True))
        tpot = tuple((e - t) / (o - 1) if o > 1 else 0.0 for t, e, o in zip(ttft, e2e, tr.output, strict=True))
        return Outcome(ttft, e2e, tpot, self.now)

    # routing and arrivals

    def _pick(self, pool: list[_Worker], key: str) -> _Worker:
        if len(pool) > EXACT_ROUTE_MAX:
            pool = self.rng.sample(pool, ROUTE_CHOICES)
        if key == "load":
            return min(pool, key=lambda w: (w.load, w.reserved))
        return min(pool, key=lambda w: w.reserved)

    def _arrive(self, r: int) -> None:
        tr = self.trace
        need = tr.prompt[r] + tr.output[r]
        if self.colocated:
            w = self._pick(self.colocated, "load")
            w.reserved += need
        else:
            d = self._pick(self.decode, "reserved")
            d.reserved += need
            self.dest[r] = d
            w = self._pick(self.prefill, "load")
        w.load += tr.prompt[r] - tr.cached[r]
        w.done[r] = 0
        w.queue.append(r)
        if not w.busy:
            self._start(w)

    def _join(self, r: int) -> None:
        """A P/D request's KV has landed on its decode worker."""
        d = self.dest[r]
        assert d is not None
        d.queue.append(r)
        if not d.busy:
            self._start(d)

    # steps

    def _start(self, w: _Worker) -> None:
        """Start `w`'s next step if it has work; else it idles until some arrives."""
        tr, spec = self.trace, w.spec
        if w.role == "decode":  # admit into the batch: FIFO, while there is room
            while w.queue and w.batch < spec.max_batch:
                r = w.queue[0]
                if w.kv_used + tr.prompt[r] + tr.output[r] > spec.kv_tokens and w.batch:
                    break
                w.queue.popleft()
                w.kv_used += tr.prompt[r] + tr.output[r]
                self._enter(w, r)
        tokens, attention = 0, 0.0
        w.prefilling = []
        if w.role != "decode":  # prefill chunks from the queue's head, in the budget left
            budget = spec.token_budget - w.batch
            for r in w.queue:
                if budget <= 0:
                    break
                if w.role == "colocated" and r not in w.started:  # its KV is taken as its prefill starts
                    need = tr.prompt[r] + tr.output[r]
                    room = w.kv_used + need <= spec.kv_tokens and w.batch + len(w.prefilling) < spec.max_batch
                    if not room and (w.batch or w.prefilling):
                        break
                    w.kv_used += need
                    w.started.add(r)
                done = w.done[r]
                chunk = min(tr.prompt[r] - tr.cached[r] - done, budget, spec.prefill_chunk or budget)
                w.prefilling.append((r, chunk))
                attention += attention_work(chunk, tr.cached[r] + done)
                tokens += chunk
                budget -= chunk
        if not w.batch and not tokens:
            w.busy = False
            return
        w.busy = True
        costs = spec.costs
        if spec.host >= 0:
            shared = any(p.busy for p in w.peers)
            costs = (spec.contended if shared else spec.lent) or costs
        seconds = costs.mixed(w.batch, w.context, tokens, attention)
        self.seq += 1
        heapq.heappush(self.events, (self.now + seconds, self.seq, _STEP, w))

    def _enter(self, w: _Worker, r: int) -> None:
        """`r` has its first token and joins `w`'s decode batch (unless that was its only one)."""
        tr = self.trace
        if tr.output[r] == 1:
            self._finish(w, r)
            return
        heapq.heappush(w.running, (w.steps + tr.output[r] - 1, r))
        w.batch += 1
        w.context += tr.prompt[r] + 1

    def _finish(self, w: _Worker, r: int) -> None:
        self.last[r] = self.now
        need = self.trace.prompt[r] + self.trace.output[r]
        w.kv_used -= need
        w.reserved -= need

    def _step_end(self, w: _Worker) -> None:
        tr = self.trace
        if w.batch:
            w.steps += 1
            w.context += w.batch
            while w.running and w.running[0][0] == w.steps:
                _, r = heapq.heappop(w.running)
                w.batch -= 1
                w.context -= tr.prompt[r] + tr.output[r]
                self._finish(w, r)
        for r, chunk in w.prefilling:
            w.done[r] += chunk
            w.load -= chunk
            if w.done[r] < tr.prompt[r] - tr.cached[r]:
                continue
            del w.done[r]
            w.queue.remove(r)  # near the head: a short prompt may finish before a long one ahead of it
            self.first[r] = self.now
            if w.role == "colocated":
                w.started.discard(r)
                self._enter(w, r)
            elif tr.output[r] == 1:
                self.last[r] = self.now
                d = self.dest[r]
                assert d is not None
                d.reserved -= tr.prompt[r] + tr.output[r]
            else:
                done_at = self.now + self.spec.transfer_fixed_s + self.spec.transfer_s_per_token * tr.prompt[r]
                self.seq += 1
                heapq.heappush(self.events, (done_at, self.seq, _TRANSFER, r))
        self._start(w)


_STEP, _TRANSFER = 0, 1


def simulate(spec: ClusterSpec, trace: Trace, seed: int = 0) -> Outcome:
    return Simulator(spec, trace, seed).run()
