"""One attempt at a request on one route: the P/D hand-off's states, and who frees what.

    NEW --reserve on decode--> RESERVED --prefill(reservation)--> PREFILLED --decode.generate--> STREAMING
     |                            |                                   |                            |
     +----------------------------+------ failure / cancel / stall ---+----------------------------+--> FAILED
                                                                                       finished --> DONE

A colocated route (no prefill worker) goes NEW --generate--> STREAMING; a local route (the whole
request on a decode worker that holds its prefix) NEW --generate_local--> STREAMING. On every way out but
DONE, `close()` frees what the attempt holds, fire-and-forget (a frozen worker cannot hold the
caller): the decode side's reservation (release) and request (abort), the prefill's request
(abort). The receiver's lease is the backstop if even that is lost.

No wait here has a fixed size. A wait lasts while the workers it depends on answer pings on
their control lane (`Liveness`): a long prompt, a long queue or a big batch is not a failure,
a dead or frozen worker is, within `stall_s + liveness_s`. `cancel` (the client went away)
ends any wait within `poll_s`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import ray

from cluster.inflight import InflightLedger
from cluster.outputs import Placement
from cluster.routing import Route
from engine.errors import EngineError, InvalidRequestError
from engine.messages import TokenOutput
from engine.sampling_params import SamplingParams
from prefill_workers.worker import PrefillResult


class AttemptFailed(EngineError):
    """An attempt broke. `suspect` is the worker that failed, when that is known."""

    def __init__(self, message: str, suspect: str | None = None) -> None:
        super().__init__(message)
        self.suspect = suspect


class Cancelled(EngineError):
    """The request was cancelled (its client went away)."""


@dataclass(frozen=True)
class Waits:
    """poll_s: how often a wait looks at `cancel`; stall_s: no progress for this long starts
    pinging the workers involved; liveness_s: a ping unanswered this long means the worker is
    frozen or gone; transfer_s: the decode side's wait for a committed transfer."""

    poll_s: float = 0.1
    stall_s: float = 1.0
    liveness_s: float = 3.0
    transfer_s: float = 15.0


class Stage(Enum):
    NEW = "new"
    RESERVED = "reserved"
    PREFILLED = "prefilled"
    STREAMING = "streaming"
    DONE = "done"
    FAILED = "failed"


class Liveness:
    """Pings `workers` once nothing has progressed for `stall_s`; `check()` raises AttemptFailed
    when one of them is dead, or has not answered for `liveness_s`."""

    def __init__(self, workers: Mapping[str, Any], waits: Waits) -> None:
        self._workers = dict(workers)
        self._waits = waits
        self._pings: dict[str, tuple[Any, float]] = {}
        self._last = time.monotonic()

    def progress(self) -> None:
        self._last = time.monotonic()
        self._pings.clear()

    def check(self) -> None:
        now = time.monotonic()
        if now - self._last < self._waits.stall_s:
            return
        for wid, handle in self._workers.items():
            sent = self._pings.get(wid)
            if sent is None:
                self._pings[wid] = (handle.ping.remote(), now)
                continue
            ref, at = sent
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                try:
                    ray.get(ref)
                except Exception as e:
                    raise AttemptFailed(f"worker {wid} is gone ({type(e).__name__})", wid) from None
                del self._pings[wid]  # alive: ask again after another stall_s
                self._last = now
            elif now - at > self._waits.liveness_s:
                raise AttemptFailed(f"worker {wid} did not answer for {now - at:.1f} s", wid)


