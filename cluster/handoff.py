"""One attempt at a request on one route: the P/D hand-off's states, and who frees what.

    NEW --reserve on decode--> RESERVED --prefill(reservation)--> PREFILLED --start_decode--> STREAMING
     |                            |                                   |                            |
     +----------------------------+------ failure / cancel / stall ---+----------------------------+--> FAILED
                                                                                       finished --> DONE

A colocated route (no prefill worker) goes NEW --start--> STREAMING, and so does a local route (the
whole request on a decode worker that holds its prefix). Outputs come back through the router's feed
of that worker (cluster.feeds: a batch per engine step for all its requests). On every way out but
DONE, `close()` frees what the attempt holds, fire-and-forget (a frozen worker cannot hold the
caller): the decode side's reservation (release) and request (abort), the prefill's request
(abort). The reservation's lease is the backstop if even that is lost: while the prefill runs,
the decode side's liveness probe renews it, so it outlives a queue of any length on a live pair
and lapses `lease_s` after its router stops watching.

With `write_back`, a P/D attempt that finishes asks its decode worker to copy the turn's KV that
the prefill worker lacks (the answer) into that worker's prefix cache, in the background
(kv_transfer/write_back.py): the conversation's next turn then prefills only its new message.

No wait here has a fixed size. A wait lasts while the workers it depends on answer pings on
their control lane (`cluster.liveness`): a long prompt, a long queue or a big batch is not a failure,
a dead or frozen worker is, within `stall_s + liveness_s`. `cancel` (the client went away)
ends any wait within `poll_s`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import queue
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

import ray

from cluster.feeds import Entry, Feeds, Gone
from cluster.inflight import InflightLedger
from cluster.liveness import AttemptFailed, Cancelled, EngineFault, Liveness, Waits, failure_of, let_go
from cluster.outputs import Placement
from cluster.routing import Route
from engine.cache_keys import cache_keys
from engine.errors import InvalidRequestError, StreamError
from engine.messages import TokenOutput
from engine.sampling_params import SamplingParams
from kv_transfer.errors import ChunkRejected, PeerUnavailable, TransferTimeout
from prefill_workers.worker import PrefillResult


@dataclass(frozen=True)
class Seam:
    """What every attempt of one router shares: the in-flight ledger, the outputs' feeds, the
    waits, and whether a finished P/D turn writes its answer's KV back to its prefill worker."""

    ledger: InflightLedger
    feeds: Feeds
    waits: Waits
    write_back: bool = False


