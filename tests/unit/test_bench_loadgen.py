"""The load generator against a scripted OpenAI-style server (httpx.MockTransport): SSE parsing,
timing, errors, closed-loop conversations and open-loop arrivals."""

from __future__ import annotations

import asyncio
import itertools
import json
import statistics
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from bench.loadgen import Target, arrivals, run_load, send
from bench.workloads import MIXES, WorkItem, make_items

TARGET = Target("http://bench.test/v1", "m")
TIMING = {"queue_s": 0.01, "prefill_s": 0.02, "transfer_s": 0.001, "decode_s": 0.1, "cached_tokens": 16}


def sse(*events: dict[str, Any] | str, delay: float = 0.0) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for e in events:
            await asyncio.sleep(delay)
            yield f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n".encode()

    return gen()


def chat_stream(texts: list[str], prompt_tokens: int = 12, delay: float = 0.0) -> AsyncIterator[bytes]:
    role = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}
    chunks = [{"choices": [{"index": 0, "delta": {"content": t}}]} for t in texts]
    done = {"choices": [{"index": 0, "delta": {}, "finish_reason": "length"}]}
    usage = {"choices": [], "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(texts) + 1},
             "tandem": {"timing": TIMING}}  # fmt: skip
    return sse(role, *chunks, done, usage, "[DONE]", delay=delay)


async def one(handler: Any, item: WorkItem, target: Target = TARGET) -> Any:
    async with httpx.AsyncClient(transport=httpx.MockTransport(handler)) as client:
        return await send(client, target, item, time.perf_counter())


def test_streamed_chat_is_timed_from_the_first_content_token() -> None:
    seen: dict[str, Any] = {}

    async def handler(req: httpx.Request) -> httpx.Response:
        seen["path"], seen["body"] = req.url.path, json.loads(req.content)
        return httpx.Response(200, content=chat_stream(["a", "", "b", "c"], delay=0.02))

    r = asyncio.run(one(handler, WorkItem(4, (("user", "hi"),))))
    assert seen["path"] == "/v1/chat/completions"
    body = seen["body"]
    assert body["stream"] and body["stream_options"] == {"include_usage": True} and body["ignore_eos"]
    assert body["messages"] == [{"role": "user", "content": "hi"}] and body["max_tokens"] == 4
    assert r.ok and r.output_tokens == 5 and r.prompt_tokens == 12  # from usage (3 content chunks)
    assert r.timing == TIMING and r.cached_tokens == 16
    assert 0.03 < r.ttft < r.e2e  # the role chunk (first event) is not the first token
    assert r.tpot == pytest.approx((r.e2e - r.ttft) / 4)


def test_completions_without_usage_count_chunks() -> None:
    async def handler(req: httpx.Request) -> httpx.Response:
        assert req.url.path == "/v1/completions" and json.loads(req.content)["prompt"] == "once"
        chunks = [{"choices": [{"index": 0, "text": t}]} for t in ("x", "y")]
        return httpx.Response(200, content=sse(*chunks, "[DONE]"), headers={"x-tandem-timing": json.dumps(TIMING)})

    r = asyncio.run(one(handler, WorkItem(2, prompt="once", cls="doc")))
    assert r.ok and r.output_tokens == 2 and r.prompt_tokens == 0 and r.timing == TIMING
    assert r.cls == "doc"  # the request's class rides along, for per-class SLOs


def test_errors_become_failed_results() -> None:
    def refuse(_: httpx.Request) -> httpx.Response:
        return httpx.Response(429, json={"error": {"message": "busy"}})

    async def midstream(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=sse({"error": {"message": "worker died"}}, "[DONE]"))

    def unreachable(req: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=req)

    async def stalls(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=chat_stream(["a", "b"], delay=0.2))

    item = WorkItem(4, (("user", "hi"),), cls="chat")
    r = asyncio.run(one(stalls, item, Target("http://bench.test", "m", timeout_s=0.1)))
    assert not r.ok and r.error == "no complete answer within 0.1 s" and 0.1 <= r.e2e < 0.3 and r.cls == "chat"
    r = asyncio.run(one(refuse, item))
    assert not r.ok and r.error.startswith("HTTP 429") and "busy" in r.error
    assert asyncio.run(one(midstream, item)).error == "worker died"
    r = asyncio.run(one(unreachable, item))
    assert not r.ok and r.error.startswith("ConnectError") and r.e2e >= 0


