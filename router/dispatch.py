"""One request's run: admission, a route, retries before the first token, the token stream.

arrival -> Admission.acquire -> route -> generate -> first output -> ... -> finished
             (429 when full)      ^  a failure before the first token: exclude
                                  +- that pair and try again (max_attempts in all)
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass, field

from cluster.cluster import NoWorkerError
from cluster.outputs import StreamOutput
from cluster.request_run import WorkerDiedError
from cluster.routing import Route
from engine.errors import InvalidRequestError
from engine.sampling_params import SamplingParams
from router.admission import Admission
from router.backend import Backend
from router.echo import Echo
from router.metrics import Metrics
from router.pump import ThreadPump
from router.recent import RecentRequests
from router.retry import retry_route
from router.room_wait import RoomQueue
from router.settings import RouterSettings
from router.trace import Trace
from router.tracing import RequestTracer
from router.window import LoadWindow

log = logging.getLogger("tandem.router")
access_log = logging.getLogger("tandem.router.requests")


class StreamEndedError(RuntimeError):
    """The worker's stream stopped before the request finished (or was aborted there)."""


class Run:
    """An admitted request with its first output in hand. `close()` exactly once (idempotent)."""

    def __init__(
        self, pump: ThreadPump[StreamOutput], first: StreamOutput, trace: Trace, d: Dispatcher, echo: Echo | None
    ) -> None:
        self._pump = pump
        self._first: StreamOutput | None = first
        self._trace = trace
        self._d = d
        self._echo = echo
        self._closed = False

    async def outputs(self) -> AsyncIterator[StreamOutput]:
        """The backend's outputs until one is finished. Raises StreamEndedError, or what the backend raised."""
        trace, m = self._trace, self._d.metrics
        while True:
            out, self._first = self._first, None
            first = out is not None
            if out is None:
                out = await self._pump.next()
                if out is None:
                    raise StreamEndedError("the worker's token stream ended early")
                now = time.monotonic()
                n = len(out.token_ids)
                if n:
                    gap = (now - trace.t_last) / n
                    for _ in range(n):
                        m.itl.observe(gap)
                trace.t_last = now
            if self._echo is not None:
                out = self._echo.output(out, first)
            trace.completion_tokens += len(out.token_ids)
            if out.num_draft_tokens:  # running totals, on the outputs of steps that verified a draft
                trace.spec_draft_tokens = max(trace.spec_draft_tokens, out.num_draft_tokens)
                trace.spec_accepted_tokens = max(trace.spec_accepted_tokens, out.num_accepted_tokens)
            if out.finish_reason == "abort":
                raise StreamEndedError("the request was aborted on the worker")
            yield out
            if out.finished:
                trace.finish_reason = out.finish_reason
                trace.migrations = out.migrations
                return

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._pump.close()
            self._d.admission.release()


