"""What `tandem bench compare` reports from what it measured (bench.compare runs the systems):
per mix, each request class's SLO, each system's attainment curve and goodput, and P/D against
the better colocated system; as a dict (compare.json, `--json`), as text and as plots.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench import plots
from bench.stats import SLO, ClassSLO, goodput, max_rate_meeting, summarize
from bench.sweep import Point, Unloaded

if TYPE_CHECKING:
    from bench.compare import Plan

TARGET = 0.9  # goodput: the highest rate at which this share of requests meets its class's SLO


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
            "rate": p.rate, "index": p.index, "attainment": a, "goodput_rps": goodput(p.results, slo, p.duration_s),
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
