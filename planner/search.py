"""Goodput and plans over the simulator (planner.simulator).

goodput    the highest arrival rate (the trace's requests, time-scaled) at which >= TARGET of
           requests meet their SLO (TTFT and TPOT), found by bisection on the rate's log
splits     the goodput of every P:D split of n workers of one kind, and of n colocated
cheapest   the cheapest mix of node kinds per phase (prefill kind x count, decode kind x count,
           or colocated kind x count) that meets the SLOs at the trace's own rate
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from planner.simulator import ClusterSpec, Outcome, WorkerSpec, simulate
from planner.slo import SLO
from planner.trace import Trace

TARGET = 0.9  # the share of requests that must meet their SLO (as `tandem bench compare`)


SLOs = SLO | Mapping[str, SLO]  # one for all, or one per request class


def attainment(trace: Trace, outcome: Outcome, slo: SLOs) -> float:
    ok = 0
    for cls, ttft, tpot in zip(trace.cls, outcome.ttft, outcome.tpot, strict=True):
        s = slo if isinstance(slo, SLO) else slo[cls]
        ok += ttft <= s.ttft_s and tpot <= s.tpot_s
    return ok / len(trace)


def meets(spec: ClusterSpec, trace: Trace, slo: SLOs, target: float = TARGET) -> bool:
    return attainment(trace, simulate(spec, trace), slo) >= target


MIN_SPAN_TTFTS = 20  # a trace must last this many TTFT SLOs at a rate for that rate to count


def max_rate(trace: Trace, slo: SLOs) -> float:
    """The highest rate `trace` can test: past it, its requests arrive within MIN_SPAN_TTFTS x
    the (longest) TTFT SLO, a burst the cluster may absorb without ever queueing."""
    ttft = slo.ttft_s if isinstance(slo, SLO) else max(s.ttft_s for s in slo.values())
    return (len(trace) - 1) / (MIN_SPAN_TTFTS * ttft)


def goodput(spec: ClusterSpec, trace: Trace, slo: SLOs, target: float = TARGET, steps: int = 10) -> float:
    """Requests a second; 0 if even 1/1024 of the trace's rate misses, and `max_rate(trace, slo)`
    (a lower bound: the trace is too short to find the limit) if that rate still meets the SLO."""
    ok: Callable[[float], bool] = lambda f: meets(spec, trace.at_rate(f), slo, target)  # noqa: E731
    cap = max_rate(trace, slo) / trace.rate  # as a factor of the trace's rate
    lo, hi = 1.0, 1.0
    if ok(1.0):
        while True:  # double up to the first miss, or to the cap
            nxt = min(lo * 2, cap)
            if nxt <= lo:
                return lo * trace.rate
            if not ok(nxt):
                hi = nxt
                break
            if nxt >= cap:
                return cap * trace.rate
            lo = nxt
    else:
        while not ok(lo / 2):
            lo /= 2
            if lo < 2**-10:
                return 0.0
        lo, hi = lo / 2, lo
    for _ in range(steps):  # ok(lo), not ok(hi)
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if ok(mid) else (lo, mid)
    return lo * trace.rate


@dataclass(frozen=True)
class NodeKind:
    """A kind of worker: its engine (step costs, KV room) and its price an hour."""

    name: str
    worker: WorkerSpec
    price: float = 0.0
    available: int | None = None  # at most this many (None: no limit)
    transfer_gbps: float = 10.0  # KV transfer bandwidth between two workers of this kind


@dataclass(frozen=True)
class Handoff:
    """What moving a prompt's KV from prefill to decode costs: a fixed part and bytes."""

    fixed_s: float
    kv_bytes_per_token: float

    def spec(self, prefill: NodeKind, n_p: int, decode: NodeKind, n_d: int) -> ClusterSpec:
        gbps = min(prefill.transfer_gbps, decode.transfer_gbps)
        per_token = self.kv_bytes_per_token / (gbps * 1e9)
        return ClusterSpec((prefill.worker,) * n_p, (decode.worker,) * n_d, (), self.fixed_s, per_token)


