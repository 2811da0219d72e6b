"""A full pool is a queue (router/room_wait.py): a request that finds every worker full waits
for room until its queue deadline, then gets 429 with Retry-After; a client that leaves ends
the wait; the oldest waiter gets room first. Directly, and through the real router app on a fake
backend whose routing says "full"."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from cluster.cluster import NoRoomError, NoWorkerError
from cluster.routing import Route
from engine.tokenizer import Tokenizer
from router.errors import Saturated
from router.room_wait import RoomQueue
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client
from tests.unit.kv_harness import wait_for

ROUTE = Route("d0", "p0")


def full_for(n: int) -> tuple[list[int], Callable[[], Route]]:
    calls: list[int] = []

    def route() -> Route:
        calls.append(1)
        if len(calls) <= n:
            raise NoRoomError("every worker that could run this request is full")
        return ROUTE

    return calls, route


def route_when_room(route: Callable[[], Route], deadline: float, cancel: threading.Event) -> Route:
    """One request alone in a router's queue."""
    room = RoomQueue()
    try:
        return room.route(route, time.monotonic(), deadline, cancel)
    finally:
        room.check_integrity()
        assert room.waiting == 0


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


class Pool:
    """Room for `free` requests (a request that routes takes one), given back by `finish`."""

    def __init__(self) -> None:
        self.free = 0
        self.lock = threading.Lock()
        self.served: list[str] = []

    def router(self, name: str) -> Callable[[], Route]:
        def route() -> Route:
            with self.lock:
                if self.free == 0:
                    raise NoRoomError("every worker that could run this request is full")
                self.free -= 1
                self.served.append(name)
            return ROUTE

        return route

    def finish(self) -> None:
        with self.lock:
            self.free += 1


def waiter(room: RoomQueue, pool: Pool, name: str, arrival: float, deadline: float, cancel: threading.Event) -> Waiter:
    w = Waiter(room, pool.router(name), arrival, deadline, cancel)
    w.start()
    return w


class Waiter(threading.Thread):
    """A request waiting for room on its own thread; `outcome`: its route, or what it raised."""

    def __init__(
        self, room: RoomQueue, route: Callable[[], Route], arrival: float, deadline: float, cancel: threading.Event
    ) -> None:
        super().__init__(daemon=True)
        self.args_ = (route, arrival, deadline, cancel)
        self.room = room
        self.outcome: Route | Exception | None = None

    def run(self) -> None:
        try:
            self.outcome = self.room.route(*self.args_)
        except (NoRoomError, Saturated) as e:
            self.outcome = e


def test_room_goes_to_the_oldest_waiter_and_newcomers_queue_behind() -> None:
    """Four requests wait on a full pool (arrivals t0 + 0..3, queued in another order, one of them
    a retry whose arrival is the oldest); room comes back one request at a time, and a fifth that
    arrives while they wait does not take it before them."""
    room, pool, t0 = RoomQueue(), Pool(), time.monotonic()
    arrivals = (("c", 2.0), ("a", 0.0), ("d", 3.0), ("retry", -5.0))
    waiters = [waiter(room, pool, n, t0 + a, t0 + 30, threading.Event()) for n, a in arrivals]
    assert wait_for(lambda: room.waiting == 4)
    room.check_integrity()
    waiters.append(waiter(room, pool, "late", t0 + 10, t0 + 30, threading.Event()))
    for served in range(1, 6):
        pool.finish()
        assert wait_for(lambda n=served: len(pool.served) == n), pool.served  # type: ignore[misc]
        room.check_integrity()
    for w in waiters:
        w.join(5)
        assert w.outcome == ROUTE
    assert pool.served == ["retry", "a", "c", "d", "late"] and room.waiting == 0


def test_a_waiter_that_leaves_or_times_out_lets_the_next_one_route() -> None:
    room, pool, t0 = RoomQueue(), Pool(), time.monotonic()
    cancel = threading.Event()
    first = waiter(room, pool, "first", t0, t0 + 30, cancel)
    assert wait_for(lambda: room.waiting == 1)
    second = waiter(room, pool, "second", t0 + 1, t0 + 30, threading.Event())
    assert wait_for(lambda: room.waiting == 2)
    cancel.set()  # its client left
    first.join(5)
    assert isinstance(first.outcome, NoRoomError) and room.waiting == 1
    pool.finish()
    second.join(5)
    assert second.outcome == ROUTE and pool.served == ["second"] and room.waiting == 0
    # one behind a waiter with a later deadline times out at its own, not at the other's
    blocker = waiter(room, pool, "blocker", t0, time.monotonic() + 1.0, threading.Event())
    assert wait_for(lambda: room.waiting == 1)
    behind = waiter(room, pool, "behind", t0 + 1, time.monotonic() + 0.2, threading.Event())
    behind.join(5)
    assert isinstance(behind.outcome, Saturated) and room.waiting == 1
    blocker.join(5)
    assert isinstance(blocker.outcome, Saturated) and room.waiting == 0
    room.check_integrity()
