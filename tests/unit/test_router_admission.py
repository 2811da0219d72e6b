"""The router under load and failure, against a fake Backend: admission (429, priorities),
retries before the first token, and client disconnects that must close the backend stream."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.tokenizer import Tokenizer
from router.admission import Admission
from router.app import create_app
from router.backend import serving_from
from router.errors import Saturated
from router.settings import RouterSettings
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client, sample, worker


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(smollm_tokenizer)


@pytest.fixture
def gated(backend: FakeBackend) -> Iterator[FakeBackend]:
    backend.gate = threading.Event()
    yield backend
    backend.gate.set()


def test_saturated_answers_429_with_retry_after(gated: FakeBackend) -> None:
    c = client(gated, max_running=1, max_waiting=0, retry_after_s=2)
    req = {"model": "fake-model", "messages": HELLO, "max_tokens": 2}
    results: list[int] = []
    t = threading.Thread(target=lambda: results.append(c.post(CHAT, json=req).status_code))
    t.start()
    deadline = time.monotonic() + 5
    while not gated.started and time.monotonic() < deadline:
        time.sleep(0.01)
    r = c.post(CHAT, json=req)
    assert r.status_code == 429 and r.headers["retry-after"] == "2"
    assert r.json()["error"]["type"] == "rate_limit_error"
    assert c.get("/metrics").text.count("tandem:num_requests_running 1.0") == 1
    assert gated.gate is not None
    gated.gate.set()
    t.join(10)
    assert results == [200]
    assert c.post(CHAT, json=req).status_code == 200


def test_queued_request_waits_and_times_out_as_429(gated: FakeBackend) -> None:
    c = client(gated, max_running=1, max_waiting=4, queue_timeout_s=0.3)
    req = {"model": "fake-model", "messages": HELLO, "max_tokens": 2}
    t = threading.Thread(target=lambda: c.post(CHAT, json=req))
    t.start()
    while not gated.started:
        time.sleep(0.01)
    r = c.post(CHAT, json=req)
    assert r.status_code == 429 and "queue" in r.json()["error"]["message"]
    assert gated.gate is not None
    gated.gate.set()
    t.join(10)


def test_retry_on_another_pair_before_the_first_token(backend: FakeBackend) -> None:
    backend.workers = [worker("p0", "prefill"), worker("p1", "prefill", waiting=3), worker("d0", "decode")]
    backend.fail_before_first = {"p0"}
    c = client(backend)
    r = c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 3})
    assert r.status_code == 200, r.text
    timing = json.loads(r.headers["x-tandem-timing"])
    assert timing["prefill_worker"] == "p1" and timing["attempts"] == 2
    assert backend.routes[0].prefill == "p0" and backend.routes[-1].prefill == "p1"  # a pair before one pool whole
    assert sample(c.get("/metrics").text, "tandem:request_retries_total") == 1
    assert sorted(backend.closed) == sorted(backend.started)
    backend.fail_before_first = {"d0", "p0", "p1"}  # every worker fails: a clean 503
    r = c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 3})
    assert (
        r.status_code == 503 and r.headers["retry-after"] and r.json()["error"]["code"] in ("no_worker", "worker_error")
    )


def test_a_retry_avoids_the_worker_that_failed_even_for_one_pool_whole(backend: FakeBackend) -> None:
    """1P+1D with a dead decode worker the view still lists: the retry avoids it first (the
    failure names it), and the prefill worker runs the request whole (cross_pool), rather than a
    local route on the dead worker."""
    backend.workers = [worker("p0", "prefill"), worker("d0", "decode")]
    backend.fail_before_first = {"d0"}
    r = client(backend).post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 3})
    assert r.status_code == 200, r.text
    timing = json.loads(r.headers["x-tandem-timing"])
    assert timing["attempts"] == 2 and timing["decode_worker"] == timing["prefill_worker"] == "p0", timing


def _asgi_request(app: Any, path: str, body: dict[str, Any], disconnect_when: Any) -> list[dict[str, Any]]:
    """Drive the app over raw ASGI; the client goes away once `disconnect_when(sent)` is true."""
    raw = json.dumps(body).encode()
    sent: list[dict[str, Any]] = []

    async def main() -> None:
        gone = asyncio.Event()
        inbox = [{"type": "http.request", "body": raw, "more_body": False}]

        async def receive() -> dict[str, Any]:
            if inbox:
                return inbox.pop(0)
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        async def watch() -> None:
            while not disconnect_when(sent):
                await asyncio.sleep(0.005)
            gone.set()

        scope = {
            "type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "headers": [(b"content-type", b"application/json")],
            "client": ("127.0.0.1", 40000), "server": ("127.0.0.1", 8000),
        }  # fmt: skip
        watcher = asyncio.create_task(watch())
        await asyncio.wait_for(app(scope, receive, send), 5)
        watcher.cancel()

    asyncio.run(main())
    return sent


def _until(cond: Any, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.005)
    return bool(cond())


@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_closes_the_backend_stream(backend: FakeBackend, stream: bool, n: int) -> None:
    backend.token_delay_s = 0.01
    app = create_app(backend, RouterSettings())
    body = {"model": "fake-model", "messages": HELLO, "max_tokens": 400, "stream": stream, "n": n}
    t0 = time.monotonic()
    if stream:
        sent = _asgi_request(app, CHAT, body, lambda s: sum(b'"content"' in m.get("body", b"") for m in s) >= 3)
    else:
        sent = _asgi_request(app, CHAT, body, lambda s: time.monotonic() - t0 > 0.3)
    assert _until(lambda: sorted(backend.closed) == sorted(backend.started) and len(backend.started) == n, 1.0)
    assert time.monotonic() - t0 < 2.0  # long before the 400 tokens (4 s) would have run
    assert not any(b"[DONE]" in m.get("body", b"") for m in sent)
    ok = create_app(backend, RouterSettings())  # and the router still serves
    assert TestClient(ok).post(CHAT, json={**body, "max_tokens": 2}).status_code == 200
    assert _until(lambda: app.state.dispatcher.admission.running == 0, 1.0)  # every choice gave its slot back


def test_admission_priority_order_and_bounds() -> None:
    async def main() -> list[int]:
        adm = Admission(max_running=1, max_waiting=2, max_waiting_total=3)
        assert await adm.acquire(0, 1.0) == 0.0
        order: list[int] = []

        async def waiter(p: int) -> None:
            await adm.acquire(p, 5.0)
            order.append(p)
            adm.release()

        tasks = [asyncio.create_task(waiter(p)) for p in (5, 1, 5)]
        await asyncio.sleep(0.01)
        assert adm.waiting == 3
        with pytest.raises(Saturated):  # priority 5 holds its 2, and 3 wait in all
            await adm.acquire(5, 1.0)
        with pytest.raises(Saturated):
            await adm.acquire(0, 1.0)
        cancelled = asyncio.create_task(adm.acquire(1, 5.0))
        await asyncio.sleep(0)
        cancelled.cancel()  # (it was refused anyway: the queue is full) and leaves no trace
        await asyncio.gather(cancelled, return_exceptions=True)
        adm.release()
        await asyncio.gather(*tasks)
        assert adm.running == 0 and adm.waiting == 0
        with pytest.raises(Saturated):  # a wait that times out
            adm.running = 1
            await adm.acquire(0, 0.01)
        assert adm.waiting == 0
        return order

    assert asyncio.run(main()) == [1, 5, 5]


def test_a_waiter_cancelled_as_its_slot_is_granted_gives_the_slot_back() -> None:
    """The client leaves in the same turn of the loop that a release hands its queued request
    the slot. Python 3.11's `asyncio.wait_for` returned the grant then and dropped the
    cancellation: the request ran on for a client that was gone, and an n > 1 response's
    choice held its slot (and its pump) for good."""

    async def main() -> None:
        adm = Admission(max_running=1, max_waiting=4, max_waiting_total=4)
        assert await adm.acquire(0, 1.0) == 0.0
        queued = asyncio.create_task(adm.acquire(0, 5.0))
        await asyncio.sleep(0.01)
        adm.release()  # granted ...
        queued.cancel()  # ... and cancelled before it runs again
        with pytest.raises(asyncio.CancelledError):
            await queued
        assert (adm.running, adm.waiting) == (0, 0)
        assert await adm.acquire(0, 0.01) == 0.0 and adm.running == 1, "the slot is free again"

    asyncio.run(main())


def test_the_running_bound_follows_the_pools_size() -> None:
    """Admission's bound read from a function at each acquire and release: waiters take the
    slots a bigger pool adds at once; a smaller one lets running requests finish first."""

    async def main() -> None:
        size = [1]
        adm = Admission(lambda: size[0], max_waiting=8, max_waiting_total=8)
        assert await adm.acquire(0, 1.0) == 0.0
        waiters = [asyncio.create_task(adm.acquire(0, 5.0)) for _ in range(3)]
        await asyncio.sleep(0.01)
        assert (adm.running, adm.waiting) == (1, 3)
        size[0] = 3  # a worker joined: the next acquire or release sees it
        with pytest.raises(Saturated):  # (still queued behind the three)
            await adm.acquire(0, 0.01)
        await asyncio.sleep(0)
        assert (adm.running, adm.waiting) == (3, 1) and sum(w.done() for w in waiters) == 2
        size[0] = 1  # two workers left: the running finish, their slots go with them
        adm.release()
        assert (adm.running, adm.waiting) == (2, 1)
        adm.release()
        assert (adm.running, adm.waiting) == (1, 1)
        adm.release()  # under the bound again: the last waiter takes the slot
        await asyncio.gather(*waiters)
        assert (adm.running, adm.waiting) == (1, 0)
        adm.release()
        assert adm.running == 0

    asyncio.run(main())


def test_the_router_runs_requests_for_each_worker_that_streams_unless_told() -> None:
    assert RouterSettings().running_bound(0) == 64  # none up yet: as one
    assert RouterSettings().running_bound(3) == 192
    assert RouterSettings(max_running=5).running_bound(3) == 5
    workers = [worker("p0", "prefill"), worker("d0", "decode"), worker("d1", "decode", draining=True),
               worker("d2", "decode", state="starting"), worker("c0", "colocated")]  # fmt: skip
    assert serving_from(workers) == 2
