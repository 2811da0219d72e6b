"""One autoscaler among several routers (`tandem serve --autoscale` on each of them).

Each router sees only the requests sent to it. If every router planned over its own window,
each would size the pools for its share of the traffic, and their decisions would undo each
other's. So one router decides: the one holding a lease in Redis (three intervals long, renewed
every interval; when it dies, another takes it within a lease). The others publish their window
every interval instead of deciding, and the deciding one plans over its own window merged with
theirs. Arrival times travel as wall-clock seconds and come back on the reader's monotonic clock.
So does the last change of sizes: a router that takes the lead over from one that died keeps
its cooldown instead of changing the sizes again at once, and knows which pool a worker was just
flipped to, so as not to flip it straight back (planner/autoscale.py).
"""

from __future__ import annotations

import json
import math
import time
import uuid
from dataclasses import replace
from typing import Protocol

from cluster.autoscale_store import AutoscaleStore, LastChange
from router.window import Sample, Taken

LEASE_INTERVALS = 3  # the lease outlives two missed rounds of its holder
KEEP_INTERVALS = 4  # windows no leader reads are dropped after this


class WindowShare(Protocol):
    def lead(self) -> bool:
        """Take or renew the lease: True if this router decides this round."""
        ...

    def publish(self, taken: Taken) -> None:
        """A standing-by router's window, for the one that decides."""
        ...

    def collect(self) -> list[Taken]:
        """The other routers' windows published since the last collect."""
        ...

    def changed(self, at: float, flipped_to: str | None) -> None:
        """This router changed the sizes at `at` (its monotonic clock), flipping a worker to
        `flipped_to` (None: no flip)."""
        ...

    def last_change(self) -> LastChange | None:
        """The last change of sizes, if another router made it (on this router's monotonic
        clock); None if none, or if this router's own was the last."""
        ...


def merged(mine: Taken, others: list[Taken]) -> Taken:
    """The traffic of every router over this router's window: requests summed, samples by arrival.
    The duration stays this router's: the others publish once an interval too."""
    samples = sorted((s for t in (mine, *others) for s in t.samples), key=lambda s: s.arrival)
    return Taken(mine.seconds, mine.requests + sum(t.requests for t in others), tuple(samples))


def encode(taken: Taken, wall_minus_mono: float) -> str:
    def num(x: float) -> float | str:
        return x if math.isfinite(x) else "inf"

    rows = [[s.arrival + wall_minus_mono, s.prompt, s.output, num(s.ttft_s), num(s.tpot_s)] for s in taken.samples]
    return json.dumps({"seconds": taken.seconds, "requests": taken.requests, "samples": rows})


def decode(payload: str, wall_minus_mono: float) -> Taken:
    d = json.loads(payload)
    rows = d["samples"]
    samples = tuple(Sample(float(a) - wall_minus_mono, int(p), int(o), float(f), float(t)) for a, p, o, f, t in rows)
    return Taken(float(d["seconds"]), int(d["requests"]), samples)


class RedisWindowShare:
    """WindowShare over the cluster's Redis (cluster/autoscale_store.py). Raises StateUnavailable
    while Redis is away (the autoscaler skips that round)."""

    def __init__(self, store: AutoscaleStore, interval_s: float, owner: str = "") -> None:
        self.store, self.interval_s = store, interval_s
        self.owner = owner or uuid.uuid4().hex

    def lead(self) -> bool:
        return self.store.lead(self.owner, self.interval_s * LEASE_INTERVALS)

    def publish(self, taken: Taken) -> None:
        self.store.push_window(encode(taken, _wall_minus_mono()), self.interval_s * KEEP_INTERVALS)

    def collect(self) -> list[Taken]:
        offset = _wall_minus_mono()
        return [decode(p, offset) for p in self.store.pop_windows()]

    def changed(self, at: float, flipped_to: str | None) -> None:
        self.store.set_last_change(LastChange(at + _wall_minus_mono(), flipped_to, self.owner))

    def last_change(self) -> LastChange | None:
        last = self.store.last_change()
        if last is None or last.by == self.owner:
            return None
        return replace(last, at_s=last.at_s - _wall_minus_mono())


def _wall_minus_mono() -> float:
    return time.time() - time.monotonic()
