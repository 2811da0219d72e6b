"""router.pump.ThreadPump: order, bounded read-ahead, errors, and close at any moment."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from router.pump import ThreadPump


class Source:
    """An iterator of 0..n-1 that records how far it was advanced, where it was closed, and
    can block before an item until released or cancelled (like cluster.request_run.RequestRun)."""

    def __init__(self, n: int, block_at: int = -1, fail_at: int = -1) -> None:
        self.n, self.block_at, self.fail_at = n, block_at, fail_at
        self.advanced = 0
        self.release = threading.Event()
        self.cancelled = threading.Event()
        self.closed_on: str | None = None

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        i = self.advanced
        if i == self.block_at:
            self.release.wait(10)
            if self.cancelled.is_set():
                raise RuntimeError("cancelled")
        if i == self.fail_at:
            raise ValueError(f"failed at {i}")
        if i >= self.n:
            raise StopIteration
        self.advanced += 1
        return i

    def cancel(self) -> None:
        self.cancelled.set()
        self.release.set()

    def close(self) -> None:
        self.closed_on = threading.current_thread().name


async def drain(pump: ThreadPump[int]) -> list[int]:
    out = []
    while (item := await pump.next()) is not None:
        out.append(item)
    return out


def test_items_in_order_then_none() -> None:
    async def main() -> None:
        src = Source(200)
        pump = ThreadPump(lambda: src, name="pump-order", read_ahead=8)
        assert await drain(pump) == list(range(200))
        assert await pump.next() is None
        assert pump.closed.wait(5)
        assert src.closed_on == "pump-order"  # closed on the pump's thread

    asyncio.run(main())


def test_read_ahead_is_bounded() -> None:
    async def main() -> None:
        src = Source(100)
        pump = ThreadPump(lambda: src, read_ahead=4)
        assert await pump.next() == 0
        await asyncio.sleep(0.2)  # the thread fills its buffer, then waits for room
        assert src.advanced == 1 + 4
        assert await pump.next() == 1
        await asyncio.sleep(0.2)
        assert src.advanced == 2 + 4
        pump.close()
        assert pump.closed.wait(5)

    asyncio.run(main())


def test_error_after_the_items_before_it_then_none() -> None:
    async def main() -> None:
        pump = ThreadPump(lambda: Source(10, fail_at=3))
        assert [await pump.next() for _ in range(3)] == [0, 1, 2]
        with pytest.raises(ValueError, match="failed at 3"):
            await pump.next()
        assert await pump.next() is None

    asyncio.run(main())


def test_make_raising_is_raised_by_next() -> None:
    def make() -> Iterator[int]:
        raise LookupError("no route")

    async def main() -> None:
        pump = ThreadPump(make)
        with pytest.raises(LookupError, match="no route"):
            await pump.next()
        assert pump.closed.wait(5)

    asyncio.run(main())


def test_close_wakes_a_waiting_next_and_cancels_the_iterator() -> None:
    async def main() -> None:
        src = Source(10, block_at=2)
        pump = ThreadPump(lambda: src)
        assert [await pump.next() for _ in range(2)] == [0, 1]
        waiting = asyncio.ensure_future(pump.next())
        await asyncio.sleep(0.05)
        assert not waiting.done()
        pump.close()
        assert await asyncio.wait_for(waiting, 5) is None
        assert pump.closed.wait(5)
        assert src.cancelled.is_set() and src.closed_on is not None
        pump.close()  # idempotent
        assert await pump.next() is None

    asyncio.run(main())


def test_a_cancelled_next_loses_no_item() -> None:
    async def main() -> None:
        src = Source(3, block_at=1)
        pump = ThreadPump(lambda: src)
        assert await pump.next() == 0
        asker = asyncio.ensure_future(pump.next())
        await asyncio.sleep(0.05)
        asker.cancel()
        src.release.set()
        await asyncio.sleep(0.1)
        assert await drain(pump) == [1, 2]

    asyncio.run(main())
