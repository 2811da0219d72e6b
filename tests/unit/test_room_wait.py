"""A full pool is a queue (router/room_wait.py): a request that finds every worker full waits
for room until its queue deadline, then gets 429 with Retry-After; a client that leaves ends
the wait. Through the real router app on a fake backend whose routing says "full"."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from cluster.cluster import NoRoomError, NoWorkerError
from cluster.routing import Route
from engine.tokenizer import Tokenizer
from router.errors import Saturated
from router.room_wait import route_when_room
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client

ROUTE = Route("d0", "p0")


def full_for(n: int) -> tuple[list[int], Callable[[], Route]]:
    calls: list[int] = []

    def route() -> Route:
        calls.append(1)
        if len(calls) <= n:
            raise NoRoomError("every worker that could run this request is full")
        return ROUTE

    return calls, route


def test_a_request_waits_for_room_and_then_runs() -> None:
    calls, route = full_for(3)
    assert route_when_room(route, time.monotonic() + 5, threading.Event()) == ROUTE
    assert len(calls) == 4


def test_past_its_deadline_it_is_told_the_server_is_at_capacity() -> None:
    _, route = full_for(10**6)
    t0 = time.monotonic()
    with pytest.raises(Saturated):
        route_when_room(route, t0 + 0.2, threading.Event())
    assert 0.2 <= time.monotonic() - t0 < 1.0


def test_a_client_that_leaves_ends_the_wait_and_no_worker_is_not_waited_for() -> None:
    _, route = full_for(10**6)
    cancel = threading.Event()
    threading.Timer(0.1, cancel.set).start()
    t0 = time.monotonic()
    with pytest.raises(NoRoomError):
        route_when_room(route, t0 + 30, cancel)
    assert time.monotonic() - t0 < 1.0

    def nobody() -> Route:
        raise NoWorkerError("no worker pair is up")

    with pytest.raises(NoWorkerError):
        route_when_room(nobody, time.monotonic() + 30, threading.Event())


def test_through_the_router_a_full_pool_delays_the_answer_and_then_says_429(smollm_tokenizer: Tokenizer) -> None:
    backend = FakeBackend(smollm_tokenizer)
    c = client(backend, queue_timeout_s=0.5)
    body = {"model": "fake-model", "messages": HELLO, "max_tokens": 4}
    backend.control_error = NoRoomError("every worker that could run this request is full")
    threading.Timer(0.3, lambda: setattr(backend, "control_error", None)).start()  # a request there finished
    t0 = time.monotonic()
    r = c.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    assert time.monotonic() - t0 >= 0.25
    backend.control_error = NoRoomError("every worker that could run this request is full")
    r = c.post(CHAT, json=body)
    assert r.status_code == 429 and r.headers["retry-after"], r.text
    assert r.json()["error"]["code"] == "rate_limit_exceeded" and "room" in r.json()["error"]["message"]
