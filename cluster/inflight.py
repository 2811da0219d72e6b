"""What this router has sent to each worker and not yet seen finish: the load it routes on.

Heartbeats are up to half a second old, so a burst routed on them herds onto whichever worker
looked emptiest (LESSONS 8). The ledger is updated on the request path itself:

    hold(route, blocks, prefill_tokens)           as begin, for a route picked but not started yet
                                                  (routing and starting are two calls: a burst
                                                  would see the same counts in between); the
                                                  next begin() on those workers takes it over,
                                                  an unused one lapses after HOLD_S
    begin(rid, route, blocks, prefill_tokens)     decode: +1 stream, +blocks
                                                  prefill: +prefill_tokens queued (a route with no
                                                  prefill worker queues them on its own worker:
                                                  a local or colocated one prefills there too)
    prefilled(rid, uncached_tokens, seconds)      prefill: -prefill_tokens; with seconds, the
                                                  per-token cost learns, and the longest prefill
                                                  of the last RECENT_S
    end(rid)                                      whatever is still counted for rid is taken back

`reconcile(live)` forgets workers that left the registry. Bookkeeping only: no Ray, no I/O.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

DEFAULT_PREFILL_S_PER_TOKEN = 1e-3  # until a worker has been measured: ~1,000 tok/s on a CPU
HOLD_S = 5.0
RECENT_S = 60.0  # how long a prefill counts in WorkerLoad.longest_prefill_s
_EWMA = 0.2


@dataclass(frozen=True)
class WorkerLoad:
    """One worker's in-flight work as this router counts it. `longest_prefill_s`: the longest
    prefill it ran for this router in the last RECENT_S (how long a step there may stall the
    streams it decodes)."""

    streams: int = 0
    blocks: int = 0
    prefill_tokens: int = 0
    prefill_s_per_token: float = DEFAULT_PREFILL_S_PER_TOKEN
    longest_prefill_s: float = 0.0


@dataclass
class _Entry:
    decode: str
    prefill: str  # the worker that prefills: `decode` itself for a route with no prefill worker
    blocks: int
    prefill_tokens: int  # still queued on `prefill`; 0 once prefilled


class InflightLedger:
    """Thread-safe; every method is O(1) but `loads()` and `check_integrity()`."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: dict[str, _Entry] = {}
        self._holds: list[tuple[float, _Entry]] = []  # (lapses at, entry), oldest first
        self._streams: dict[str, int] = {}
        self._blocks: dict[str, int] = {}
        self._tokens: dict[str, int] = {}
        self._cost: dict[str, float] = {}
        # worker -> (at, prefill seconds), the seconds decreasing: the first is the longest
        self._recent: dict[str, deque[tuple[float, float]]] = {}

    def hold(self, decode: str, prefill: str | None, blocks: int, prefill_tokens: int) -> None:
        """Count a route just picked until a begin() on the same workers takes it over."""
        with self._lock:
            self._lapse()
            e = _Entry(decode, prefill or decode, blocks, prefill_tokens)
            self._holds.append((self._clock() + HOLD_S, e))
            self._count(e, 1)

    def begin(self, request_id: str, decode: str, prefill: str | None, blocks: int, prefill_tokens: int) -> None:
        """Count a request on its route (taking over a hold on the same workers, if any).
        Raises ValueError if `request_id` is already counted."""
        with self._lock:
            if request_id in self._entries:
                raise ValueError(f"request {request_id!r} is already in flight")
            self._lapse()
            for i, (_, held) in enumerate(self._holds):
                if (held.decode, held.prefill) == (decode, prefill or decode):
                    del self._holds[i]
                    self._count(held, -1)
                    break
            e = self._entries[request_id] = _Entry(decode, prefill or decode, blocks, prefill_tokens)
            self._count(e, 1)

    def _count(self, e: _Entry, sign: int) -> None:
        _add(self._streams, e.decode, sign)
        _add(self._blocks, e.decode, sign * e.blocks)
        _add(self._tokens, e.prefill, sign * e.prefill_tokens)

    def _lapse(self) -> None:
        now = self._clock()
        while self._holds and self._holds[0][0] <= now:
            self._count(self._holds.pop(0)[1], -1)

    def prefilled(self, request_id: str, uncached_tokens: int = 0, seconds: float = 0.0) -> None:
        """The prefill of `request_id` is over: its tokens leave the prefill queue. With a
        measured time, the worker's per-token cost moves towards seconds / uncached_tokens."""
        with self._lock:
            e = self._entries.get(request_id)
            if e is None or e.prefill_tokens == 0:
                return
            _add(self._tokens, e.prefill, -e.prefill_tokens)
            e.prefill_tokens = 0
            if seconds > 0:  # a sliding-window maximum: what a later, longer prefill outlasts goes
                recent = self._recent.setdefault(e.prefill, deque())
                while recent and recent[-1][1] <= seconds:
                    recent.pop()
                recent.append((self._clock(), seconds))
            if uncached_tokens > 0 and seconds > 0:
                old = self._cost.get(e.prefill, DEFAULT_PREFILL_S_PER_TOKEN)
                self._cost[e.prefill] = (1 - _EWMA) * old + _EWMA * seconds / uncached_tokens

    def end(self, request_id: str) -> None:
        """Forget `request_id` (finished, failed or aborted). Idempotent."""
        with self._lock:
            e = self._entries.pop(request_id, None)
            if e is not None:
                self._count(e, -1)

    def load(self, worker_id: str) -> WorkerLoad:
        with self._lock:
            self._lapse()
            return self._load(worker_id)

    def loads(self, worker_ids: Iterable[str]) -> dict[str, WorkerLoad]:
        with self._lock:
            self._lapse()
            return {w: self._load(w) for w in worker_ids}

    def reconcile(self, live: Iterable[str]) -> list[str]:
        """Drop every request counted on a worker that is no longer live; returns their ids.

        Their streams fail on their own (the worker is gone); this only stops the dead worker's
        numbers from skewing routing in the meantime."""
        alive = set(live)
        with self._lock:
            gone = [r for r, e in self._entries.items() if e.decode not in alive or e.prefill not in alive]
            known = set(self._streams) | set(self._tokens) | set(self._cost)
        for rid in gone:
            self.end(rid)
        with self._lock:
            for w in (known | set(self._recent)) - alive:
                self._cost.pop(w, None)
                self._recent.pop(w, None)
        return gone

    def __len__(self) -> int:
        """Requests counted (holds not included)."""
        return len(self._entries)

    @property
    def num_holds(self) -> int:
        with self._lock:
            self._lapse()
            return len(self._holds)

    def check_integrity(self) -> None:
        """Raise AssertionError if the per-worker sums disagree with the entries."""
        with self._lock:
            streams: dict[str, int] = {}
            blocks: dict[str, int] = {}
            tokens: dict[str, int] = {}
            for e in [*self._entries.values(), *(h for _, h in self._holds)]:
                _add(streams, e.decode, 1)
                _add(blocks, e.decode, e.blocks)
                _add(tokens, e.prefill, e.prefill_tokens)
            assert streams == self._streams, f"streams {self._streams} != entries {streams}"
            assert blocks == self._blocks, f"blocks {self._blocks} != entries {blocks}"
            assert tokens == self._tokens, f"prefill tokens {self._tokens} != entries {tokens}"

    def _load(self, w: str) -> WorkerLoad:
        # an unmeasured worker is assumed as fast as the measured ones on average
        default = sum(self._cost.values()) / len(self._cost) if self._cost else DEFAULT_PREFILL_S_PER_TOKEN
        recent = self._recent.get(w)
        while recent and recent[0][0] <= self._clock() - RECENT_S:
            recent.popleft()
        return WorkerLoad(
            self._streams.get(w, 0),
            self._blocks.get(w, 0),
            self._tokens.get(w, 0),
            self._cost.get(w, default),
            recent[0][1] if recent else 0.0,
        )


def _add(counts: dict[str, int], key: str, n: int) -> None:
    """counts[key] += n, dropping keys that reach 0 so that the sums compare exactly."""
    v = counts.get(key, 0) + n
    if v:
        counts[key] = v
    else:
        counts.pop(key, None)
