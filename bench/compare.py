"""`tandem bench compare`: goodput of P/D disaggregation against colocated serving, on the same cores.

Each system is a real cluster (Ray workers, KV transfer) behind the real router, started here:

    colocated  1 worker x 2 threads, or 2 workers x 1 thread (full mode tries both, keeps the better)
    P/D        1 prefill + 1 decode worker, 1 thread each

Every system gets the same cores (workers x threads; a Plan checks it) and sees the same prompts
at the same Poisson rates, on three mixes: prefill-heavy (long prompts, short answers),
decode-heavy (chat, long answers) and interference (1 request in 4 a 2K-token prompt, the rest
short chats with 128-token answers).

SLOs are per request class (a mix has one class, or several: bench.workloads.Mix.classes):
TTFT_SCALE x and TPOT_SCALE x the class's median TTFT and TPOT sent alone to colocated serving
(the lower of the colocated systems'). A system's goodput is the highest rate at which >= 90% of
requests meet their own class's SLO (see bench.stats.max_rate_meeting).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from bench import plots
from bench.harness import (
    ready_to_serve,
    running_cluster,
    serving,
    unique_namespace,
)
from bench.loadgen import Target, first_model
from bench.stats import SLO, ClassSLO, goodput, max_rate_meeting, summarize
from bench.sweep import Point, Unloaded, probe, sweep
from bench.workloads import MIXES, LengthDist, Mix
from cluster.cluster import ClusterConfig
from engine.config import EngineConfig

TARGET = 0.9
REQUEST_TIMEOUT_S = 180.0  # a request still unanswered by then counts as failed
# SLO = scale x the class's latency alone on colocated serving. TTFT 5x leaves room to queue behind
# a few requests of the same size (on 2 cores a short chat's ~0.07 s becomes ~0.35 s, a 2K prompt's
# ~4 s ~20 s). TPOT 2x leaves room to batch (an engine step at batch 8 takes ~1.5-2x one at batch 1
# here) and is ~40 ms here, MLPerf's interactive bound; it has no room for decodes that stall behind
# another request's prefill: the interference disaggregation removes.
TTFT_SCALE = 5.0
TPOT_SCALE = 2.0
MIX_SEED_STRIDE = 1000  # mix k draws with seed + k x this: no mix's prompts are a cached prefix of another's


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

    @property
    def cores(self) -> int:
        return (self.prefill + self.decode + self.colocated) * self.threads


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
    probe_requests: int  # per request class
    num_blocks: int = 1024

    def __post_init__(self) -> None:
        if len({s.cores for s in self.systems}) != 1:
            raise ValueError(f"systems must have equal cores: {[(s.name, s.cores) for s in self.systems]}")


FULL = Plan(
    systems=(COLOCATED_1X2, COLOCATED_2X1, PD),
    mixes={
        "prefill_heavy": MIXES["summarize"].scaled(input=0.5, output=0.25),
        "decode_heavy": replace(
            _CHAT, name="chat-long", input=LengthDist(64, 0.5, 16, 256), output=LengthDist(160, 0.3, 96, 320)
        ),
        "interference": MIXES["interference"],
    },
    factors=tuple(0.25 * 1.5**i for i in range(11)),
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
        "interference": MIXES["interference"],  # unscaled: a 2K prompt is what makes the interference
    },
    factors=(0.25, 0.5, 1.0, 2.0, 4.0),
    requests=8,
    max_seconds=12.0,
    probe_requests=3,
    num_blocks=512,
)


@dataclass(frozen=True)
class MixRun:
    """One system on one mix: each request class sent alone, then the sweep."""

    unloaded: dict[str, Unloaded]  # class -> medians
    points: list[Point]


Measured = dict[str, dict[str, MixRun]]  # system -> mix -> run


def class_slo(alone: Sequence[Mapping[str, Unloaded]], ttft_scale: float, tpot_scale: float) -> ClassSLO:
    """Per class: the scales x the lowest median TTFT / TPOT over `alone` (one mapping per system)."""
    return ClassSLO({
        c: SLO(ttft_scale * min(u[c].ttft_s for u in alone), tpot_scale * min(u[c].tpot_s for u in alone))
        for c in alone[0]
    })  # fmt: skip


def base_rate(mix: Mix, alone: Mapping[str, Unloaded]) -> float:
    """Requests per second one at a time: 1 / the mean unloaded E2E over the mix's classes."""
    return 1.0 / sum(share * alone[shape.name].e2e_s for share, shape in mix.classes)


