"""The workers' own spans (engine/spans.py): in-process workers (no Ray) record their part of a
request under the traceparent the router hands them, caught by the SDK's in-memory exporter."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from decode_workers.colocated import ColocatedWorker
from decode_workers.worker import DecodeWorker
from engine.spans import MAX_OPEN_SPANS, TraceContext, WorkerSpans, new_provider
from engine.worker_base import WorkerBase
from prefill_workers.worker import PrefillWorker
from tests.unit.test_workers import CFG, PARAMS

ROOT = TraceContext(0x4BF92F3577B34DA6A3CE929D0E0E4736, 0x00F067AA0BA902B7)


@pytest.fixture(scope="module")
def exporter() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture(scope="module")
def workers(
    model_dir: str, exporter: InMemorySpanExporter
) -> Iterator[tuple[PrefillWorker, DecodeWorker, ColocatedWorker]]:
    provider = new_provider("tandem-worker")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    p = PrefillWorker("p0", model_dir, replace(CFG, role="prefill"))
    d = DecodeWorker("d0", model_dir, replace(CFG, role="decode"))
    c = ColocatedWorker("c0", model_dir, CFG)
    for w in (p, d, c):
        w.spans.use(provider)
    yield p, d, c
    for w in (p, d, c):
        w.shutdown()


def follow(w: WorkerBase, subscriber: str) -> list[int]:
    """The tokens `subscriber` receives until its request finishes."""
    tokens: list[int] = []
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for _, out in w.take_outputs(subscriber, 0.5):
            assert not isinstance(out, str), out
            tokens += out.token_ids
            if out.finished:
                return tokens
    raise AssertionError("the request did not finish")


def named(exporter: InMemorySpanExporter, request_id: str) -> dict[str, ReadableSpan]:
    spans = exporter.get_finished_spans()
    return {s.name: s for s in spans if (s.attributes or {}).get("tandem.request_id") == request_id}


def test_a_pd_request_records_prefill_and_decode_under_the_routers_span(
    workers: tuple[PrefillWorker, DecodeWorker, ColocatedWorker], exporter: InMemorySpanExporter
) -> None:
    p, d, _ = workers
    prompt = [(5 * j) % 128 for j in range(30)]
    res = d.reserve("pd", len(prompt))
    first = p.prefill("pd", prompt, PARAMS, res, ROOT.traceparent)
    d.start_decode("sub", "pd", prompt, first.first.token_ids[0], PARAMS, 10.0, ROOT.traceparent)
    assert len(follow(d, "sub")) == PARAMS.max_tokens
    spans = named(exporter, "pd")
    assert set(spans) == {"worker.prefill", "worker.decode"}
    for s in spans.values():
        assert s.context is not None and s.context.trace_id == ROOT.trace_id
        assert s.parent is not None and s.parent.span_id == ROOT.span_id and s.parent.is_remote
    pre, dec = dict(spans["worker.prefill"].attributes or {}), dict(spans["worker.decode"].attributes or {})
    assert pre["tandem.worker"] == "p0" and pre["tandem.role"] == "prefill" and pre["tandem.prompt_tokens"] == 30
    assert pre["tandem.transfer_bytes"] == first.transfer.bytes > 0
    assert dec["tandem.worker"] == "d0" and dec["tandem.finish_reason"] == "length"
    assert dec["tandem.output_tokens"] == PARAMS.max_tokens
    assert p.spans.num_open == d.spans.num_open == 0
    d.check_integrity()
    p.check_integrity()


def test_a_whole_request_on_a_prefill_worker_and_an_abort_end_their_spans(
    workers: tuple[PrefillWorker, DecodeWorker, ColocatedWorker], exporter: InMemorySpanExporter
) -> None:
    p, _, c = workers
    prompt = [(3 * j) % 128 for j in range(12)]
    p.start("sub", "spilled", prompt, PARAMS, ROOT.traceparent)  # the router's spill route
    assert len(follow(p, "sub")) == PARAMS.max_tokens
    run = named(exporter, "spilled")["worker.run"]
    assert dict(run.attributes or {})["tandem.role"] == "prefill"
    assert dict(run.attributes or {})["tandem.finish_reason"] == "length"

    c.start("sub", "gone", prompt, replace(PARAMS, max_tokens=400), ROOT.traceparent)
    c.abort("gone")
    assert dict(named(exporter, "gone")["worker.run"].attributes or {})["tandem.finish_reason"] == "abort"
    assert p.spans.num_open == c.spans.num_open == 0
    p.check_integrity()
    c.check_integrity()


def test_no_traceparent_or_a_bad_one_records_nothing(
    workers: tuple[PrefillWorker, DecodeWorker, ColocatedWorker], exporter: InMemorySpanExporter
) -> None:
    _, _, c = workers
    for i, tp in enumerate((None, "not-a-traceparent", "00-" + "0" * 32 + "-00f067aa0ba902b7-01")):
        c.start("sub", f"untraced{i}", [1, 2, 3], PARAMS, tp)
        follow(c, "sub")
        assert named(exporter, f"untraced{i}") == {}
    assert c.spans.num_open == 0


def test_trace_context_round_trips_and_refuses_bad_headers() -> None:
    assert TraceContext.parse(ROOT.traceparent) == ROOT
    assert TraceContext.parse(ROOT.traceparent.upper()) == ROOT
    unsampled = TraceContext.parse("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00")
    assert unsampled is not None and not unsampled.sampled and unsampled.traceparent.endswith("-00")
    for bad in ("", "00-xyz", "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01"):  # fmt: skip
        assert TraceContext.parse(bad) is None
    with pytest.raises(ValueError):
        TraceContext(0, 1)


def test_open_spans_are_bounded() -> None:
    """A request whose end never comes (its caller vanished mid-call) cannot grow the table."""
    exporter = InMemorySpanExporter()
    provider = new_provider("t")
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    spans = WorkerSpans("w", "decode", provider)
    for i in range(MAX_OPEN_SPANS + 5):
        spans.begin(f"r{i}", "worker.decode", ROOT.traceparent)
    assert spans.num_open == MAX_OPEN_SPANS and len(exporter.get_finished_spans()) == 5
    spans.use(None)
    spans.begin("after", "worker.decode", ROOT.traceparent)  # recording off: nothing opens
    assert spans.num_open == MAX_OPEN_SPANS
