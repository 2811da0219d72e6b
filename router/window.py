"""LoadWindow: the requests the router finished since the last look, for the autoscaler.

The dispatcher records every request it finishes (one append under a lock, on the event loop);
the autoscaler's thread takes the window every interval: arrival rate, prompt and answer
lengths, TTFT and TPOT of each request. A request that failed (not a client's bad input: 4xx
other than 429 is the client's) counts as missing both SLOs. At most `keep` requests are held;
past that the oldest go (the rate still counts them).
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from dataclasses import dataclass


@dataclass(frozen=True)
class Sample:
    arrival: float  # monotonic seconds
    prompt: int
    output: int
    ttft_s: float  # inf when the request failed
    tpot_s: float  # 0 for a one-token answer; inf when the request failed


@dataclass(frozen=True)
class Taken:
    seconds: float
    requests: int  # finished in the window, failed ones included
    samples: tuple[Sample, ...]  # the latest `keep` of them, oldest first


class LoadWindow:
    def __init__(self, keep: int = 4096) -> None:
        self._lock = threading.Lock()
        self._samples: deque[Sample] = deque(maxlen=keep)
        self._count = 0
        self._since = time.monotonic()

    def record(self, arrival: float, prompt: int, output: int, ttft_s: float, tpot_s: float) -> None:
        with self._lock:
            self._samples.append(Sample(arrival, prompt, output, ttft_s, tpot_s))
            self._count += 1

    def record_failure(self, arrival: float, prompt: int) -> None:
        self.record(arrival, prompt, 1, math.inf, math.inf)

    def take(self) -> Taken:
        """The window since the last take, and a new one started."""
        now = time.monotonic()
        with self._lock:
            samples, count, since = tuple(self._samples), self._count, self._since
            self._samples.clear()
            self._count, self._since = 0, now
        return Taken(now - since, count, samples)
