"""The load step's rates, measured on the static cluster first: the one step whose outcome the
autoscaler's flip decides, on whatever machine runs it.

Fixed multiples of each mix's one-at-a-time rate are not portable: the SLO comes from the same
machine's probes, and how many requests three 1-thread workers hold within it differs from CPU to
CPU (on a Zen 4, 3x the decode-heavy rate overloaded 2P+1D and 1P+2D alike, so no policy could
recover; 1.5x was held by 2P+1D, so none had to). Nor does the simulator place them: on the
1-thread profile, calibrated on the probes, it put 2P+1D's decode-heavy goodput at 7.2 req/s
there, and the step at 8.7 req/s overloaded both runs from the first window on (three workers
share two cores with the router and the load generator; the profile's engine runs alone).

So, on the static cluster, before either run: a sweep (bench.sweep) of the mix before the step
and of the one after it on the static sizes (2P+1D; the reversed step's 1P+2D), then a worker
flipped in place toward what the mix after the step needs (to decode; to prefill) and that mix
swept again, then the worker flipped back. Goodput is bench.stats.max_rate_meeting of each
sweep at the step's SLO, and

    before = BEFORE_SHARE x the static sizes' goodput of the mix before  (held: nothing should flip)
    after  = sqrt(the static sizes' goodput of the mix after x the flipped sizes')

The geometric mean sits as far, in ratio, from each side: only the better of the two sizes holds
it. Where the flip pays, static misses it and a flip recovers; where it loses (on the Zen 4:
2P+1D held 4.15-5.76 req/s, 1P+2D 2.55-3.62), static holds it and the right decision is none."""

from __future__ import annotations

import math
from dataclasses import dataclass

from bench.loadgen import Target
from bench.stats import SLO as Bound
from bench.stats import max_rate_meeting
from bench.sweep import sweep
from bench.workloads import Mix
from cluster.cluster import Cluster
from planner.slo import SLO

BEFORE_SHARE = 0.5
FACTORS = (0.5, 1.0, 1.5, 2.25, 3.4, 5.0, 7.6)  # x the mix's one-at-a-time rate, swept up to the first miss
REQUESTS, SECONDS = 32, 15.0  # a point: at most this many requests, sent over at most this long
FLIP_S = 60.0  # an idle worker's flip takes about a second; past this, something is wrong
FLIPPED_SEED = 1000  # the flipped sweep's prompts share nothing with the static one's


@dataclass(frozen=True)
class Sizes:
    prefill: int
    decode: int

    def flipped(self, to: str) -> Sizes:
        """One worker flipped to `to` ("prefill" or "decode") from the other pool."""
        step = 1 if to == "prefill" else -1
        return Sizes(self.prefill + step, self.decode - step)

    def __str__(self) -> str:
        return f"{self.prefill}P+{self.decode}D"


@dataclass(frozen=True)
class StepRates:
    before_rps: float
    after_rps: float
    before_held_rps: float  # goodput of the mix before the step on the static sizes
    after_static_rps: float  # of the mix after it on the static sizes
    after_flipped_rps: float  # and with one worker flipped

    @property
    def flip_gain(self) -> float:
        """How much more of the mix after the step the flipped sizes hold (1: the flip buys nothing)."""
        return self.after_flipped_rps / self.after_static_rps if self.after_static_rps else math.inf


def rates_from(before_held: float, after_static: float, after_flipped: float) -> StepRates:
    """The step's rates from the three goodputs (see the module docstring). Raises RuntimeError
    where no step can show a flip: nothing of the first mix held, or nothing of the second even
    with the flip."""
    if not (before_held and after_flipped):
        raise RuntimeError(f"the static sizes hold {before_held:.3g} req/s of the first mix and the flipped ones "
                           f"{after_flipped:.3g} of the second at the step's SLO: no step to take")  # fmt: skip
    after = math.sqrt(after_static * after_flipped) if after_static else after_flipped / 2
    return StepRates(BEFORE_SHARE * before_held, after, before_held, after_static, after_flipped)


def measure_rates(
    target: Target,
    cluster: Cluster,
    mixes: tuple[Mix, Mix],
    grows: str,
    slo: SLO,
    one_at_a_time: dict[str, float],
    seed: int,
) -> StepRates:
    """On the static cluster behind `target`, then with one worker flipped to `grows` and back;
    `one_at_a_time` is each mix's rate (by name)."""
    before, after = mixes
    other = "prefill" if grows == "decode" else "decode"
    held = _goodput(target, before, slo, one_at_a_time[before.name], seed)
    static = _goodput(target, after, slo, one_at_a_time[after.name], seed)
    _flip(cluster, other, grows)
    try:
        flipped = _goodput(target, after, slo, one_at_a_time[after.name], seed + FLIPPED_SEED)
    finally:
        _flip(cluster, grows, other)
    return rates_from(held, static, flipped)


def _goodput(target: Target, mix: Mix, slo: SLO, base: float, seed: int) -> float:
    bound = Bound(slo.ttft_s, slo.tpot_s)
    points = sweep(target, mix, [f * base for f in FACTORS], bound, REQUESTS, SECONDS, seed, progress=False)
    return max_rate_meeting([(p.rate, p.attainment(bound)) for p in points])


def _flip(cluster: Cluster, role: str, to: str) -> None:
    """One `role` worker flipped to `to` in place, and up and registered there (Cluster.wait_ready:
    the flip moved the desired sizes with it), or RuntimeError / TimeoutError."""
    ids = [w["worker_id"] for w in cluster.workers() if w["role"] == role and w["state"] == "up"]
    if not ids or not cluster.flip(ids[0], to):
        raise RuntimeError(f"no {role} worker up to flip to {to}")
    cluster.wait_ready(timeout=FLIP_S)