def run_system(
    system: System, plan: Plan, base: dict[str, float], scales: tuple[float, float], seed: int, progress: bool
) -> dict[str, MixRun]:
    """Start `system`, probe each class and sweep every mix, shut it down. `base` (req/s per mix)
    is set by the first system and reused, so every system sees the same rates."""
    config = ClusterConfig(
        namespace=unique_namespace("bench-compare"),
        prefill=system.prefill,
        decode=system.decode,
        colocated=system.colocated,
        engine=EngineConfig(num_blocks=plan.num_blocks, num_threads=system.threads),
    )
    out: dict[str, MixRun] = {}
    with running_cluster(config) as cluster, serving(cluster) as url:
        target = Target(url, asyncio.run(first_model(url)), timeout_s=REQUEST_TIMEOUT_S)
        for name, mix in plan.mixes.items():
            mix_seed = seed + MIX_SEED_STRIDE * list(FULL.mixes).index(name)
            alone: dict[str, Unloaded] = {}
            for _, shape in mix.classes:
                print(f"[{system.name}] {name}: {shape.name} alone", file=sys.stderr)
                alone[shape.name] = probe(target, shape, plan.probe_requests, mix_seed, warmup=2, progress=progress)
            base.setdefault(name, base_rate(mix, alone))
            rates = [base[name] * f for f in plan.factors]
            print(f"[{system.name}] {name}: sweep {', '.join(f'{r:.3g}' for r in rates)} req/s", file=sys.stderr)
            stop = class_slo([alone], *scales)  # provisional: the final SLOs come from every colocated system
            points = sweep(target, mix, rates, stop, plan.requests, plan.max_seconds, mix_seed, progress=progress)
            out[name] = MixRun(alone, points)
    return out


def evaluate(measured: Measured, plan: Plan, scales: tuple[float, float]) -> dict[str, Any]:
    """The report: per mix, the SLOs, each system's curve and goodput, P/D against the better colocated."""
    colocated = [s.name for s in plan.systems if not s.pd and s.name in measured]
    pd = next(s.name for s in plan.systems if s.pd)
    res: dict[str, Any] = {}
    for name, mix in plan.mixes.items():
        runs = {s: m[name] for s, m in measured.items()}
        slo = class_slo([runs[s].unloaded for s in colocated], *scales)
        systems = {s: _system_report(run, slo) for s, run in runs.items()}
        colo = max(colocated, key=lambda s: systems[s]["goodput_rps"])
        c, p = systems[colo]["goodput_rps"], systems[pd]["goodput_rps"]
        res[name] = {
            "pd_goodput_rps": p,
            "colocated_goodput_rps": c,
            "goodput_ratio": p / c if c > 0 else None,
            "colocated_system": colo,
            "slo": {"ttft_scale": scales[0], "tpot_scale": scales[1], "target": TARGET,
                    "reference": "scale x the class's median sent alone, the lowest over the colocated systems",
                    "classes": {k: {"ttft_s": v.ttft_s, "tpot_s": v.tpot_s} for k, v in slo.by_class.items()}},
            "workload": {"mix": mix.name, "classes": {
                shape.name: {"share": share, "input": vars(shape.input), "output": vars(shape.output)}
                for share, shape in mix.classes}},
            "systems": systems,
        }  # fmt: skip
    return res


