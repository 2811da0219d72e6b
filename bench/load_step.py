"""`tandem bench planner --load-step`: the load steps from the prefill-heavy to the decode-heavy
mix, on the same cluster (2 prefill + 1 decode worker, 1 thread each), served twice: with the
pool sizes fixed (static) and with the autoscaler on, bounded to the same hardware
(`prefill=1..2,decode=1..2,pd=3`: it can only move a worker, which the pool manager flips in
place). Per run: the SLO attainment of the requests sent in each `window_s` window, and the time
from the step to recovery (every window from then on at >= 90%; None: not within the run).

The SLO is one for both mixes, as the autoscaler keeps one: 5x the larger unloaded TTFT of the
two classes and 2x the larger unloaded TPOT, probed on the static cluster and used for both runs.
The rates, also set on the static cluster and kept for both runs, are measured there first
(bench/step_rates.py: before the step, half of what the static sizes hold; after it, between
what they and the sizes with one worker flipped hold), or given as multiples of each mix's
one-at-a-time rate (1 / its unloaded E2E): `--step-before`, `--step-after`. `--step-reverse`
(StepPlan.reversed): the step the other way, decode-heavy to prefill-heavy from 1P+2D.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import sys
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any

from bench.compare import QUICK
from bench.harness import create_app_fn, running_cluster, unique_namespace, uvicorn_thread
from bench.loadgen import Target, first_model, run_load
from bench.stats import RequestResult
from bench.step_rates import Sizes, StepRates, measure_rates
from bench.sweep import probe
from bench.workloads import Mix, make_items
from cluster.cluster import Cluster, ClusterConfig
from engine.config import EngineConfig
from planner.autoscale import Bounds
from planner.slo import SLO

TARGET = 0.9
START = Sizes(prefill=2, decode=1)
BOUNDS = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 2, "decode": 2}, max_pd=3, cooldown_s=10.0)


@dataclass(frozen=True)
class StepPlan:
    before: Mix = QUICK.mixes["prefill_heavy"]
    after: Mix = QUICK.mixes["decode_heavy"]
    start: Sizes = START  # the static sizes; the mix after the step wants a worker flipped to `grows`
    grows: str = "decode"
    before_s: float = 40.0
    after_s: float = 80.0
    before_x: float | None = None  # rate, as a multiple of the mix's one-at-a-time rate (None: measured first)
    after_x: float | None = None
    window_s: float = 5.0
    interval_s: float = 5.0  # the autoscaler's

    def reversed(self) -> StepPlan:
        """The step the other way (decode-heavy to prefill-heavy, from 1P+2D, a worker flipping to prefill)."""
        grows = "prefill" if self.grows == "decode" else "decode"
        return replace(self, before=self.after, after=self.before, start=self.start.flipped(self.grows), grows=grows)


@dataclass(frozen=True)
class StepSetup:
    """What the static run sets and the autoscaled one reuses."""

    slo: SLO
    before_rps: float
    after_rps: float
    measured: StepRates | None  # where a rate was measured first


@dataclass(frozen=True)
class StepRun:
    mode: str  # "static" | "autoscale"
    step_s: float
    sent: tuple[tuple[float, bool], ...]  # (sent at, s from the start; met the SLO)
    events: tuple[dict[str, str], ...]  # the cluster's autoscale and flip events

    def timeline(self, window_s: float) -> list[tuple[float, float | None]]:
        return timeline(self.sent, window_s)


def timeline(sent: Sequence[tuple[float, bool]], window_s: float) -> list[tuple[float, float | None]]:
    """(window start, attainment of the requests sent in it; None: none sent) per window."""
    end = max((t for t, _ in sent), default=0.0)
    out: list[tuple[float, float | None]] = []
    for k in range(int(end // window_s) + 1):
        met = [ok for t, ok in sent if k * window_s <= t < (k + 1) * window_s]
        out.append((k * window_s, sum(met) / len(met) if met else None))
    return out


def recovery_s(line: Sequence[tuple[float, float | None]], step_s: float, target: float = TARGET) -> float | None:
    """Seconds from the step to the start of the first window after it from which every window
    (with requests) meets `target`; 0 if none after the step misses; None if the last one misses."""
    after = [(t, a) for t, a in line if t + 1e-9 >= step_s and a is not None]
    if not after or after[-1][1] < target:  # type: ignore[operator]
        return None
    start = after[0][0]
    for t, a in after:
        if a < target:  # type: ignore[operator]
            start = math.inf
        elif start == math.inf:
            start = t
    return max(0.0, start - step_s)


def met(r: RequestResult, slo: SLO) -> bool:
    tpot = r.tpot
    return r.ok and r.ttft <= slo.ttft_s and (tpot is None or tpot <= slo.tpot_s)


def run(mode: str, plan: StepPlan, setup: StepSetup | None, seed: int) -> tuple[StepRun, StepSetup]:
    """One run on a fresh cluster; probes the SLO and sets the rates first when `setup` is None."""
    settings = importlib.import_module("router.settings").RouterSettings()
    config = ClusterConfig(namespace=unique_namespace(f"bench-step-{mode}"), prefill=plan.start.prefill,
                           decode=plan.start.decode, engine=EngineConfig(num_blocks=512, num_threads=1))  # fmt: skip
    with running_cluster(config) as cluster:
        backend = importlib.import_module("router.backend").ClusterBackend(cluster, settings.routing_policy)
        app = create_app_fn()(backend, settings)
        with uvicorn_thread(app) as url:
            target = Target(url, asyncio.run(first_model(url)))
            if setup is None:
                setup = _setup(target, cluster, plan, seed)
            stop = threading.Event()
            if mode == "autoscale":
                autoscaler = importlib.import_module("router.autoscaler")
                flags = importlib.import_module("router.autoscale_flags")
                scaler = autoscaler.Autoscaler(backend, app.state.dispatcher.window,
                                               flags.AutoscaleConfig(setup.slo, BOUNDS, plan.interval_s))  # fmt: skip
                app.state.dispatcher.window.take()
                threading.Thread(target=scaler.run, args=(stop,), name="autoscaler", daemon=True).start()
            results = asyncio.run(_step(target, plan, (setup.before_rps, setup.after_rps), seed))
            stop.set()
            events = [e for _, e in backend.events("0-0", 1000) if e.get("kind") in ("autoscale", "worker_flipped")]
    sent = tuple(sorted((t, met(r, setup.slo)) for t, r in results))
    return StepRun(mode, plan.before_s, sent, tuple(events)), setup


def _setup(target: Target, cluster: Cluster, plan: StepPlan, seed: int) -> StepSetup:
    alone = {m.name: probe(target, m, 3, seed, progress=False) for m in (plan.before, plan.after)}
    slo = SLO(5 * max(u.ttft_s for u in alone.values()), 2 * max(u.tpot_s for u in alone.values()))
    base = {name: 1 / u.e2e_s for name, u in alone.items()}
    before = None if plan.before_x is None else plan.before_x * base[plan.before.name]
    after = None if plan.after_x is None else plan.after_x * base[plan.after.name]
    measured = None
    if before is None or after is None:
        flipped = plan.start.flipped(plan.grows)
        print(f"load step: measuring its rates ({plan.start}, then {flipped})", file=sys.stderr)
        measured = measure_rates(target, cluster, (plan.before, plan.after), plan.grows, slo, base, seed)
        print(f"load step: {measured}", file=sys.stderr)
        before = measured.before_rps if before is None else before
        after = measured.after_rps if after is None else after
    return StepSetup(slo, before, after, measured)


async def _step(
    target: Target, plan: StepPlan, rates: tuple[float, float], seed: int
) -> list[tuple[float, RequestResult]]:
    """Both phases, the second starting `before_s` in, whatever the first still runs."""
    rate_a, rate_b = rates
    items_a = make_items(plan.before, max(4, round(rate_a * plan.before_s)), seed=seed, salt=101)
    items_b = make_items(plan.after, max(4, round(rate_b * plan.after_s)), seed=seed + 1, salt=102)

    async def after() -> list[RequestResult]:
        await asyncio.sleep(plan.before_s)
        results, _ = await run_load(target, items_b, rate=rate_b, seed=seed + 1, progress=False)
        return results

    (a, _), b = await asyncio.gather(run_load(target, items_a, rate=rate_a, seed=seed, progress=False), after())
    return [(r.start, r) for r in a] + [(plan.before_s + r.start, r) for r in b]


def measure(plan: StepPlan, seed: int = 0) -> dict[str, Any]:
    """Both runs; the keys `tandem bench planner --json` reports, and the timelines."""
    print("load step: static", file=sys.stderr)
    static, setup = run("static", plan, None, seed)
    print("load step: autoscale", file=sys.stderr)
    scaled, _ = run("autoscale", plan, setup, seed)
    slo = setup.slo
    rates = {"before_rps": setup.before_rps, "after_rps": setup.after_rps, "static_sizes": str(plan.start),
             "flipped_sizes": str(plan.start.flipped(plan.grows)), "before_mix": plan.before.name,
             "after_mix": plan.after.name, "measured": asdict(setup.measured) if setup.measured else None}  # fmt: skip
    out: dict[str, Any] = {"step_slo": {"ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s}, "step_s": plan.before_s,
                           "step_rates": rates}  # fmt: skip
    for r in (static, scaled):
        line = r.timeline(plan.window_s)
        out[f"recovery_s_{r.mode}"] = recovery_s(line, plan.before_s)
        out[f"timeline_{r.mode}"] = line
        out[f"events_{r.mode}"] = list(r.events)
    return out
