"""OpenTelemetry plumbing the router and the workers share: a request's W3C trace context,
the providers, and the spans a worker records for the requests it serves.

The router fixes a request's trace id and its root span's id at arrival (router/tracing.py)
and hands `TraceContext.traceparent` down every Ray call of the request; each worker then
records its own part under that root, exported from the worker's process:

    tandem.request (router)
    +- worker.prefill     prefill worker: queue + prompt compute + KV push; cached tokens
    +- worker.decode      decode worker: admission -> the request's last token
    +- worker.run         a whole request on one worker (colocated, local, spilled)

A worker records nothing unless OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT) is set in
its environment (ClusterConfig.worker_env carries it there) or a provider is given.
"""

from __future__ import annotations

import os
import random
import re
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass

from opentelemetry import trace as otel
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.id_generator import IdGenerator

from engine.outputs import RequestOutput

_TRACEPARENT = re.compile(r"^([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})$")
# open spans a worker keeps at most: a request that ends without an output or an abort (its
# caller vanished mid-call) must not grow the table for ever
MAX_OPEN_SPANS = 4096
Attrs = Mapping[str, str | int | float | bool]


@dataclass(frozen=True)
class TraceContext:
    """A span's place in a trace: W3C `traceparent`'s ids. `sampled` is its flags' bit 0."""

    trace_id: int
    span_id: int
    sampled: bool = True

    def __post_init__(self) -> None:
        if not 0 < self.trace_id < 1 << 128 or not 0 < self.span_id < 1 << 64:
            raise ValueError("trace ids are 128 bits, span ids 64, neither 0")

    @property
    def traceparent(self) -> str:
        return f"00-{self.trace_id:032x}-{self.span_id:016x}-{'01' if self.sampled else '00'}"

    @classmethod
    def parse(cls, traceparent: str | None) -> TraceContext | None:
        """The context a W3C `traceparent` header names; None when it is absent or malformed (a
        bad header from a client starts a new trace, as the W3C spec says)."""
        m = _TRACEPARENT.match((traceparent or "").strip().lower())
        if m is None or m.group(1) == "ff":
            return None
        trace_id, span_id = int(m.group(2), 16), int(m.group(3), 16)
        if not trace_id or not span_id:
            return None
        return cls(trace_id, span_id, bool(int(m.group(4), 16) & 1))

    def as_parent(self) -> Context:
        span = otel.NonRecordingSpan(
            otel.SpanContext(self.trace_id, self.span_id, is_remote=True,
                             trace_flags=otel.TraceFlags(1 if self.sampled else 0))
        )  # fmt: skip
        return otel.set_span_in_context(span)


def new_span_id() -> int:
    return random.getrandbits(64) or 1


def new_provider(service: str, ids: IdGenerator | None = None) -> TracerProvider:
    """A provider named OTEL_SERVICE_NAME, else `service`."""
    resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service)})
    if ids is None:
        return TracerProvider(resource=resource)
    return TracerProvider(resource=resource, id_generator=ids)


def provider_from_env(service: str, ids: IdGenerator | None = None) -> TracerProvider | None:
    """A provider exporting over OTLP/HTTP when the standard endpoint variables say where; else None."""
    if not (os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")):
        return None
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = new_provider(service, ids)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    return provider


class WorkerSpans:
    """The spans of one worker's requests, each from `begin` to `end` (a finished output, an
    abort, or a failed call). Without a provider every call returns at once. Thread-safe."""

    def __init__(self, worker_id: str, role: str, provider: TracerProvider | None) -> None:
        self.worker_id = worker_id
        self.role = role
        self._lock = threading.Lock()
        self._open: dict[str, otel.Span] = {}
        self.use(provider)

    def use(self, provider: TracerProvider | None) -> None:
        """Record the spans that begin from now on with `provider` (None: record nothing)."""
        self.provider = provider
        self._tracer = provider.get_tracer("tandem.worker") if provider is not None else None

    def begin(self, request_id: str, name: str, traceparent: str | None, attrs: Attrs | None = None) -> None:
        """Open `name` for `request_id` under `traceparent` (none: nothing is recorded)."""
        tracer = self._tracer
        if tracer is None:  # (the common case: no parsing on the request path)
            return
        parent = TraceContext.parse(traceparent)
        if parent is None:
            return
        base = {"tandem.worker": self.worker_id, "tandem.role": self.role, "tandem.request_id": request_id}
        span = tracer.start_span(name, context=parent.as_parent(), attributes={**base, **(attrs or {})})
        with self._lock:
            old = self._open.pop(request_id, None)
            while len(self._open) >= MAX_OPEN_SPANS:
                self._open.pop(next(iter(self._open))).end()
            self._open[request_id] = span
        if old is not None:
            old.end()

    def end(self, request_id: str, attrs: Attrs | None = None, error: str | None = None) -> None:
        """Close `request_id`'s span, if one is open."""
        with self._lock:
            span = self._open.pop(request_id, None)
        if span is None:
            return
        if attrs:
            span.set_attributes(dict(attrs))
        if error is not None:
            span.set_status(otel.Status(otel.StatusCode.ERROR, error))
        span.end(end_time=time.time_ns())

    def on_outputs(self, outs: list[RequestOutput]) -> None:
        """An engine loop's hook: a request that finished ends its span (not a prefill's first
        token: its span lasts until the KV is pushed, `PrefillWorker.prefill`)."""
        if not self._open:  # (read without the lock: a span opens before its request starts)
            return
        for o in outs:
            if o.finished and o.finish_reason != "prefill_done":
                attrs: Attrs = {"tandem.finish_reason": o.finish_reason or "",
                                "tandem.output_tokens": o.num_output_tokens,
                                "tandem.cached_tokens": o.num_cached_tokens}  # fmt: skip
                self.end(o.request_id, attrs)

    @property
    def num_open(self) -> int:
        with self._lock:
            return len(self._open)

    def flush(self) -> None:
        if self.provider is not None:
            self.provider.force_flush()
