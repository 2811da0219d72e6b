"""Unloaded latency and rate sweeps against one endpoint: the steps the goodput comparison repeats.

    probe:  warm-up, then requests one at a time -> median TTFT / TPOT / E2E with no queueing
    sweep:  Poisson load at base x f0, base x f0 x step, ... until attainment collapses; where
            the lowest rate already misses the target, halving it until a rate meets it

SLOs are chosen after every system has been probed (DistServe style: k x the unloaded latency
of each request class), so a sweep keeps every request and only uses a provisional SLO to know
when to stop.
"""

from __future__ import annotations

import asyncio
import math
import statistics
from dataclasses import dataclass

import httpx

from bench.loadgen import Target, run_load
from bench.stats import SLO, ClassSLO, RequestResult, attainment
from bench.workloads import Mix, make_items

PROBE_SALT = 10_000  # probe text shares nothing with the sweep's


@dataclass(frozen=True)
class Unloaded:
    """Medians over requests sent one at a time."""

    ttft_s: float
    tpot_s: float
    e2e_s: float

    @property
    def slo(self) -> SLO:
        return SLO(self.ttft_s, self.tpot_s)


@dataclass
class Point:
    rate: float
    results: list[RequestResult]
    duration_s: float
    index: int = 0  # its requests' seed and salt offset (make_items): negative below the planned rates

    def attainment(self, slo: SLO | ClassSLO) -> float:
        return attainment(self.results, slo)


def probe(target: Target, mix: Mix, n: int, seed: int, warmup: int = 2, progress: bool = True) -> Unloaded:
    """Unloaded latency of `mix` on `target`. Raises RuntimeError if any probe request fails."""
    items = make_items(mix, warmup + n, seed=seed, salt=PROBE_SALT)
    results, _ = asyncio.run(run_load(target, items, concurrency=1, progress=progress, desc="unloaded"))
    bad = [r.error for r in results if not r.ok]
    if bad:
        raise RuntimeError(f"unloaded requests failed: {bad[:3]}")
    kept = results[warmup:]
    tpots = [t for r in kept if (t := r.tpot) is not None] or [0.0]
    return Unloaded(
        statistics.median(r.ttft for r in kept), statistics.median(tpots), statistics.median(r.e2e for r in kept)
    )


def sweep(
    target: Target,
    mix: Mix,
    rates: list[float],
    stop: SLO | ClassSLO,
    requests: int,
    max_seconds: float,
    seed: int,
    progress: bool = True,
    floor: tuple[float, int] = (0.9, 2),
    stop_below: float = 0.5,
    transport: httpx.AsyncBaseTransport | None = None,
) -> list[Point]:
    """Poisson load at each of `rates` (ascending), `requests` requests a point, fewer where that
    would take longer than `max_seconds` to send (4 at least). Stops after the first point whose
    attainment of `stop` is below `stop_below`. Point i sends salt-i text: the same prompts on
    every system swept with the same `seed`, and nothing one point could find cached from another.
    Where the lowest rate misses `floor`'s attainment, up to `floor`'s count more points go below
    it, each at half the rate of the last (points -1, -2, ...), until one meets it: a goodput is
    then measured, where one noisy lowest point made it 0. Returned in ascending rate."""

    def point(i: int, rate: float) -> Point:
        n = max(4, min(requests, math.ceil(rate * max_seconds)))
        items = make_items(mix, n, seed=seed + i, salt=i)
        desc = f"{rate:.3g} req/s"
        load = run_load(target, items, rate=rate, seed=seed + i, progress=progress, desc=desc, transport=transport)
        results, duration = asyncio.run(load)
        return Point(rate, results, duration, i)

    points: list[Point] = []
    for i, rate in enumerate(rates):
        points.append(point(i, rate))
        if points[-1].attainment(stop) < stop_below:
            break
    meets, most = floor
    for i in range(-1, -most - 1, -1):
        if not points or points[0].attainment(stop) >= meets:
            break
        points.insert(0, point(i, points[0].rate / 2))
    return points