def test_closed_loop_sends_each_turn_after_the_last_one_finished() -> None:
    spans: dict[str, tuple[float, float]] = {}
    in_flight, peak = 0, 0

    async def handler(req: httpx.Request) -> httpx.Response:
        nonlocal in_flight, peak
        key = json.loads(req.content)["messages"][-1]["content"]
        in_flight += 1
        peak = max(peak, in_flight)
        t = time.perf_counter()
        await asyncio.sleep(0.01)
        in_flight -= 1
        spans[key] = (t, time.perf_counter())
        return httpx.Response(200, content=chat_stream(["a", "b"]))

    items = make_items(MIXES["multiturn"].scaled(0.1, 0.1), 30, seed=0, active=4)
    results, duration = asyncio.run(
        run_load(TARGET, items, concurrency=3, progress=False, transport=httpx.MockTransport(handler))
    )
    assert len(results) == 30 and all(r.ok for r in results) and peak == 3 and duration > 0
    last = {(it.conv, it.turn): spans[it.messages[-1][1]] for it in items}
    for (conv, turn), (start, _) in last.items():
        if turn > 0:
            assert start >= last[(conv, turn - 1)][1]
    assert sorted((r.conv, r.turn) for r in results) == sorted(last)


def test_open_loop_stops_sending_after_the_duration() -> None:
    async def handler(_: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=chat_stream(["a"]))

    items = [WorkItem(1, (("user", str(i)),)) for i in range(100)]
    results, _ = asyncio.run(
        run_load(TARGET, items, rate=100.0, arrival="constant", duration_s=0.2, progress=False,
                 transport=httpx.MockTransport(handler))
    )  # fmt: skip
    assert 10 <= len(results) <= 25
    starts = [r.start for r in results]
    assert starts == sorted(starts) and statistics.median(b - a for a, b in itertools.pairwise(starts)) < 0.02
    with pytest.raises(ValueError):
        asyncio.run(run_load(TARGET, items, rate=1.0, concurrency=1))


def test_arrivals() -> None:
    assert arrivals(4, 2.0, "constant", 0) == [0.0, 0.5, 1.0, 1.5]
    times = arrivals(4000, 5.0, "poisson", 1)
    assert times == arrivals(4000, 5.0, "poisson", 1) and times != arrivals(4000, 5.0, "poisson", 2)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    assert statistics.mean(gaps) == pytest.approx(0.2, rel=0.05)
    assert statistics.pstdev(gaps) == pytest.approx(0.2, rel=0.1)  # exponential: sd = mean
    with pytest.raises(ValueError):
        arrivals(3, 1.0, "bursty", 0)


def test_a_next_turn_repeats_the_answers_the_server_gave() -> None:
    item = WorkItem(8, (("system", "s"), ("user", "u0"), ("assistant", "a0"), ("user", "u1"), ("assistant", "a1"),
                        ("user", "u2")), conv=3, turn=2)  # fmt: skip
    got = item.answered(["real zero", ""])  # turn 1 failed: its stand-in stays
    assert [c for _, c in got.messages] == ["s", "u0", "real zero", "u1", "a1", "u2"]
    assert (got.conv, got.turn, got.max_tokens) == (3, 2, 8)


def test_run_load_sends_each_turn_with_the_answers_before_it() -> None:
    sent: list[list[str]] = []

    async def handler(req: httpx.Request) -> httpx.Response:
        msgs = [m["content"] for m in json.loads(req.content)["messages"]]
        sent.append(msgs)
        return httpx.Response(200, content=chat_stream([f"answer{len(msgs)}", "!"]))

    turns = [WorkItem(2, (("user", "u0"),), conv=0, turn=0),
             WorkItem(2, (("user", "u0"), ("assistant", "stand-in"), ("user", "u1")), conv=0, turn=1)]  # fmt: skip
    results, _ = asyncio.run(
        run_load(TARGET, turns, concurrency=2, progress=False, transport=httpx.MockTransport(handler))
    )
    assert all(r.ok for r in results) and results[0].text == "answer1!"
    assert sent == [["u0"], ["u0", "answer1!", "u1"]]
