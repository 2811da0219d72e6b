"""OpenTelemetry spans for each request, router -> prefill -> KV transfer -> decode.

Each finished request becomes one trace whose id is its `x-request-id` (when that is 32 hex
digits, as the router's own ids are; otherwise the id's sha256, with the id as an attribute),
or continues the client's trace when the request carried a W3C `traceparent`:

    tandem.request                   arrival -> last token; status, tokens, workers
    +- router.queue                  admission
    +- route                         routing, and any attempts that failed before a token
    +- worker.queue                  on the prefill (or colocated) worker, before its step
    +- prefill                       the prompt's compute; worker, cached tokens
    +- kv_transfer                   to the decode worker; bytes, GB/s (P/D only)
    +- first_decode                  transfer done -> first token at the router
    +- decode                        first -> last token; decode worker

The spans are built at the router when the request ends, from the timing breakdown the workers
measure and return with the first token (the same figures as `x-tandem-timing`). The root's ids
are fixed at arrival (`request_context`) and go down every Ray call of the request as a W3C
`traceparent`, under which each worker records its own span (engine/spans.py: worker.prefill,
worker.decode, worker.run), exported from its own process. Export is over OTLP/HTTP when
OTEL_EXPORTER_OTLP_ENDPOINT (or OTEL_EXPORTER_OTLP_TRACES_ENDPOINT) is set; tests pass their own
TracerProvider to `create_app`.
"""

from __future__ import annotations

import contextvars
import hashlib
import random
import re
import time
from typing import TYPE_CHECKING

from opentelemetry import trace as otel
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator

from engine import spans
from engine.spans import TraceContext, new_span_id

if TYPE_CHECKING:
    from router.trace import Trace

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
# the ids the next root span takes: the ones its request was given at arrival (`request_context`)
_ROOT_IDS: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar("tandem_root_ids", default=None)


class RequestIds(IdGenerator):
    """A root span's ids from its request's context (see `request_context`); others at random."""

    def generate_span_id(self) -> int:
        root = _ROOT_IDS.get()
        if root is None:
            return new_span_id()
        _ROOT_IDS.set(None)  # once: the root's children get ids of their own
        return root[1]

    def generate_trace_id(self) -> int:
        root = _ROOT_IDS.get()
        return root[0] if root is not None else random.getrandbits(128) or 1


def trace_id_of(request_id: str) -> int:
    if _HEX32.match(request_id) and int(request_id, 16):
        return int(request_id, 16)
    return int.from_bytes(hashlib.sha256(request_id.encode()).digest()[:16], "big") or 1


def request_context(request_id: str, client: TraceContext | None) -> TraceContext:
    """The request's root span, fixed at arrival so that the workers can record theirs under it:
    in the client's trace when it sent one, else in the trace its request id names."""
    if client is not None:
        return TraceContext(client.trace_id, new_span_id(), client.sampled)
    return TraceContext(trace_id_of(request_id), new_span_id())


def provider_from_env() -> TracerProvider | None:
    return spans.provider_from_env("tandem-router", RequestIds())


def new_provider() -> TracerProvider:
    return spans.new_provider("tandem-router", RequestIds())


class RequestTracer:
    def __init__(self, provider: TracerProvider) -> None:
        self.provider = provider
        self.tracer = provider.get_tracer("tandem.router")

    def record(self, t: Trace) -> None:
        """The request's spans (see the module docstring), ended now."""
        to_ns = time.time_ns() - time.monotonic_ns()  # monotonic -> wall clock, nanoseconds

        def ns(monotonic_s: float) -> int:
            return int(monotonic_s * 1e9) + to_ns

        end = t.t_last or time.monotonic()
        parent = t.client.as_parent() if t.client is not None else None
        token = _ROOT_IDS.set((t.context.trace_id, t.context.span_id))
        try:
            root = self.tracer.start_span("tandem.request", context=parent, start_time=ns(t.t_arrival))
        finally:
            _ROOT_IDS.reset(token)
        timing = t.timing()
        root.set_attributes({
            "tandem.request_id": t.request_id, "tandem.endpoint": t.endpoint, "http.response.status_code": t.status,
            "gen_ai.usage.input_tokens": t.prompt_tokens, "gen_ai.usage.output_tokens": t.completion_tokens,
            "tandem.finish_reason": t.finish_reason or "", "tandem.attempts": len(t.engine_ids),
            "tandem.migrations": t.migrations, "tandem.stream": t.stream,
        })  # fmt: skip
        if t.error:
            root.set_status(otel.Status(otel.StatusCode.ERROR, t.error))
        ctx = otel.set_span_in_context(root)
        p = t.placement
        cursor = t.t_arrival

        def child(name: str, seconds: float, attrs: dict[str, str | int | float] | None = None) -> None:
            nonlocal cursor
            span = self.tracer.start_span(name, context=ctx, start_time=ns(cursor), attributes=attrs)
            cursor += max(seconds, 0.0)
            span.end(end_time=ns(cursor))

        child("router.queue", t.router_queue_s)
        if t.t_first:
            child("route", timing["route_s"])
            decoder: dict[str, str | int | float] = {}
            if p is not None:
                decoder = {"tandem.worker": p.decode_worker}
                child("worker.queue", p.queue_s, {"tandem.worker": p.prefill_worker})
                child(
                    "prefill", p.prefill_s, {"tandem.worker": p.prefill_worker, "tandem.cached_tokens": p.cached_tokens}
                )
                if p.prefill_worker != p.decode_worker:
                    moved = {"tandem.bytes": p.transfer_bytes, "tandem.gbps": p.transfer_gbps}
                    child("kv_transfer", p.transfer_s, {"tandem.from": p.prefill_worker, "tandem.to": p.decode_worker,
                                                        **moved})  # fmt: skip
            child("first_decode", t.t_first - cursor, decoder)
            cursor = t.t_first  # (the same unless the workers' times overran the router's clock)
            child("decode", end - t.t_first, decoder)
        root.end(end_time=ns(end))
