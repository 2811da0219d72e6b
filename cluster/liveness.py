"""How the request path waits on workers, with no fixed deadline: `Waits` (its knobs) and
`Liveness`, which pings the workers a wait depends on once nothing has progressed for a while.
A long prompt, a long queue or a big batch is not a failure; a dead or frozen worker is, within
`stall_s + liveness_s`, and ends the attempt with AttemptFailed (cluster.handoff).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import ray

from engine.errors import EngineError, StreamError


class AttemptFailed(EngineError):
    """An attempt broke. `suspect` is the worker that failed, when that is known."""

    def __init__(self, message: str, suspect: str | None = None) -> None:
        super().__init__(message)
        self.suspect = suspect


class EngineFault(AttemptFailed):
    """The worker's engine failed on the request (engine/containment.py); the worker serves on."""


def failure_of(entry: str, worker: str) -> AttemptFailed:
    """What an error in `worker`'s feed (an exception's "Name: text", engine/outbox.py) means: the
    engine loop's StreamError, that its engine failed on the request; anything else, that the
    attempt broke there."""
    fault = EngineFault if entry.startswith(f"{StreamError.__name__}:") else AttemptFailed
    return fault(f"worker {worker}: {entry}", worker)


class Cancelled(EngineError):
    """The request was cancelled (its client went away)."""


def let_go(ref: Any) -> None:
    """Read `ref`'s result whenever it comes, and drop it: for a call nobody waits on any more
    (its request cancelled or failed, or fire-and-forget). Dropped unread, a call that ended in
    an error has Ray log it with its traceback as an "Unhandled error" (a client hanging up
    mid-prefill did, on every such request)."""
    with contextlib.suppress(Exception):  # Ray going down: nothing left to log it
        ref.future()


@dataclass(frozen=True)
class Waits:
    """poll_s: how often a wait looks at `cancel`; stall_s: no progress for this long starts
    pinging the workers involved; liveness_s: a ping unanswered this long means the worker is
    frozen or gone; transfer_s: the decode side's wait for a committed transfer; lease_s: how
    long a decode reservation outlives its router's last renewal."""

    poll_s: float = 0.1
    stall_s: float = 1.0
    liveness_s: float = 3.0
    transfer_s: float = 15.0
    lease_s: float = 10.0


class Liveness:
    """Pings `workers` once nothing has progressed for `stall_s`; `check()` raises AttemptFailed
    when one of them is dead, or has not answered for `liveness_s`. `probes` replace a worker's
    ping by another call on it that answers as fast (it returns an ObjectRef)."""

    def __init__(
        self, workers: Mapping[str, Any], waits: Waits, probes: Mapping[str, Callable[[], Any]] | None = None
    ) -> None:
        self._probes = {wid: (probes or {}).get(wid, handle.ping.remote) for wid, handle in workers.items()}
        self._waits = waits
        self._pings: dict[str, tuple[Any, float]] = {}
        self._last = time.monotonic()

    def close(self) -> None:
        """Let go of the pings still out (the wait is over)."""
        for ref, _ in self._pings.values():
            let_go(ref)
        self._pings.clear()

    def progress(self) -> None:
        self._last = time.monotonic()
        self.close()  # the pings out are answered by the progress itself

    def check(self) -> None:
        now = time.monotonic()
        if now - self._last < self._waits.stall_s:
            return
        for wid, probe in self._probes.items():
            sent = self._pings.get(wid)
            if sent is None:
                self._pings[wid] = (probe(), now)
                continue
            ref, at = sent
            ready, _ = ray.wait([ref], timeout=0)
            if ready:
                try:
                    ray.get(ref)
                except Exception as e:
                    raise AttemptFailed(f"worker {wid} is gone ({type(e).__name__})", wid) from None
                del self._pings[wid]  # alive: ask again after another stall_s
                self._last = now
            elif now - at > self._waits.liveness_s:
                raise AttemptFailed(f"worker {wid} did not answer for {now - at:.1f} s", wid)
