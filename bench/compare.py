"""`tandem bench compare`: goodput of P/D disaggregation against colocated serving, on the same cores.

Each system is a real cluster (Ray workers, KV transfer) behind the real router, started here:

    colocated  1 worker x 2 threads, or 2 workers x 1 thread (full mode tries both, keeps the better)
    P/D        1 prefill + 1 decode worker, 1 thread each

Both see the same prompts at the same Poisson rates. SLOs follow DistServe: k x the unloaded
median TTFT and TPOT, the lower of the systems' (k = --slo-scale, 4 by default). A system's goodput
is the highest rate at which >= 90% of requests meet both SLOs (see bench.stats.max_rate_meeting),
on a prefill-heavy mix (long prompts, short answers) and a decode-heavy one (chat, long answers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import plots
from bench.harness import (
    RouterUnavailableError,
    create_app_fn,
    exit_on_sigterm,
    running_cluster,
    serving,
    unique_namespace,
)
from bench.loadgen import Target, first_model
from bench.stats import SLO, max_rate_meeting, summarize
from bench.sweep import Point, Unloaded, probe, sweep
from bench.workloads import MIXES, LengthDist, Mix
from cluster.cluster import ClusterConfig
from engine.config import EngineConfig

TARGET = 0.9
REQUEST_TIMEOUT_S = 180.0  # a request still unanswered by then counts as failed


@dataclass(frozen=True)
class System:
    name: str
    prefill: int
    decode: int
    colocated: int
    threads: int

    @property
    def pd(self) -> bool:
        return self.prefill > 0


COLOCATED_1X2 = System("colocated 1x2t", 0, 0, 1, 2)
COLOCATED_2X1 = System("colocated 2x1t", 0, 0, 2, 1)
PD = System("P/D 1P+1D 1t", 1, 1, 0, 1)

_CHAT = MIXES["chat"]


@dataclass(frozen=True)
class Plan:
    """What one run does. Lengths are scaled to what 2 CPU cores serve in minutes, not hours."""

    systems: tuple[System, ...]
    mixes: dict[str, Mix]
    factors: tuple[float, ...]  # sweep rates, as multiples of 1 / (unloaded E2E) of the first system
    requests: int  # per rate, at most
    max_seconds: float  # of sending per rate, at most
    probe_requests: int
    num_blocks: int = 1024


FULL = Plan(
    systems=(COLOCATED_1X2, COLOCATED_2X1, PD),
    mixes={
        "prefill_heavy": MIXES["summarize"].scaled(input=0.5, output=0.25),
        "decode_heavy": replace(
            _CHAT, name="chat-long", input=LengthDist(64, 0.5, 16, 256), output=LengthDist(160, 0.3, 96, 320)
        ),
    },
    factors=tuple(0.5 * 1.5**i for i in range(9)),
    requests=32,
    max_seconds=90.0,
    probe_requests=5,
)
QUICK = Plan(
    systems=(COLOCATED_1X2, PD),
    mixes={
        "prefill_heavy": MIXES["summarize"].scaled(input=0.3, output=0.125),
        "decode_heavy": replace(
            _CHAT, name="chat-long", input=LengthDist(48, 0.5, 16, 128), output=LengthDist(48, 0.3, 24, 96)
        ),
    },
    factors=(0.5, 1.0, 2.0, 4.0),
    requests=8,
    max_seconds=12.0,
    probe_requests=3,
    num_blocks=512,
)

Measured = dict[str, dict[str, tuple[Unloaded, list[Point]]]]  # system -> mix -> (unloaded, sweep)


def run_system(
    system: System, plan: Plan, base: dict[str, float], k: float, seed: int, progress: bool
) -> dict[str, tuple[Unloaded, list[Point]]]:
    """Start `system`, probe and sweep every mix, shut it down. `base` (req/s per mix) is set by
    the first system and reused, so every system sees the same rates."""
    config = ClusterConfig(
        namespace=unique_namespace("bench-compare"),
        prefill=system.prefill,
        decode=system.decode,
        colocated=system.colocated,
        engine=EngineConfig(num_blocks=plan.num_blocks, num_threads=system.threads),
    )
    out: dict[str, tuple[Unloaded, list[Point]]] = {}
    with running_cluster(config) as cluster, serving(cluster) as url:
        target = Target(url, asyncio.run(first_model(url)), timeout_s=REQUEST_TIMEOUT_S)
        for name, mix in plan.mixes.items():
            print(f"[{system.name}] {name}: unloaded latency", file=sys.stderr)
            unloaded = probe(target, mix, plan.probe_requests, seed, warmup=2, progress=progress)
            base.setdefault(name, 1.0 / unloaded.e2e_s)
            rates = [base[name] * f for f in plan.factors]
            print(f"[{system.name}] {name}: sweep {', '.join(f'{r:.3g}' for r in rates)} req/s", file=sys.stderr)
            points = sweep(
                target, mix, rates, unloaded.slo.scaled(k), plan.requests, plan.max_seconds, seed, progress=progress
            )
            out[name] = (unloaded, points)
    return out


def evaluate(measured: Measured, plan: Plan, k: float) -> dict[str, Any]:
    """The report: per mix, the SLO, each system's curve and goodput, P/D against the better colocated."""
    res: dict[str, Any] = {}
    for name, mix in plan.mixes.items():
        runs = {s: m[name] for s, m in measured.items()}
        ref = SLO(min(u.ttft_s for u, _ in runs.values()), min(u.tpot_s for u, _ in runs.values()))
        slo = ref.scaled(k)
        systems: dict[str, Any] = {}
        for s, (unloaded, points) in runs.items():
            curve = [(p.rate, p.attainment(slo)) for p in points]
            systems[s] = {
                "unloaded": {"ttft_s": unloaded.ttft_s, "tpot_s": unloaded.tpot_s, "e2e_s": unloaded.e2e_s},
                "goodput_rps": max_rate_meeting(curve, TARGET),
                "points": [
                    {"rate": p.rate, "attainment": a, **_brief(summarize(p.results, p.duration_s, slo))}
                    for p, (_, a) in zip(points, curve, strict=True)
                ],
            }
        colo = max(
            (s for s in plan.systems if not s.pd and s.name in systems), key=lambda s: systems[s.name]["goodput_rps"]
        )
        pd = next(s for s in plan.systems if s.pd)
        c, p = systems[colo.name]["goodput_rps"], systems[pd.name]["goodput_rps"]
        res[name] = {
            "pd_goodput_rps": p,
            "colocated_goodput_rps": c,
            "goodput_ratio": p / c if c > 0 else None,
            "colocated_system": colo.name,
            "slo": {"scale": k, "ttft_s": slo.ttft_s, "tpot_s": slo.tpot_s, "target": TARGET,
                    "reference": "k x the lowest unloaded median over the systems"},
            "workload": {"mix": mix.name, "input": vars(mix.input), "output": vars(mix.output)},
            "systems": systems,
        }  # fmt: skip
    return res