def colocated(kind: NodeKind, n: int) -> ClusterSpec:
    return ClusterSpec(colocated=(kind.worker,) * n)


@dataclass(frozen=True)
class Option:
    label: str  # "3P+5D", "8C", "H100 x3 + H200 x5"
    prefill: int
    decode: int
    colocated: int
    goodput: float = 0.0  # requests a second
    price: float = 0.0  # an hour


def splits(kind: NodeKind, n: int, trace: Trace, slo: SLOs, handoff: Handoff, most: int = 16) -> list[Option]:
    """Goodput of n colocated workers and of P:D splits of n (every one, or `most` spread evenly
    when n - 1 > most), best first."""
    ps = list(range(1, n))
    if len(ps) > most > 1:
        ps = sorted({round(1 + i * (n - 2) / (most - 1)) for i in range(most)})
    out = [Option(f"{n}C", 0, 0, n, goodput(colocated(kind, n), trace, slo), kind.price * n)]
    for p in ps:
        spec = handoff.spec(kind, p, kind, n - p)
        out.append(Option(f"{p}P+{n - p}D", p, n - p, 0, goodput(spec, trace, slo), kind.price * n))
    return sorted(out, key=lambda o: -o.goodput)


def _fewest(fits: Callable[[int], bool], limit: int) -> int | None:
    """The least n in 1..limit with fits(n), assuming more never hurts; None if not even limit."""
    if not fits(limit):
        return None
    lo, hi = 0, limit  # not fits(lo) (or lo = 0), fits(hi)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def fewest_colocated(kind: NodeKind, trace: Trace, slo: SLOs, limit: int) -> int | None:
    """The fewest colocated workers of `kind` meeting the SLOs at the trace's rate (None: not even `limit`)."""
    return _fewest(lambda n: meets(colocated(kind, n), trace, slo), limit)


def cheapest(kinds: list[NodeKind], trace: Trace, slo: SLOs, handoff: Handoff, limit: int = 1024) -> list[Option]:
    """Per kind (colocated) and per pair of kinds (prefill, decode): the fewest workers meeting the
    SLOs at the trace's rate, and their price an hour; cheapest first."""
    out = []
    for k in kinds:
        n = fewest_colocated(k, trace, slo, k.available or limit)
        if n is not None:
            out.append(Option(f"{k.name} x{n} colocated", 0, 0, n, trace.rate, k.price * n))
    for p in kinds:
        for d in kinds:
            sized = size_pair(p, d, trace, slo, handoff, limit)
            if sized is not None:
                n_p, n_d = sized
                label = f"prefill {p.name} x{n_p} + decode {d.name} x{n_d}"
                out.append(Option(label, n_p, n_d, 0, trace.rate, p.price * n_p + d.price * n_d))
    return sorted(out, key=lambda o: o.price)


def size_pair(
    p: NodeKind, d: NodeKind, trace: Trace, slo: SLOs, handoff: Handoff, limit: int
) -> tuple[int, int] | None:
    """The fewest (prefill, decode) workers meeting the SLOs: decode sized with prefill at its
    most, then prefill with that decode pool, then decode again with that prefill pool."""
    most_p, most_d = p.available or limit, d.available or limit
    if p is d and p.available is not None:
        most_p = most_d = p.available - 1
    if most_p < 1 or most_d < 1:
        return None  # no room for a worker of each phase

    def fits(n_p: int, n_d: int) -> bool:
        return meets(handoff.spec(p, n_p, d, n_d), trace, slo)

    first_d = _fewest(lambda n: fits(most_p, n), most_d)
    if first_d is None:
        return None
    n_p = _fewest(lambda n: fits(n, first_d), most_p)
    if n_p is None:
        return None
    n_d = _fewest(lambda n: fits(n_p, n), first_d) or first_d
    if p is d and p.available is not None and n_p + n_d > p.available:
        return None
    return n_p, n_d