class Dispatcher:
    def __init__(
        self, backend: Backend, settings: RouterSettings, metrics: Metrics, tracer: RequestTracer | None = None
    ) -> None:
        self.backend = backend
        self.settings = settings
        self.metrics = metrics
        self.admission = Admission(lambda: settings.running_bound(backend.serving_workers()),  # the pools' size now
                                   settings.max_waiting, settings.max_waiting_total)  # fmt: skip
        self.window = LoadWindow()  # what the autoscaler reads
        self.recent = RecentRequests()  # what the console shows
        self.room = RoomQueue()  # requests waiting for a worker with room, oldest first
        self.tracer = tracer
        metrics.running.set_function(lambda: self.admission.running)
        metrics.waiting.set_function(lambda: self.admission.waiting)

    async def start(
        self, prompt_ids: Sequence[int], params: SamplingParams, trace: Trace, echo: Echo | None = None
    ) -> Run:
        """Admit, route and get the first output; `echo`: the prompt in front of the outputs
        (router/echo.py). Raises Saturated, NoWorkerError, InvalidRequestError, or the last
        attempt's error."""
        trace.router_queue_s = await self.admission.acquire(trace.priority, self.settings.queue_timeout_s)
        self.metrics.queue_time.observe(trace.router_queue_s)
        try:
            run = await self._first(list(prompt_ids), params, trace, echo)
        except BaseException:
            self.admission.release()
            raise
        return run

    async def _first(self, prompt: list[int], params: SamplingParams, trace: Trace, echo: Echo | None) -> Run:
        failed: list[Route] = []
        suspects: set[str] = set()  # workers a failure named: avoided first
        last_error: Exception | None = None
        while True:
            engine_id = f"{trace.request_id}.{uuid.uuid4().hex[:8]}"
            trace.engine_ids.append(engine_id)
            attempt = _Attempt(self, prompt, params, engine_id, tuple(failed), trace, frozenset(suspects))
            pump: ThreadPump[StreamOutput] = ThreadPump(attempt.start, name=f"req-{engine_id}")
            try:
                first = await pump.next()
                if first is None:
                    raise StreamEndedError("the worker's token stream was empty")
            except InvalidRequestError:
                pump.close()
                raise
            except Exception as e:
                pump.close()
                if attempt.route is None:  # routing failed: no worker (left) to try
                    if isinstance(e, NoWorkerError) and last_error is not None:
                        raise last_error from None  # the failure itself says more
                    raise
                route = attempt.route
                failed.append(route)
                if isinstance(e, WorkerDiedError) and e.suspect is not None:
                    suspects.add(e.suspect)
                last_error = e
                if len(failed) >= self.settings.max_attempts:
                    raise
                log.warning("request %s failed on %s before its first token (%r); retrying", engine_id, route, e)
                self.metrics.retries.inc()
                continue
            except BaseException:  # the client left (cancelled) while this attempt routed or waited
                attempt.cancel.set()
                pump.close()
                raise
            trace.t_first = trace.t_last = time.monotonic()
            trace.placement = first.placement
            self._observe_first(trace)
            return Run(pump, first, trace, self, echo)

    def route(
        self, prompt: list[int], params: SamplingParams, failed: Sequence[Route], suspects: frozenset[str] = frozenset()
    ) -> Route:
        """A route; after failures, the best untried one (router/retry.py). Raises NoWorkerError. Blocks."""
        if not failed:
            return self.backend.route(prompt, params, frozenset())
        return retry_route(lambda exclude: self.backend.route(prompt, params, exclude), failed, suspects)

    def _observe_first(self, trace: Trace) -> None:
        m = self.metrics
        m.ttft.observe(trace.t_first - trace.t_arrival)
        if trace.placement is not None:
            m.observe_first(trace.placement)

    def _window(self, trace: Trace) -> None:
        if trace.status == 200 and trace.finish_reason is not None:
            n = trace.completion_tokens
            tpot = (trace.t_last - trace.t_first) / (n - 1) if n > 1 else 0.0
            self.window.record(trace.t_arrival, trace.prompt_tokens, n, trace.t_first - trace.t_arrival, tpot)
        elif trace.status == 429 or trace.status >= 500:  # the service failed it, not the client
            self.window.record_failure(trace.t_arrival, trace.prompt_tokens)

    def finish(self, trace: Trace) -> None:
        """Record a request that has ended, well or not: metrics and its one log line (once)."""
        if trace.recorded:
            return
        trace.recorded = True
        m = self.metrics
        if trace.status == 200 and trace.finish_reason is not None:
            m.e2e.observe((trace.t_last or time.monotonic()) - trace.t_arrival)
            m.success.labels(trace.finish_reason).inc()
        elif trace.status != 200:
            m.rejected.labels(str(trace.status)).inc()
        if trace.t_first:
            m.prompt_tokens.inc(trace.prompt_tokens)
            m.generation_tokens.inc(trace.completion_tokens)
        self._window(trace)
        self.recent.record(trace)
        if self.tracer is not None:
            try:
                self.tracer.record(trace)
            except Exception as e:  # a tracing fault never fails a request
                log.warning("request %s: its spans were not recorded: %r", trace.request_id, e)
        if access_log.isEnabledFor(logging.INFO):  # the line costs ~70 us to build
            access_log.info(trace.log_line())


@dataclass
class _Attempt:
    """One try at a request: its route, then its stream, both made on its pump's thread. Routing
    there rather than on a thread of its own saves a hop each way (~0.1 ms a request)."""

    d: Dispatcher
    prompt: list[int]
    params: SamplingParams
    engine_id: str
    failed: tuple[Route, ...]
    trace: Trace
    suspects: frozenset[str] = frozenset()  # workers the failures named
    route: Route | None = None  # set once routed; None if routing raised
    cancel: threading.Event = field(default_factory=threading.Event)  # its client left (ends a wait for room)

    def start(self) -> Iterator[StreamOutput]:
        deadline = self.trace.t_arrival + self.d.settings.queue_timeout_s  # a full pool is waited for
        route = self.d.room.route(lambda: self.d.route(self.prompt, self.params, self.failed, self.suspects),
                                  self.trace.t_arrival, deadline, self.cancel)  # fmt: skip
        self.trace.t_dispatch = time.monotonic()
        self.route = route
        return self.d.backend.generate(self.prompt, self.params, self.engine_id, route, self.trace.context.traceparent)
