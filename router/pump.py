"""ThreadPump: a blocking iterator (a cluster token stream) driven from asyncio.

The iterator is created, advanced and closed on the pump's own thread only, so `close()` is
safe at any moment: a `next` in progress finishes first, then the iterator's `close()` runs its
`finally` (the cluster's abort, which frees the request's KV) on that thread. An iterator with a
thread-safe `cancel()` (cluster.request_run.RequestRun) is also cancelled by `close()` at once,
so a `next` blocked in a queue, a prefill or a transfer ends now instead of when its work is
done.

The thread reads ahead, up to READ_AHEAD items, into a buffer the event loop takes from with
no hop at all; it wakes the loop only when the loop is waiting. Asking the thread for each item
in turn cost two thread switches and a self-pipe wake-up an item: about 60% of the router's
own work over a null backend (py-spy, `tandem bench router --null-only`). A slow client holds
READ_AHEAD items at most; the worker has produced them already either way.

Pumps run on a shared pool of threads that outlive them: starting a thread per request cost
the event loop ~0.4 ms (`Thread.start` waits for the thread to run). The pool grows to as many
pumps as run at once; admission (router.admission) bounds that.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")

READ_AHEAD = 64
_POOL = ThreadPoolExecutor(max_workers=4096, thread_name_prefix="pump")


class ThreadPump(Generic[T]):
    def __init__(self, make: Callable[[], Iterator[T]], name: str = "pump", read_ahead: int = READ_AHEAD) -> None:
        self._loop = asyncio.get_running_loop()
        self._room = threading.Condition()  # guards everything below; the thread waits on it for room
        self._items: deque[T] = deque()
        self._read_ahead = read_ahead
        self._done = False  # the iterator ended or raised
        self._error: BaseException | None = None  # what it raised, until `next` raises it
        self._waiter: asyncio.Future[None] | None = None  # the loop's `next`, waiting for an item
        self._it: Iterator[T] | None = None
        self._closing = False  # `close` was called: `next` answers None from then on
        self.closed = threading.Event()  # set once the iterator is closed and the thread is done
        self.name = name
        _POOL.submit(self._run, make)

    async def next(self) -> T | None:
        """The next item, None at the end (or after `close`); raises what the iterator raised."""
        while True:
            with self._room:
                if self._items:
                    if len(self._items) == self._read_ahead:
                        self._room.notify()
                    return self._items.popleft()
                if self._closing:
                    return None
                if self._done:
                    error, self._error = self._error, None
                    if error is not None:
                        raise error
                    return None
                waiter = self._waiter = self._loop.create_future()
            await waiter

    def close(self) -> None:
        """Stop: close the iterator after any `next` in progress. Idempotent, never blocks."""
        with self._room:
            self._closing = True
            self._items.clear()
            self._room.notify()
            waiter, self._waiter = self._waiter, None
        self._wake(waiter)
        cancel = getattr(self._it, "cancel", None)
        if cancel is not None:
            cancel()

    def _run(self, make: Callable[[], Iterator[T]]) -> None:
        it: Iterator[T] | None = None
        threading.current_thread().name = self.name
        try:
            it = self._it = make()
            if self._closing:  # closed while it was being made
                getattr(it, "cancel", lambda: None)()
            while self._has_room():
                self._put(next(it))
        except StopIteration:
            self._end(None)
        except BaseException as e:  # the iterator, or `make`, raised
            self._end(e)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
            self.closed.set()

    def _has_room(self) -> bool:
        """Wait until the buffer has room; False once the pump is closed."""
        with self._room:
            while not self._closing and len(self._items) >= self._read_ahead:
                self._room.wait()
            return not self._closing

    def _put(self, item: T) -> None:
        with self._room:
            if self._closing:
                return
            self._items.append(item)
            waiter, self._waiter = self._waiter, None
        self._wake(waiter)

    def _end(self, error: BaseException | None) -> None:
        with self._room:
            self._done, self._error = True, error
            waiter, self._waiter = self._waiter, None
        self._wake(waiter)

    def _wake(self, waiter: asyncio.Future[None] | None) -> None:
        """Wake the loop's waiting `next`, from any thread."""
        if waiter is not None:
            with contextlib.suppress(RuntimeError):  # the event loop is already closed
                self._loop.call_soon_threadsafe(_settle, waiter)


def _settle(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():  # the asker may have been cancelled
        waiter.set_result(None)
