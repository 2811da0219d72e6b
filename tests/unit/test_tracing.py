"""Requests' OpenTelemetry spans (router.tracing), through the real router app on a fake P/D
backend, caught by the SDK's in-memory exporter."""

from __future__ import annotations

import itertools

import pytest
from fastapi.testclient import TestClient
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from engine.spans import TraceContext
from engine.tokenizer import Tokenizer
from router.app import create_app
from router.settings import RouterSettings
from router.tracing import new_provider, trace_id_of
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend

BODY = {"model": "fake-model", "messages": HELLO, "max_tokens": 3}
CHAIN = ["router.queue", "route", "worker.queue", "prefill", "kv_transfer", "first_decode", "decode"]


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    # the fake's worker times (13 ms to the transfer's end) fit before its first token
    return FakeBackend(smollm_tokenizer, token_delay_s=0.03)


@pytest.fixture
def traced(backend: FakeBackend) -> tuple[TestClient, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = new_provider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return TestClient(create_app(backend, RouterSettings(), provider)), exporter


def test_the_workers_are_handed_the_root_span(
    traced: tuple[TestClient, InMemorySpanExporter], backend: FakeBackend
) -> None:
    """Every worker call of a request carries a traceparent naming its root span, fixed at
    arrival, so that the workers' own spans (engine/spans.py) hang under it."""
    c, exporter = traced
    rid = "0123456789abcdef0123456789abcdef"
    client = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    for headers in ({"x-request-id": rid}, {"x-request-id": "req-8", "traceparent": client}):
        exporter.clear()
        assert c.post(CHAT, json=BODY, headers=headers).status_code == 200
        root = next(s for s in exporter.get_finished_spans() if s.name == "tandem.request")
        handed = TraceContext.parse(backend.traceparents[-1])
        assert root.context is not None and handed is not None
        assert (handed.trace_id, handed.span_id) == (root.context.trace_id, root.context.span_id)
    assert root.parent is not None and root.parent.span_id == 0x00F067AA0BA902B7 != handed.span_id


def test_a_pd_request_is_one_trace_named_by_its_request_id(traced: tuple[TestClient, InMemorySpanExporter]) -> None:
    c, exporter = traced
    rid = "0123456789abcdef0123456789abcdef"
    assert c.post(CHAT, json=BODY, headers={"x-request-id": rid}).status_code == 200
    spans = exporter.get_finished_spans()
    root = next(s for s in spans if s.name == "tandem.request")
    children = sorted((s for s in spans if s is not root), key=lambda s: s.start_time or 0)
    assert [s.name for s in children] == CHAIN
    assert root.context is not None and root.context.trace_id == int(rid, 16)
    assert root.parent is None
    assert all(s.parent is not None and s.parent.span_id == root.context.span_id for s in children)
    assert all(s.context is not None and s.context.trace_id == root.context.trace_id for s in children)
    # each part starts where the one before it ended, inside the request's span
    for a, b in itertools.pairwise(children):
        assert a.end_time == b.start_time
    assert root.start_time == children[0].start_time and children[-1].end_time == root.end_time
    attrs = {s.name: dict(s.attributes or {}) for s in spans}
    assert attrs["tandem.request"]["tandem.request_id"] == rid
    assert attrs["tandem.request"]["gen_ai.usage.output_tokens"] == 3
    assert attrs["tandem.request"]["http.response.status_code"] == 200
    assert attrs["prefill"]["tandem.worker"] == "p0" and attrs["decode"]["tandem.worker"] == "d0"
    assert attrs["kv_transfer"]["tandem.bytes"] == 4096
    assert {"tandem.from": "p0", "tandem.to": "d0"}.items() <= attrs["kv_transfer"].items()


def test_a_client_trace_is_continued(traced: tuple[TestClient, InMemorySpanExporter]) -> None:
    c, exporter = traced
    parent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    r = c.post(CHAT, json={**BODY, "stream": True}, headers={"traceparent": parent, "x-request-id": "req-7"})
    assert r.status_code == 200
    root = next(s for s in exporter.get_finished_spans() if s.name == "tandem.request")
    assert root.context is not None and root.context.trace_id == 0x4BF92F3577B34DA6A3CE929D0E0E4736
    assert root.parent is not None and root.parent.span_id == 0x00F067AA0BA902B7
    assert (root.attributes or {})["tandem.request_id"] == "req-7"


def test_a_failed_request_has_an_error_span(traced: tuple[TestClient, InMemorySpanExporter]) -> None:
    c, exporter = traced
    r = c.post(CHAT, json={**BODY, "model": "nope"}, headers={"x-request-id": "not-hex"})
    assert r.status_code == 404
    (root,) = [s for s in exporter.get_finished_spans() if s.name == "tandem.request"]
    assert root.status.status_code.name == "ERROR"
    assert root.context is not None and root.context.trace_id == trace_id_of("not-hex")
    assert [s.name for s in exporter.get_finished_spans() if s is not root] == ["router.queue"]


def test_no_endpoint_no_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    from router.tracing import provider_from_env

    monkeypatch.delenv("OTEL_EXPORTER_OTLP_ENDPOINT", raising=False)
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", raising=False)
    assert provider_from_env() is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:4318")
    provider = provider_from_env()
    assert provider is not None
    provider.shutdown()