class Attempt:
    """Runs `prompt` once on `route`; iterate `run()`, then `close()` (always, idempotent).

    `placement` says where the first token was made, and what it cost, once it was.
    Raises AttemptFailed, Cancelled, or InvalidRequestError (bad input: not retried)."""

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        params: SamplingParams,
        route: Route,
        handles: Mapping[str, Any],
        ledger: InflightLedger,
        cancel: threading.Event,
        waits: Waits,
        lease_s: float | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.route = route
        self.ledger = ledger
        self.cancel = cancel
        self.waits = waits
        self.lease_s = lease_s
        self.stage = Stage.NEW
        self.placement: Placement | None = None
        missing = [w for w in route.workers if w not in handles]
        if missing:
            raise AttemptFailed(f"worker {missing[0]} is gone", missing[0])
        self.decode = handles[route.decode]
        self.prefill = handles[route.prefill] if route.prefill is not None else None

    def run(self) -> Iterator[TokenOutput]:
        if self.route.local:
            yield from self._whole(self.decode.generate_local)
        elif self.prefill is None:
            yield from self._whole(self.decode.generate)  # a colocated worker
        else:
            yield from self._disaggregated(self.prefill)

    def _disaggregated(self, prefill: Any) -> Iterator[TokenOutput]:
        """Reserve on the decode worker and prefill in one hop: the prefill call takes the
        reservation's ref, which Ray hands it once the decode worker has answered. The first
        token goes to the caller as soon as the prefill returns it, while the decode worker
        admits the request; its stream then starts at the second token."""
        rid, route = self.request_id, self.route
        live = Liveness({route.decode: self.decode, str(route.prefill): prefill}, self.waits)
        reservation = self.decode.reserve.remote(rid, len(self.prompt), self.lease_s)
        self.stage = Stage.RESERVED
        try:
            ref = prefill.prefill.remote(rid, self.prompt, self.params, reservation)
            result: PrefillResult = self._await(ref, live)
        except AttemptFailed as e:
            if e.suspect is None and ray.wait([reservation], timeout=0)[0]:
                self._get(reservation, route.decode)  # blame the decode side when its reservation failed
            raise
        self.stage = Stage.PREFILLED
        self.ledger.prefilled(rid, len(self.prompt) - result.cached_tokens, result.prefill_s)
        times = (result.queue_s, result.prefill_s, result.transfer_s)
        self.placement = Placement.of(str(route.prefill), route.decode, result.cached_tokens, times, result.transfer)
        if result.first.finished:  # ended at its first token (EOS, max_tokens=1)
            self.decode.release.remote(rid)
            self.stage = Stage.DONE
            yield result.first
            return
        gen = self.decode.generate.options(num_returns="streaming").remote(
            rid, self.prompt, result.first.token_ids[0], self.params, self.waits.transfer_s
        )
        self.stage = Stage.STREAMING
        yield result.first
        outs = self._stream(gen, route.decode)
        again = next(outs)  # the decode side's emission of the same first token: already sent
        if again.token_ids != result.first.token_ids:
            raise AttemptFailed(f"worker {route.decode} admitted {again.token_ids}, not {result.first.token_ids}")
        if again.finished:
            yield dataclasses.replace(again, token_ids=(), text="", logprobs=())
        yield from outs

    def _whole(self, method: Any) -> Iterator[TokenOutput]:
        """The whole request on the route's one worker through `method`, a streaming actor method
        taking (request_id, prompt, params); the placement counts the prefix its engine had cached."""
        t0 = time.monotonic()
        gen = method.options(num_returns="streaming").remote(self.request_id, self.prompt, self.params)
        self.stage = Stage.STREAMING
        worker = self.route.decode
        for out in self._stream(gen, worker):
            if self.placement is None:
                self.placement = Placement(worker, worker, out.num_cached_tokens, prefill_s=time.monotonic() - t0)
            yield out

    def _await(self, ref: Any, live: Liveness, suspect: str | None = None) -> Any:
        """The value of `ref`, while every worker in `live` stays alive."""
        while True:
            if self.cancel.is_set():
                raise Cancelled(f"request {self.request_id!r} was cancelled")
            ready, _ = ray.wait([ref], timeout=self.waits.poll_s)
            if ready:
                return self._get(ref, suspect)
            live.check()

    def _stream(self, gen: Any, worker: str) -> Iterator[TokenOutput]:
        live = Liveness({worker: self.decode}, self.waits)
        while True:
            if self.cancel.is_set():
                raise Cancelled(f"request {self.request_id!r} was cancelled")
            try:
                ref = gen._next_sync(timeout_s=self.waits.poll_s)  # Ray's bounded wait on a stream
            except StopIteration:
                raise AttemptFailed(f"the stream of worker {worker} ended early", worker) from None
            if ref.is_nil():
                live.check()
                continue
            out: TokenOutput = self._get(ref, worker)
            live.progress()
            yield out
            if out.finished:
                self.stage = Stage.DONE
                return

    def _get(self, ref: Any, suspect: str | None) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise AttemptFailed(f"worker {suspect or 'of the pair'} died ({type(e).__name__})", suspect) from None
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()  # type: ignore[no-untyped-call]
            if isinstance(cause, InvalidRequestError):
                raise cause from None
            raise AttemptFailed(f"{type(cause).__name__}: {cause}", suspect) from None

    def close(self) -> None:
        """Free what this attempt still holds on its workers; forget it in the ledger.

        Every call is idempotent on the worker: release drops a reservation the decode side
        still holds (reserved, committed, or not yet admitted), abort a request it runs."""
        rid, stage = self.request_id, self.stage
        try:
            if stage is not Stage.DONE:
                self.stage = Stage.FAILED
                with contextlib.suppress(Exception):  # Ray itself going down: the leases free the rest
                    if self.prefill is not None:
                        if stage in (Stage.NEW, Stage.RESERVED):
                            self.prefill.abort.remote(rid)
                        self.decode.release.remote(rid)
                    self.decode.abort.remote(rid)
        finally:
            self.ledger.end(rid)
