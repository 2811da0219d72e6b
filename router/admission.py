"""Admission: a bounded number of requests in the backend, bounded queues in front of it.

    arrivals --> [ waiting, per priority: lowest value first, FIFO within one ] --> [ running ]
                  at most max_waiting per priority,                                at most max_running
                  max_waiting_total in all; beyond -> Saturated (429)

Memory stays bounded whatever the load: a request is either running, in a bounded queue, or refused.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from collections import Counter
from collections.abc import Callable

from router.errors import Saturated


class Admission:
    """Single event loop only (no locks). `acquire` then exactly one `release` per admitted request.
    `max_running` may be a function, read again at each acquire and release (the pools' size)."""

    def __init__(self, max_running: int | Callable[[], int], max_waiting: int, max_waiting_total: int) -> None:
        self._bound = max_running if callable(max_running) else None
        self.max_running = max_running() if callable(max_running) else max_running
        self.max_waiting = max_waiting
        self.max_waiting_total = max_waiting_total
        self.running = 0
        self._heap: list[tuple[int, int, asyncio.Future[None]]] = []
        self._waiting: Counter[int] = Counter()
        self._seq = itertools.count()

    @property
    def waiting(self) -> int:
        return sum(self._waiting.values())

    async def acquire(self, priority: int, timeout_s: float) -> float:
        """Wait for a running slot; returns the seconds waited.

        Raises Saturated at once when this priority's queue (or the whole queue) is full, or
        after `timeout_s` in the queue. Cancellation while queued leaves no trace."""
        self._follow()
        if self.running < self.max_running and not self._waiting:
            self.running += 1
            return 0.0
        if self._waiting[priority] >= self.max_waiting or self.waiting >= self.max_waiting_total:
            raise Saturated(f"{self.running} running, {self.waiting} waiting")
        t0 = time.monotonic()
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (priority, next(self._seq), fut)
        heapq.heappush(self._heap, entry)
        self._waiting[priority] += 1
        try:
            # not asyncio.wait_for: on Python 3.11 it returns a grant that comes as the waiter is
            # cancelled, and drops the cancellation (the request then ran for a client gone)
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(fut)
        except BaseException as e:
            if fut.done() and not fut.cancelled():  # granted just as we gave up: hand the slot on
                self.release()
            else:
                self._heap.remove(entry)
                heapq.heapify(self._heap)
                self._forget(priority)
            if isinstance(e, TimeoutError):
                raise Saturated(f"waited {timeout_s:.0f} s in the queue") from None
            raise
        return time.monotonic() - t0

    def release(self) -> None:
        """Give back a running slot; the first live waiter (by priority, then arrival) takes it,
        unless a resize left more running than the bound."""
        self._follow()
        if self._heap and self.running <= self.max_running:
            self._grant()
            return
        self.running -= 1

    def resize(self, max_running: int) -> None:
        """A new bound (the pools grew or shrank): waiters take the slots it adds now; a smaller
        one lets running requests finish, and their slots go."""
        self.max_running = max_running
        while self._heap and self.running < self.max_running:
            self.running += 1
            self._grant()

    def _follow(self) -> None:
        if self._bound is not None:
            self.resize(self._bound())

    def _grant(self) -> None:
        priority, _, fut = heapq.heappop(self._heap)
        self._forget(priority)
        fut.set_result(None)

    def _forget(self, priority: int) -> None:
        self._waiting[priority] -= 1
        if self._waiting[priority] <= 0:
            del self._waiting[priority]