def _brief(s: dict[str, Any]) -> dict[str, Any]:
    def p90(d: dict[str, float] | None) -> float | None:
        return None if d is None else d["p90"]

    return {"requests": s["requests"], "failed": s["failed"], "throughput_rps": s["throughput_rps"],
            "ttft_p90_s": p90(s["ttft_s"]), "tpot_p90_s": p90(s["tpot_s"]), "breakdown": s["breakdown"]}  # fmt: skip


def write_plots(res: dict[str, Any], measured: Measured, out: Path) -> list[str]:
    panels = {
        name: {s: [(p["rate"], p["attainment"]) for p in v["points"]] for s, v in r["systems"].items()}
        for name, r in res.items()
    }
    files = [plots.attainment_vs_rate(panels, out / "compare_attainment.png", TARGET, "SLO attainment vs rate")]
    for name, r in res.items():
        # CDFs at the highest shared rate at which either system still meets the target
        best = max(r["pd_goodput_rps"], r["colocated_goodput_rps"])
        shared = sorted({p.rate for p in measured[next(iter(measured))][name][1]})
        rate = max([x for x in shared if x <= best] or shared[:1])
        series = {s: next(p.results for p in m[name][1] if p.rate == rate) for s, m in measured.items()
                  if any(p.rate == rate for p in m[name][1])}  # fmt: skip
        slo = SLO(r["slo"]["ttft_s"], r["slo"]["tpot_s"])
        files.append(plots.latency_cdfs(series, out / f"compare_cdf_{name}.png", slo, f"{name} at {rate:.3g} req/s"))
    return [str(f) for f in files]


def print_report(res: dict[str, Any]) -> None:
    for name, r in res.items():
        slo = r["slo"]
        print(f"{name} ({r['workload']['mix']}): SLO TTFT {slo['ttft_s']:.3f} s, TPOT {slo['tpot_s']:.4f} s "
              f"(k = {slo['scale']:g} x best unloaded), target {slo['target']:.0%}")  # fmt: skip
        for s, v in r["systems"].items():
            u = v["unloaded"]
            curve = " ".join(f"{p['rate']:.3g}:{p['attainment']:.0%}" for p in v["points"])
            print(f"  {s:<16} unloaded TTFT {u['ttft_s']:.3f} s TPOT {u['tpot_s']:.4f} s"
                  f"  goodput {v['goodput_rps']:.3f} req/s   rate:attainment {curve}")  # fmt: skip
        ratio = r["goodput_ratio"]
        print(f"  P/D / colocated ({r['colocated_system']}) goodput: " + ("-" if ratio is None else f"{ratio:.2f}x"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke check: shorter lengths, fewer rates, one colocated")
    ap.add_argument("--slo-scale", type=float, default=4.0, help="k: SLO = k x the best unloaded TTFT / TPOT")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", default="out/bench/compare", help="directory for compare.json and the PNGs")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    try:
        create_app_fn()
    except RouterUnavailableError as e:
        print(f"tandem bench compare: {e}", file=sys.stderr)
        return 2
    exit_on_sigterm()
    plan = QUICK if args.quick else FULL
    t0 = time.monotonic()
    base: dict[str, float] = {}
    measured: Measured = {
        s.name: run_system(s, plan, base, args.slo_scale, args.seed, not args.no_progress) for s in plan.systems
    }
    res = evaluate(measured, plan, args.slo_scale)
    meta = {"quick": args.quick, "seed": args.seed, "elapsed_s": time.monotonic() - t0,
            "systems": [vars(s) for s in plan.systems], "base_rps": base}  # fmt: skip
    files: list[str] = []
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        files = [*write_plots(res, measured, out), str(out / "compare.json")]
        (out / "compare.json").write_text(json.dumps({**res, "meta": meta, "files": files}, indent=2))
    if args.json:
        print(json.dumps({**res, "meta": meta, "files": files}))
    else:
        print_report(res)
        print(f"took {meta['elapsed_s']:.0f} s" + (f"; wrote {', '.join(files)}" if files else ""))
    return 0
