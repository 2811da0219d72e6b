"""A full pool is a queue, not an error. When every worker that could run a request is up but
has no room for it (its KV blocks held by requests in flight), the request waits for room, as
an engine's own queue would, instead of failing at once: a burst of long prompts on one decode
worker answered 10 of 12 with 503 "retry later" while the other two ran. It waits until the
router's queue deadline (`queue_timeout_s` after it arrived, its admission wait included), then
gets the admission queue's answer: 429 with Retry-After. Routing is local (the view and the
ledger), so trying again every ROOM_POLL_S costs little.

The wait is first come, first served (`RoomQueue`): only the oldest waiter routes, and a request
that finds others waiting queues behind them rather than taking the room they wait for. When
every waiter tried on its own, the room a finished request left went to whichever looked first:
a long prompt could watch short ones take the blocks it waited for until its deadline, and the
requests that got their 429 were not the ones that had waited longest. Age is the request's
arrival, so a retry (its first pair failed) goes before requests that came after it.
"""

from __future__ import annotations

import heapq
import itertools
import threading
import time
from collections.abc import Callable

from cluster.placer import NoRoomError
from cluster.routing import Route
from router.errors import Saturated

ROOM_POLL_S = 0.1  # room comes back as requests end: seconds apart when every worker is full


class RoomQueue:
    """One per router. Thread-safe; no lock is held while routing."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._waiting: list[tuple[float, int]] = []  # a heap of (arrival, ticket): the oldest first
        self._tickets = itertools.count()

    @property
    def waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def route(self, route: Callable[[], Route], arrival: float, deadline: float, cancel: threading.Event) -> Route:
        """`route()`, once every request that arrived before this one and waits for room has
        routed or left, tried again while it raises NoRoomError, until `deadline` (monotonic;
        then Saturated) or `cancel` (the client left: NoRoomError)."""
        if not self.waiting:
            try:
                return route()
            except NoRoomError:
                pass  # wait in turn
        key = (arrival, next(self._tickets))
        with self._cond:
            heapq.heappush(self._waiting, key)
        try:
            while True:
                self._wait_turn(key, deadline, cancel)
                try:
                    return route()
                except NoRoomError as e:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise _saturated() from e
                    if cancel.wait(min(ROOM_POLL_S, left)):
                        raise
        finally:
            with self._cond:
                self._waiting.remove(key)
                heapq.heapify(self._waiting)
                self._cond.notify_all()  # the next one routes at once

    def _wait_turn(self, key: tuple[float, int], deadline: float, cancel: threading.Event) -> None:
        with self._cond:
            while self._waiting[0] != key:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise _saturated()
                if cancel.is_set():
                    raise NoRoomError("the client left while its request waited for room")
                self._cond.wait(min(ROOM_POLL_S, left))

    def check_integrity(self) -> None:
        with self._cond:
            assert sorted(self._waiting) == sorted(set(self._waiting)), "a waiter queued twice"
            assert not self._waiting or self._waiting[0] == min(self._waiting), "the heap's head is not the oldest"


def _saturated() -> Saturated:
    return Saturated("no worker has had room for this request within the queue's time")
