"""Continuous batching with chunked prefill and preemption by recompute.

Each step spends a token budget: first on running requests (a decode costs one token,
an unfinished prefill the rest of its prompt, cut to the budget and to `prefill_chunk`),
then on waiting requests in (priority, arrival) order. The chunk cap is what lets a short
prompt that arrives behind a long one start at the next step instead of after all of it.
When blocks run out, the running request that would run last is preempted: its blocks are
freed and it goes back to waiting, to be recomputed from its tokens later (its prefix may
still be cached; its output tokens run as decode rows, as they did the first time).
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Collection
from dataclasses import dataclass, field

from engine.kv_cache import KVCacheManager
from engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_new_tokens` tokens of `request`, from position `start`, run this step: its own
    tokens, then `draft` (speculative tokens to verify, engine/speculation.py)."""

    request: Request
    start: int
    num_new_tokens: int
    draft: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new_tokens

    @property
    def is_decode(self) -> bool:
        """Whether it runs as decode rows: output tokens (with or without a draft), never the
        prompt's. The two paths attend with different kernels, so a position's KV and logits
        must come from the path that computed them when the answer was first written:
        - A prompt's last token alone (the rest in the prefix cache, or in the chunks before) is
          a prefill chunk of one: run as a decode row, a cache hit had changed the first output
          token of greedy requests (a 97-token agentic prompt of `tandem bench spec`, int8: first
          token logprob -2.35 cold, -2.60 with 96 tokens cached).
        - Output tokens recomputed at once (a request preempted, or replayed on another worker
          with its emitted tokens in its prompt: `Request.decode_from`) are decode rows, as they
          were when decoded one a step: as a prefill chunk, int8, 0 of 16 greedy replays had
          kept the answer of the uninterrupted run (fp32 16 of 16)."""
        return bool(self.draft) or self.request.run_from(self.start)[0]

    @property
    def completes(self) -> bool:
        """True when this chunk reaches the request's last token, so its logits are sampled."""
        return self.end - len(self.draft) == self.request.num_tokens

    @property
    def token_ids(self) -> list[int]:
        return self.request.token_ids[self.start : self.end - len(self.draft)] + list(self.draft)


@dataclass(frozen=True)
class SchedulerOutput:
    """What the model runs in one step. Decodes (one token, with or without a draft) come first."""

    decodes: list[ScheduledChunk]
    prefills: list[ScheduledChunk]
    preempted: list[str] = field(default_factory=list)

    @property
    def chunks(self) -> list[ScheduledChunk]:
        return self.decodes + self.prefills

    @property
    def num_tokens(self) -> int:
        return sum(c.num_new_tokens for c in self.decodes) + sum(c.num_new_tokens for c in self.prefills)