class Stage(Enum):
    NEW = "new"
    RESERVED = "reserved"
    PREFILLED = "prefilled"
    STREAMING = "streaming"
    DONE = "done"
    FAILED = "failed"


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
        seam: Seam,
        cancel: threading.Event,
        traceparent: str | None = None,
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.route = route
        self.seam = seam
        self.ledger = seam.ledger
        self.cancel = cancel
        self.waits = seam.waits
        self.traceparent = traceparent  # for the workers' spans (engine/spans.py)
        self.stage = Stage.NEW
        self.placement: Placement | None = None
        self._sent: list[Any] = []  # the refs of the calls made, let go of at close()
        missing = [w for w in route.workers if w not in handles]
        if missing:
            raise AttemptFailed(f"worker {missing[0]} is gone", missing[0])
        self.decode = handles[route.decode]
        self.prefill = handles[route.prefill] if route.prefill is not None else None

    def run(self) -> Iterator[TokenOutput]:
        if self.prefill is None:  # a colocated worker, or the local route on a decode worker
            yield from self._whole()
        else:
            yield from self._disaggregated(self.prefill)

    def _disaggregated(self, prefill: Any) -> Iterator[TokenOutput]:
        """Reserve on the decode worker and prefill in one hop: the prefill call takes the
        reservation's ref, which Ray hands it once the decode worker has answered. The first
        token goes to the caller as soon as the prefill returns it, while the decode worker
        admits the request; its stream then starts at the second token. The reservation's lease
        is renewed by the decode side's liveness probe, so a long queue never outlasts it.

        The decode worker's feed is open before the reservation is made: should this router die
        while the prompt prefills, the worker's next (idle) send on the feed fails, and its
        reservation goes within seconds (engine/outbox.py's `lost_s`), not at its lease's end."""
        rid, route, lease_s = self.request_id, self.route, self.waits.lease_s
        renew = {route.decode: lambda: self.decode.renew.remote(rid, lease_s)}
        live = Liveness({route.decode: self.decode, str(route.prefill): prefill}, self.waits, renew)
        with self._feed(route.decode) as feed, contextlib.closing(live):
            subscriber = self.seam.feeds.subscriber
            reservation = self._keep(self.decode.reserve.remote(rid, len(self.prompt), lease_s, subscriber))
            self.stage = Stage.RESERVED
            try:
                ref = self._keep(prefill.prefill.remote(rid, self.prompt, self.params, reservation, self.traceparent))
                result: PrefillResult = self._await(ref, live, str(route.prefill), peer=route.decode)
            except AttemptFailed:
                if ray.wait([reservation], timeout=0)[0]:
                    self._get(reservation, route.decode)  # blame the decode side when its reservation failed
                raise
            self.stage = Stage.PREFILLED
            self.ledger.prefilled(rid, len(self.prompt) - result.cached_tokens, result.prefill_s)
            times, cached = (result.queue_s, result.prefill_s, result.transfer_s), result.cached_tokens
            self.placement = Placement.of(str(route.prefill), route.decode, cached, times, result.transfer)
            if result.first.finished:  # ended at its first token (EOS, max_tokens=1)
                self._keep(self.decode.release.remote(rid))
                self.stage = Stage.DONE
                yield result.first
                return
            started = self._keep(self.decode.start_decode.remote(
                self.seam.feeds.subscriber, rid, self.prompt, result.first.token_ids[0], self.params,
                self.waits.transfer_s, self.traceparent,
            ))  # fmt: skip
            self.stage = Stage.STREAMING
            yield result.first
            outs = self._follow(feed, started, route.decode)
            again = next(outs)  # the decode side's emission of the same first token: already sent
            if again.token_ids != result.first.token_ids:
                raise AttemptFailed(f"worker {route.decode} admitted {again.token_ids}, not {result.first.token_ids}")
            answer = list(again.token_ids)
            if again.finished:
                yield dataclasses.replace(again, token_ids=(), text="", logprobs=())
            for out in outs:
                answer += out.token_ids
                if out.finished and out.finish_reason in ("stop", "length") and self.seam.write_back:
                    # the next turn's prefill, on this prefill worker, then finds the answer cached too
                    keys = cache_keys(self.prompt + answer, len(self.prompt), self.params)
                    self._keep(self.decode.write_back.remote(f"{rid}.wb", keys, prefill))
                yield out

    def _whole(self) -> Iterator[TokenOutput]:
        """The whole request on the route's one worker; the placement counts the prefix its engine
        had cached."""
        t0 = time.monotonic()
        worker = self.route.decode
        with self._feed(worker) as feed:
            started = self._keep(
                self.decode.start.remote(self.seam.feeds.subscriber, self.request_id, self.prompt, self.params,
                                         self.traceparent)
            )  # fmt: skip
            self.stage = Stage.STREAMING
            for out in self._follow(feed, started, worker):
                if self.placement is None:
                    self.placement = Placement(worker, worker, out.num_cached_tokens, prefill_s=time.monotonic() - t0)
                    # out of its worker's prefill queue; no cost learnt (the time includes decode steps)
                    self.ledger.prefilled(self.request_id)
                yield out

    @contextlib.contextmanager
    def _feed(self, worker: str) -> Iterator[queue.SimpleQueue[Entry]]:
        """This request's queue on the router's feed of `worker` (its decode handle), open
        while the block runs."""
        feed = self.seam.feeds.open(worker, self.decode, self.request_id)
        try:
            yield feed
        finally:
            self.seam.feeds.close(worker, self.request_id)

    def _await(self, ref: Any, live: Liveness, suspect: str | None = None, peer: str | None = None) -> Any:
        """The value of `ref`, while every worker in `live` stays alive; `suspect`: the worker the
        call ran on, blamed when it fails; `peer`: the receiver of the call's KV transfer, blamed
        instead when that transfer lost it (`blamed`)."""
        while True:
            if self.cancel.is_set():
                raise Cancelled(f"request {self.request_id!r} was cancelled")
            ready, _ = ray.wait([ref], timeout=self.waits.poll_s)
            if ready:
                return self._get(ref, suspect, peer)
            live.check()

    def _follow(self, feed: queue.SimpleQueue[Entry], started: Any, worker: str) -> Iterator[TokenOutput]:
        """The outputs `feed` brings from `worker` until the finished one; `started` is the ref of
        the call that started the request there, whose error (a failed admission) ends it."""
        with contextlib.closing(Liveness({worker: self.decode}, self.waits)) as live:
            yield from self._outputs(feed, started, worker, live)

    def _outputs(
        self, feed: queue.SimpleQueue[Entry], started: Any, worker: str, live: Liveness
    ) -> Iterator[TokenOutput]:
        while True:
            if self.cancel.is_set():
                raise Cancelled(f"request {self.request_id!r} was cancelled")
            try:
                entry = feed.get(timeout=self.waits.poll_s)
            except queue.Empty:
                if started is not None and ray.wait([started], timeout=0)[0]:
                    self._get(started, worker)  # raises what the start raised
                    started = None
                live.check()
                continue
            if isinstance(entry, Gone):
                raise AttemptFailed(entry.reason, worker)
            if isinstance(entry, str):
                raise failure_of(entry, worker)
            live.progress()
            yield entry
            if entry.finished:
                self.stage = Stage.DONE
                return

    def _get(self, ref: Any, suspect: str | None, peer: str | None = None) -> Any:
        try:
            return ray.get(ref)
        except ray.exceptions.RayActorError as e:
            raise AttemptFailed(f"worker {suspect or 'of the pair'} died ({type(e).__name__})", suspect) from None
        except ray.exceptions.RayTaskError as e:
            cause = e.as_instanceof_cause()  # type: ignore[no-untyped-call]
            if isinstance(cause, InvalidRequestError):
                raise cause from None
            fault = EngineFault if isinstance(cause, StreamError) else AttemptFailed
            raise fault(f"{type(cause).__name__}: {cause}", blamed(cause, suspect, peer)) from None

    def close(self) -> None:
        """Free what this attempt still holds on its workers; forget it in the ledger.

        Every call is idempotent on the worker: release drops a reservation the decode side
        still holds (reserved, committed, or not yet admitted), abort a request it runs."""
        rid, stage = self.request_id, self.stage
        try:
            if stage is not Stage.DONE:
                self.stage = Stage.FAILED
            # With Ray shut down (a caller dropped a stream after Cluster.shutdown, and it is closed
            # where the garbage collector finds it), a remote call would start a new Ray and hang
            # there; the workers went with the old one.
            if stage is not Stage.DONE and ray.is_initialized():
                with contextlib.suppress(Exception):  # Ray itself going down: the leases free the rest
                    if self.prefill is not None:
                        if stage in (Stage.NEW, Stage.RESERVED):
                            self._keep(self.prefill.abort.remote(rid))
                        self._keep(self.decode.release.remote(rid))
                    self._keep(self.decode.abort.remote(rid))
            if ray.is_initialized():
                for ref in self._sent:
                    let_go(ref)
            self._sent.clear()
        finally:
            self.ledger.end(rid)

    def _keep(self, ref: Any) -> Any:
        """`ref`, kept to be let go of at close() (cluster.liveness.let_go)."""
        self._sent.append(ref)
        return ref


def blamed(cause: BaseException, worker: str | None, peer: str | None) -> str | None:
    """The worker a call's error names: the receiver of its KV transfer (`peer`) when the
    transfer lost it there (the receiver went away or stalled past its deadline: the decode
    worker killed or frozen mid-push, or one that no longer knows the request's reservation),
    else `worker`. The router's retry avoids the worker named, so a prefill worker that saw its
    decode peer die is not passed over for the dead one."""
    lost = isinstance(cause, (PeerUnavailable, TransferTimeout)) or (
        isinstance(cause, ChunkRejected) and cause.code in UNKNOWN_RESERVATION
    )
    return peer if peer is not None and lost else worker


UNKNOWN_RESERVATION = ("unknown_request", "not_found")  # the receiver's code, its gRPC status's name
