"""FairRLock: a reentrant lock handed to waiters in arrival order.

The engine loop takes the engine's lock for a step, lets go and takes it again at once. With
a plain lock the loop usually wins that race, so an abort, a reservation or a stats read can
wait for as long as the engine stays busy (a multi-second prefill starved an abort for 10 s).
Here a thread that releases and asks again queues behind everyone already waiting, so any
caller waits one step at most:

    loop:   [step]          [step]            [step]
    abort:    wait ──────▶ (its turn) [abort]
"""

from __future__ import annotations

import threading
from collections import deque
from types import TracebackType


class FairRLock:
    """Same use as threading.RLock (`with`, acquire/release, reentrant for its owner)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._owner: int | None = None
        self._depth = 0
        self._queue: deque[int] = deque()

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        me = threading.get_ident()
        with self._cond:
            if self._owner == me:
                self._depth += 1
                return True
            if self._owner is None and not self._queue:
                self._owner, self._depth = me, 1
                return True
            if not blocking:
                return False
            self._queue.append(me)
            turn = self._cond.wait_for(
                lambda: self._owner is None and self._queue[0] == me, None if timeout < 0 else timeout
            )
            if not turn:
                self._queue.remove(me)
                self._cond.notify_all()  # the next in line may be free to go now
                return False
            self._queue.popleft()
            self._owner, self._depth = me, 1
            return True

    def release(self) -> None:
        with self._cond:
            if self._owner != threading.get_ident():
                raise RuntimeError("release of a FairRLock this thread does not hold")
            self._depth -= 1
            if self._depth == 0:
                self._owner = None
                self._cond.notify_all()

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.release()
