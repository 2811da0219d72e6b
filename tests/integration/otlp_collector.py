"""A minimal OTLP/HTTP trace collector on loopback: what the workers' real exporters send to
(POST /v1/traces, protobuf), kept in memory for a test to read."""

from __future__ import annotations

import gzip
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)


@dataclass(frozen=True)
class Received:
    """One span as it arrived: ids as ints, attributes as plain values."""

    name: str
    service: str
    trace_id: int
    span_id: int
    parent_span_id: int
    attributes: dict[str, object]


class Collector:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._spans: list[Received] = []

    def spans(self) -> list[Received]:
        with self._lock:
            return list(self._spans)

    def add(self, body: bytes) -> None:
        req = ExportTraceServiceRequest.FromString(body)
        got: list[Received] = []
        for rs in req.resource_spans:
            service = next((a.value.string_value for a in rs.resource.attributes if a.key == "service.name"), "")
            for ss in rs.scope_spans:
                for s in ss.spans:
                    attrs = {
                        a.key: getattr(a.value, a.value.WhichOneof("value") or "string_value") for a in s.attributes
                    }
                    got.append(Received(s.name, service, int.from_bytes(s.trace_id, "big"),
                                        int.from_bytes(s.span_id, "big"), int.from_bytes(s.parent_span_id, "big"),
                                        attrs))  # fmt: skip
        with self._lock:
            self._spans += got


@contextmanager
def otlp_collector() -> Iterator[tuple[str, Collector]]:
    """A collector serving on a free loopback port; yields (its traces endpoint URL, the collector)."""
    collector = Collector()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            collector.add(body)
            out = ExportTraceServiceResponse().SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="otlp-collector", daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/v1/traces", collector
    finally:
        server.shutdown()
        server.server_close()
