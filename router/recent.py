"""RecentRequests: the last requests the router finished, for the console's charts and waterfall.

One typed record a request (its timing breakdown and the workers that served it), kept in a
bounded ring; `summary` gives the live figures over a trailing span. Appends happen on the event
loop, reads on a worker thread: a lock guards the ring, held only to copy it.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from router.trace import Trace

PARTS = ("queue_s", "route_s", "prefill_s", "transfer_s", "first_decode_s", "decode_s")


@dataclass(frozen=True)
class RequestRecord:
    request_id: str
    finished_at: float  # wall clock, seconds
    status: int
    ttft_s: float
    tpot_s: float | None  # None for fewer than two tokens
    prompt_tokens: int
    completion_tokens: int
    parts: tuple[float, ...]  # PARTS, seconds
    prefill_worker: str | None
    decode_worker: str | None

    @classmethod
    def of(cls, t: Trace) -> RequestRecord:
        timing = t.timing()
        n = t.completion_tokens
        tpot = (t.t_last - t.t_first) / (n - 1) if n > 1 and t.t_first else None
        return cls(t.request_id, time.time(), t.status, timing["ttft_s"] if t.t_first else 0.0, tpot,
                   t.prompt_tokens, n, tuple(float(timing[p]) for p in PARTS), timing["prefill_worker"],
                   timing["decode_worker"])  # fmt: skip


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    return xs[0] if len(xs) == 1 else statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


class RecentRequests:
    def __init__(self, keep: int = 200) -> None:
        self._lock = threading.Lock()
        self._ring: deque[RequestRecord] = deque(maxlen=keep)

    def record(self, trace: Trace) -> None:
        rec = RequestRecord.of(trace)
        with self._lock:
            self._ring.append(rec)

    def last(self, n: int) -> list[RequestRecord]:
        with self._lock:
            return list(self._ring)[-n:]

    def summary(self, span_s: float = 30.0) -> dict[str, Any]:
        """TTFT and TPOT p50/p90 and output tokens a second over the last `span_s` seconds."""
        now = time.time()
        with self._lock:
            recent = [r for r in self._ring if now - r.finished_at <= span_s and r.status == 200]
        ttft = [r.ttft_s for r in recent]
        tpot = [r.tpot_s for r in recent if r.tpot_s is not None]
        return {
            "at": now, "span_s": span_s, "requests": len(recent),
            "ttft_p50_s": _pct(ttft, 50), "ttft_p90_s": _pct(ttft, 90),
            "tpot_p50_s": _pct(tpot, 50), "tpot_p90_s": _pct(tpot, 90),
            "tokens_per_s": sum(r.completion_tokens for r in recent) / span_s,
        }  # fmt: skip


def as_json(r: RequestRecord) -> dict[str, Any]:
    d = asdict(r)
    d["parts"] = dict(zip(PARTS, r.parts, strict=True))
    return d
