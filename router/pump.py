"""ThreadPump: a blocking iterator (a cluster token stream) driven from asyncio, one item per ask.

The iterator is created, advanced and closed on the pump's own thread only, so `close()` is
safe at any moment: a `next` in progress finishes first, then the iterator's `close()` runs its
`finally` (the cluster's abort, which frees the request's KV) on that thread. An iterator with a
thread-safe `cancel()` (cluster.request_run.RequestRun) is also cancelled by `close()` at once,
so a `next` blocked in a queue, a prefill or a transfer ends now instead of when its work is
done. Nothing is read ahead, so a slow client holds one item at most.

Pumps run on a shared pool of threads that outlive them: starting a thread per request cost
the event loop ~0.4 ms (`Thread.start` waits for the thread to run), measured against a null
backend (`tandem bench router --null-only`). The pool grows to as many pumps as run at once;
admission (router.admission) bounds that.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")


_POOL = ThreadPoolExecutor(max_workers=4096, thread_name_prefix="pump")


class ThreadPump(Generic[T]):
    def __init__(self, make: Callable[[], Iterator[T]], name: str = "pump") -> None:
        self._loop = asyncio.get_running_loop()
        self._asks: queue.SimpleQueue[asyncio.Future[T | None] | None] = queue.SimpleQueue()
        self._ended = False
        self._it: Iterator[T] | None = None
        self.closed = threading.Event()  # set once the iterator is closed and the thread is done
        self.name = name
        _POOL.submit(self._run, make)

    async def next(self) -> T | None:
        """The next item, None at the end (or after `close`); raises what the iterator raised."""
        if self._ended:
            return None
        fut: asyncio.Future[T | None] = self._loop.create_future()
        self._asks.put(fut)
        return await fut

    def close(self) -> None:
        """Stop: close the iterator after any `next` in progress. Idempotent, never blocks."""
        self._ended = True
        self._asks.put(None)
        cancel = getattr(self._it, "cancel", None)
        if cancel is not None:
            cancel()

    def _run(self, make: Callable[[], Iterator[T]]) -> None:
        it: Iterator[T] | None = None
        threading.current_thread().name = self.name
        try:
            while (fut := self._asks.get()) is not None:
                try:
                    if it is None:
                        it = self._it = make()
                        if self._ended:  # closed while it was being made
                            getattr(it, "cancel", lambda: None)()
                    item = next(it)
                except StopIteration:
                    self._ended = True
                    self._deliver(fut, None, None)
                    return
                except BaseException as e:
                    self._ended = True
                    self._deliver(fut, None, e)
                    return
                self._deliver(fut, item, None)
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()
            self.closed.set()

    def _deliver(self, fut: asyncio.Future[T | None], item: T | None, error: BaseException | None) -> None:
        def settle() -> None:
            if fut.done():  # the asker was cancelled
                return
            if error is not None:
                fut.set_exception(error)
            else:
                fut.set_result(item)

        with contextlib.suppress(RuntimeError):  # the event loop is already closed
            self._loop.call_soon_threadsafe(settle)
