"""Per-request results and what a benchmark reports of them: percentiles, throughput, SLO attainment, goodput.

    TTFT  arrival at the server (request sent) -> first content token received
    TPOT  (E2E - TTFT) / (output tokens - 1); none for a one-token answer (it meets any TPOT SLO)
    E2E   request sent -> last byte of the answer

SLO attainment: the fraction of all requests sent, failed ones included, that succeeded and met
both SLOs. Goodput: those requests per second of the run.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

# The server's per-request timing (router.trace.Trace.timing). first_decode_s: transfer done to
# the first token back at the router, a part of P/D TTFT that none of the others covers; route_s:
# the router's own routing (the prefix index) and failed attempts. All but decode_s sum to TTFT.
BREAKDOWN = ("queue_s", "route_s", "prefill_s", "transfer_s", "first_decode_s", "decode_s")


@dataclass
class RequestResult:
    ok: bool
    start: float  # seconds from the start of the run to sending the request
    ttft: float = 0.0
    e2e: float = 0.0
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str = ""
    timing: dict[str, Any] | None = None  # the server's own breakdown, when it sends one
    conv: int = -1
    turn: int = 0
    cls: str = ""  # the request's class (bench.workloads.Mix.classes)
    text: str = ""  # the answer, as streamed (a conversation's next turn repeats it)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def cached_tokens(self) -> int | None:
        return None if self.timing is None or "cached_tokens" not in self.timing else int(self.timing["cached_tokens"])


@dataclass(frozen=True)
class SLO:
    """Latency bounds in seconds; None: no bound."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    def met(self, r: RequestResult) -> bool:
        if not r.ok:
            return False
        if self.ttft_s is not None and r.ttft > self.ttft_s:
            return False
        tpot = r.tpot
        return self.tpot_s is None or tpot is None or tpot <= self.tpot_s

    def scaled(self, k: float) -> SLO:
        return SLO(None if self.ttft_s is None else self.ttft_s * k, None if self.tpot_s is None else self.tpot_s * k)


@dataclass(frozen=True)
class ClassSLO:
    """One SLO per request class: each request is held to its own class's (by RequestResult.cls)."""

    by_class: Mapping[str, SLO]

    def met(self, r: RequestResult) -> bool:
        return self.by_class[r.cls].met(r)


def percentile(xs: Sequence[float], p: float) -> float:
    """The p-th percentile (0..100), interpolating linearly between order statistics (numpy's default)."""
    if not xs:
        raise ValueError("percentile of an empty list")
    s = sorted(xs)
    pos = (len(s) - 1) * p / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def distribution(xs: Iterable[float]) -> dict[str, float] | None:
    """mean, p50, p90, p99 of `xs`; None when empty."""
    v = list(xs)
    if not v:
        return None
    return {"mean": sum(v) / len(v), **{f"p{p}": percentile(v, p) for p in (50, 90, 99)}}


def attainment(results: Sequence[RequestResult], slo: SLO | ClassSLO) -> float:
    return sum(slo.met(r) for r in results) / len(results) if results else 0.0


def goodput(results: Sequence[RequestResult], slo: SLO | ClassSLO, duration_s: float) -> float:
    return sum(slo.met(r) for r in results) / duration_s if duration_s > 0 else 0.0


def breakdown(results: Sequence[RequestResult]) -> dict[str, dict[str, float]] | None:
    """Mean and p90 of each BREAKDOWN part the server reported; None if it sent no timing."""
    timed = [r.timing for r in results if r.ok and r.timing]
    if not timed:
        return None
    out = {}
    for key in BREAKDOWN:
        d = distribution(float(t[key]) for t in timed if key in t)
        if d is not None:
            out[key] = {"mean": d["mean"], "p90": d["p90"]}
    return out


def hit_rate(results: Sequence[RequestResult]) -> float | None:
    """Prompt tokens served from a prefix cache over all prompt tokens, from the server's
    per-request `cached_tokens`; None when it reports none."""
    known = [r for r in results if r.ok and r.cached_tokens is not None]
    total = sum(r.prompt_tokens for r in known)
    return sum(r.cached_tokens or 0 for r in known) / total if total else None


def summarize(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    dur = max(duration_s, 1e-9)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration_s,
        "throughput_rps": len(ok) / dur,
        "input_tok_s": sum(r.prompt_tokens for r in ok) / dur,
        "output_tok_s": sum(r.output_tokens for r in ok) / dur,
        "ttft_s": distribution(r.ttft for r in ok),
        "tpot_s": distribution(t for r in ok if (t := r.tpot) is not None),
        "e2e_s": distribution(r.e2e for r in ok),
        "slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s},
        "slo_attainment": attainment(results, slo),
        "goodput_rps": goodput(results, slo, dur),
        "breakdown": breakdown(results),
        "prefix_hit_rate": hit_rate(results),
    }


def max_rate_meeting(points: Sequence[tuple[float, float]], target: float = 0.9) -> float:
    """The highest rate whose attainment is >= `target`, from (rate, attainment) points of a sweep.

    Walks up from the lowest rate while points pass; between the last passing and the first
    failing point, interpolates linearly where attainment crosses `target`. 0.0 when the lowest
    rate already fails; the highest rate when none fails (a lower bound: the sweep stopped short)."""
    pts = sorted(points)
    if not pts or pts[0][1] < target:
        return 0.0
    for (r0, a0), (r1, a1) in itertools.pairwise(pts):
        if a1 < target:
            return r0 + (r1 - r0) * (a0 - target) / (a0 - a1)
    return pts[-1][0]