def _system_report(run: MixRun, slo: ClassSLO) -> dict[str, Any]:
    curve = [(p.rate, p.attainment(slo)) for p in run.points]
    points = []
    for p, (_, a) in zip(run.points, curve, strict=True):
        classes = {c: summarize([r for r in p.results if r.cls == c], p.duration_s, s) for c, s in slo.by_class.items()}
        points.append({
            "rate": p.rate, "attainment": a, "goodput_rps": goodput(p.results, slo, p.duration_s),
            **_brief(summarize(p.results, p.duration_s, SLO())),  # counts and latencies; the SLOs are per class
            "classes": {c: {"attainment": s["slo_attainment"], **_brief(s)} for c, s in classes.items()},
        })  # fmt: skip
    return {
        "unloaded": {c: vars(u) for c, u in run.unloaded.items()},
        "goodput_rps": max_rate_meeting(curve, TARGET),
        "points": points,
    }


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
        # CDFs at the highest shared rate at which either system still meets the target, one plot per class
        best = max(r["pd_goodput_rps"], r["colocated_goodput_rps"])
        shared = sorted({p.rate for p in measured[next(iter(measured))][name].points})
        rate = max([x for x in shared if x <= best] or shared[:1])
        series = {s: next(p.results for p in m[name].points if p.rate == rate) for s, m in measured.items()
                  if any(p.rate == rate for p in m[name].points)}  # fmt: skip
        classes = r["slo"]["classes"]
        for c, bound in classes.items():
            tag, title = (name, name) if len(classes) == 1 else (f"{name}_{c}", f"{name}, {c}")
            files.append(plots.latency_cdfs(
                {s: [x for x in rs if x.cls == c] for s, rs in series.items()}, out / f"compare_cdf_{tag}.png",
                SLO(bound["ttft_s"], bound["tpot_s"]), f"{title} at {rate:.3g} req/s"))  # fmt: skip
    return [str(f) for f in files]


def print_report(res: dict[str, Any], meta: dict[str, Any]) -> None:
    cores = ", ".join(f"{s['name']} {s['cores']}" for s in meta["systems"])
    print(f"equal cores on every system (workers x threads): {cores}")
    for name, r in res.items():
        slo, shares = r["slo"], r["workload"]["classes"]
        print(f"{name} ({r['workload']['mix']}): >= {slo['target']:.0%} of requests within their class's SLO "
              f"= TTFT {slo['ttft_scale']:g}x, TPOT {slo['tpot_scale']:g}x the class alone on colocated")  # fmt: skip
        for c, b in slo["classes"].items():
            print(f"  {c} ({shares[c]['share']:.0%}): SLO TTFT {b['ttft_s']:.3f} s, TPOT {b['tpot_s']:.4f} s")
        for s, v in r["systems"].items():
            alone = "; ".join(f"{c} {x['ttft_s']:.3f} / {x['tpot_s']:.4f} s" for c, x in v["unloaded"].items())
            curve = " ".join(f"{p['rate']:.3g}:{p['attainment']:.0%}" for p in v["points"])
            print(f"  {s:<16} alone, TTFT / TPOT: {alone}")
            print(f"  {'':<16} goodput {v['goodput_rps']:.3f} req/s   rate:attainment {curve}")
        ratio = r["goodput_ratio"]
        print(f"  P/D / colocated ({r['colocated_system']}) goodput: " + ("-" if ratio is None else f"{ratio:.2f}x"))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench compare", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke check: shorter lengths, fewer rates, one colocated")
    ap.add_argument("--mix", action="append", choices=list(FULL.mixes), help="only this mix (repeatable; default all)")
    ap.add_argument("--ttft-scale", type=float, default=TTFT_SCALE, help="TTFT SLO = this x the class alone")
    ap.add_argument("--tpot-scale", type=float, default=TPOT_SCALE, help="TPOT SLO = this x the class alone")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", default="out/bench/compare", help="directory for compare.json and the PNGs")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if not ready_to_serve("tandem bench compare"):
        return 2
    plan = QUICK if args.quick else FULL
    if args.mix:
        plan = replace(plan, mixes={k: m for k, m in plan.mixes.items() if k in args.mix})
    scales = (args.ttft_scale, args.tpot_scale)
    t0 = time.monotonic()
    base: dict[str, float] = {}
    measured: Measured = {
        s.name: run_system(s, plan, base, scales, args.seed, not args.no_progress) for s in plan.systems
    }
    res = evaluate(measured, plan, scales)
    meta = {"quick": args.quick, "seed": args.seed, "elapsed_s": time.monotonic() - t0, "cores": plan.systems[0].cores,
            "systems": [{**vars(s), "cores": s.cores} for s in plan.systems], "base_rps": base}  # fmt: skip
    files: list[str] = []
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        files = [*write_plots(res, measured, out), str(out / "compare.json")]
        (out / "compare.json").write_text(json.dumps({**res, "meta": meta, "files": files}, indent=2))
    if args.json:
        print(json.dumps({**res, "meta": meta, "files": files}))
    else:
        print_report(res, meta)
        print(f"took {meta['elapsed_s']:.0f} s" + (f"; wrote {', '.join(files)}" if files else ""))
    return 0
