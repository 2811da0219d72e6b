"""The open Push streams of one KV server: how many may be open, and how long one may idle.

Each open stream holds a server thread, so their number is capped (`max_streams`; one more
is refused with RESOURCE_EXHAUSTED at once) and the server keeps threads beyond the cap for
Reserve, Release and health checks: control calls never wait behind Push streams. A stream
that sends nothing for `idle_s` (a stopped or wedged sender) is cancelled by `cut_idle`; its
handler then releases the reservation.

    open ──message──▶ busy ──handled──▶ idle ──message──▶ busy ...
      \\____________________________________\\__ idle_s without a message: cut
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import grpc


@dataclass
class _Stream:
    ctx: grpc.ServicerContext
    last: float
    busy: bool = False
    cut: bool = False


class PushStreams:
    """Thread-safe: handler threads open, mark and close; the reaper cuts."""

    def __init__(self, max_streams: int, idle_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if max_streams < 1 or idle_s <= 0:
            raise ValueError("max_streams must be >= 1 and idle_s positive")
        self.max_streams = max_streams
        self.idle_s = idle_s
        self.clock = clock
        self._lock = threading.Lock()
        self._open: dict[int, _Stream] = {}
        self._ids = itertools.count()

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def open(self, ctx: grpc.ServicerContext) -> int | None:
        """A key for the new stream, or None if `max_streams` are open already. Never waits."""
        with self._lock:
            if len(self._open) >= self.max_streams:
                return None
            key = next(self._ids)
            self._open[key] = _Stream(ctx, self.clock())
            return key

    def mark(self, key: int, busy: bool) -> None:
        """The stream got a message (busy: a handler is on it, not idle) or finished one."""
        with self._lock:
            s = self._open[key]
            s.busy, s.last = busy, self.clock()

    def was_cut(self, key: int) -> bool:
        with self._lock:
            return self._open[key].cut

    def close(self, key: int) -> None:
        with self._lock:
            self._open.pop(key, None)

    def cut_idle(self) -> int:
        """Cancel every stream idle for `idle_s`; returns how many. The cancellation wakes the
        handler's read with an error, so it runs its own cleanup."""
        now = self.clock()
        with self._lock:
            idle = [s for s in self._open.values() if not s.busy and not s.cut and now - s.last >= self.idle_s]
            for s in idle:
                s.cut = True
        for s in idle:
            s.ctx.cancel()
        return len(idle)