FIRST_CALL_KEYS = 16  # keys a prefill call must reach unless the prompt ends first (Scheduler._chunk)


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, max_num_batched_tokens: int, prefill_chunk: int = 0
    ) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.prefill_chunk = prefill_chunk  # tokens of one prompt a step at most (0: the budget)
        self.running: list[Request] = []
        self._waiting: list[tuple[tuple[int, int], Request]] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0  # running total: what an operator reads as KV pressure

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self.running or self._waiting)

    def add(self, req: Request) -> None:
        """Queue a request. If the KV manager already holds blocks for it (KV written from
        outside), they are used as they are and no prefix lookup is made."""
        self.requests[req.request_id] = req
        heapq.heappush(self._waiting, (req.sort_key, req))

    def schedule(self, alone: Collection[str] = ()) -> SchedulerOutput:
        """This step's chunks. With `alone` (suspects of a failed step, engine/containment.py):
        the first running request among them, by itself, without its draft."""
        if alone and (solo := self._alone(alone)) is not None:
            return solo
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        self.running.sort(key=lambda r: r.sort_key)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk(req, budget)
            if n == 0:
                i += 1
                continue
            draft, req.draft = (req.draft if n == 1 and len(req.draft) < budget else ()), ()
            n += len(draft)
            while not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            else:
                chunks.append(ScheduledChunk(req, req.num_computed_tokens, n, draft))
                budget -= n
                i += 1
        while self._waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            req = self._waiting[0][1]
            external_kv = self.kv.has_request(req.request_id)
            if not external_kv and req.params.prompt_logprobs is None:  # those score every position
                req.num_computed_tokens = self.kv.get_computed_blocks(req.request_id, req.cache_keys())
                req.num_cached_tokens = req.num_computed_tokens
            n = self._chunk(req, budget)
            if n == 0 or not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
                if not external_kv:
                    self.kv.free(req.request_id)  # give back prefix hits; look up again next time
                    req.num_computed_tokens = req.num_cached_tokens = 0
                break
            heapq.heappop(self._waiting)
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = time.monotonic()
            self.running.append(req)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
            budget -= n
        return SchedulerOutput(
            decodes=[c for c in chunks if c.is_decode],
            prefills=[c for c in chunks if not c.is_decode],
            preempted=preempted,
        )

    def _alone(self, ids: Collection[str]) -> SchedulerOutput | None:
        """None where none of `ids` runs or its chunk finds no room (the batch goes on as usual)."""
        self.running.sort(key=lambda r: r.sort_key)
        req = next((r for r in self.running if r.request_id in ids), None)
        if req is None:
            return None
        req.draft = ()
        n = self._chunk(req, self.max_num_batched_tokens)
        if n == 0 or not self.kv.allocate_slots(req.request_id, req.num_computed_tokens + n):
            return None
        c = ScheduledChunk(req, req.num_computed_tokens, n)
        return SchedulerOutput(decodes=[c], prefills=[]) if c.is_decode else SchedulerOutput(decodes=[], prefills=[c])

    def _chunk(self, req: Request, budget: int) -> int:
        """How many of `req`'s uncomputed tokens run this step: to the budget and the chunk cap,
        and a prompt's chunk stops where its decode rows start (ScheduledChunk.is_decode).

        0 (not this step) where the budget would end a prompt's chunk before FIRST_CALL_KEYS
        keys while more of its prompt follows: the int8 prefill kernel centres keys on the mean
        of the first 16, of fewer where a call has fewer (engine/csrc/prefill_attention_i8.c),
        so those rows' KV, reused by the rest of the prompt and by the prefix cache, had other
        bits than an uncut prompt's. Such a cut is made by what else shares the step: int8, a
        prompt cut after 5 or 14 tokens changed its first token's logprob, and a prefix cache
        that kept that KV changed the answers of other prompts sharing the prefix."""
        start = req.num_computed_tokens
        decode, run_end = req.run_from(start)
        cap = self.prefill_chunk or self.max_num_batched_tokens
        n = min(run_end - start, budget, cap)
        fewest = min(run_end, FIRST_CALL_KEYS) - start
        if not decode and n < fewest <= cap:
            return 0
        return n

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_cached_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        req.draft = ()
        req.status = RequestStatus.WAITING
        heapq.heappush(self._waiting, (req.sort_key, req))

    def advance(self, out: SchedulerOutput) -> None:
        """Record that every scheduled chunk's KV has been computed, and cache full blocks. A
        chunk with a draft is recorded by the engine, once it knows what was accepted."""
        for c in out.chunks:
            if c.draft:
                continue
            c.request.num_computed_tokens = c.end
            self.kv.cache_full_blocks(c.request.request_id, c.request.cache_keys(), c.end)

    def finish(self, req: Request, reason: str, free_blocks: bool = True) -> None:
        """Remove a request wherever it is. With free_blocks=False its blocks stay held
        (a prefill hand-off) until the caller frees them through the KV manager."""
        if req.status is RequestStatus.RUNNING:
            self.running.remove(req)
        elif req.status is RequestStatus.WAITING:
            self._waiting = [(k, r) for k, r in self._waiting if r is not req]
            heapq.heapify(self._waiting)
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.requests.pop(req.request_id, None)
        if free_blocks:
            self.kv.free(req.request_id)

    def check_integrity(self) -> None:
        """Raise AssertionError if queues, statuses and block tables disagree."""
        self.kv.check_integrity()
        waiting = [r for _, r in self._waiting]
        ids = [r.request_id for r in self.running + waiting]
        assert len(ids) == len(set(ids)), f"request in two queues: {ids}"
        assert set(ids) == set(self.requests), "request map out of sync with queues"
        for r in self.running:
            assert r.status is RequestStatus.RUNNING, f"{r.request_id} in running with status {r.status}"
            assert self.kv.has_request(r.request_id), f"running {r.request_id} holds no blocks"
        for r in waiting:
            assert r.status is RequestStatus.WAITING, f"{r.request_id} waiting with status {r.status}"
        assert len(self.running) <= self.max_num_seqs
