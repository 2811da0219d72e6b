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
requests meet their own class's SLO (see bench.stats.max_rate_meeting). bench.compare_report turns
the measurements into the report: compare.json, the text and the plots.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from bench.compare_report import TARGET, Measured, MixRun, class_slo, evaluate, print_report, write_plots
from bench.harness import (
    ready_to_serve,
    running_cluster,
    serving,
    unique_namespace,
)
from bench.json_out import print_json
from bench.loadgen import Target, first_model
from bench.sweep import Unloaded, probe, sweep
from bench.workloads import MIXES, LengthDist, Mix
from cluster.cluster import ClusterConfig
from engine.config import EngineConfig

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
    router: tuple[tuple[str, int], ...] = ()  # RouterSettings fields this system's router overrides
    lend_cores: bool = True  # EngineConfig.lend_cores: the workers of the host lend idle cores

    @property
    def pd(self) -> bool:
        return self.prefill > 0

    @property
    def cores(self) -> int:
        return (self.prefill + self.decode + self.colocated) * self.threads


COLOCATED_1X2 = System("colocated 1x2t", 0, 0, 1, 2)
COLOCATED_2X1 = System("colocated 2x1t", 0, 0, 2, 1)
PD = System("P/D 1P+1D 1t", 1, 1, 0, 1)
PD_SPILL = System("P/D 1P+1D 1t, spill", 1, 1, 0, 1, (("spill_streams", 2),))  # the spill route, against PD
PD_OVERFLOW = System("P/D 1P+1D 1t, overflow", 1, 1, 0, 1, (("overflow_below_tokens", 1024),))  # against PD


def static_cores(system: System) -> System:
    """`system` with each worker on its own share of the cores, busy peers or not (the A/B of
    engine/core_ledger.py)."""
    return replace(system, name=f"{system.name}, static cores", lend_cores=False)


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
    max_prefill_chunk: int | None = None  # EngineConfig's (None: its default)
    speculative: str = ""  # EngineConfig's: off here unless asked (`tandem serve` defaults to suffix)

    def __post_init__(self) -> None:
        if len({s.cores for s in self.systems}) != 1:
            raise ValueError(f"systems must have equal cores: {[(s.name, s.cores) for s in self.systems]}")
        if self.requests < 1 or self.max_seconds <= 0:
            raise ValueError(f"--requests must be >= 1 and --max-seconds > 0, got {self.requests}, {self.max_seconds}")


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


def base_rate(mix: Mix, alone: Mapping[str, Unloaded]) -> float:
    """Requests per second one at a time: 1 / the mean unloaded E2E over the mix's classes."""
    return 1.0 / sum(share * alone[shape.name].e2e_s for share, shape in mix.classes)


def engine_config(system: System, plan: Plan) -> EngineConfig:
    """What each worker of `system` runs in `plan`."""
    return EngineConfig(
        num_blocks=plan.num_blocks,
        num_threads=system.threads,
        max_prefill_chunk=plan.max_prefill_chunk,
        lend_cores=system.lend_cores,
        speculative=plan.speculative,
    )


def run_system(
    system: System,
    plan: Plan,
    base: dict[str, float],
    colocated: dict[str, list[Mapping[str, Unloaded]]],
    scales: tuple[float, float],
    seed: int,
    progress: bool,
) -> dict[str, MixRun]:
    """Start `system`, probe each class and sweep every mix, shut it down. `base` (req/s per mix)
    is set by the first system and reused, so every system sees the same rates. `colocated` (per
    mix, the unloaded latencies of the colocated systems run so far) makes the sweep's SLO as
    close to the final one as is known yet: that is what its lowest rate must meet."""
    config = ClusterConfig(
        namespace=unique_namespace("bench-compare"),
        prefill=system.prefill,
        decode=system.decode,
        colocated=system.colocated,
        engine=engine_config(system, plan),
    )
    out: dict[str, MixRun] = {}
    with running_cluster(config) as cluster, serving(cluster, False, **dict(system.router)) as url:
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
            known = colocated.setdefault(name, [])
            if not system.pd:
                known.append(alone)
            stop = class_slo(known or [alone], *scales)  # provisional: the final SLOs come from every colocated system
            floor = (TARGET, 2)  # a lowest rate that misses the target: up to 2 more points, each at half
            points = sweep(target, mix, rates, stop, plan.requests, plan.max_seconds, mix_seed, progress, floor)
            out[name] = MixRun(alone, points)
    return out


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
    ap.add_argument("--max-prefill-chunk", type=int, default=None, help="every worker's (0: the whole budget)")
    ap.add_argument("--requests", type=int, default=None, help="requests a rate, at most (default: 32, quick 8): "
                    "more tell a noisy rate from a real drop, and take longer")  # fmt: skip
    ap.add_argument("--max-seconds", type=float, default=None, help="seconds of sending a rate, at most "
                    "(default: 90, quick 12)")  # fmt: skip
    ap.add_argument("--speculative", choices=["off", "ngram", "suffix"], default="off",
                    help="every worker's speculative decoding (tandem serve's default is suffix)")  # fmt: skip
    ap.add_argument("--spill-too", action="store_true", help="also run P/D with the spill route on, same rates")
    ap.add_argument("--overflow-too", action="store_true", help="also run P/D with the overflow route on, same rates")
    ap.add_argument("--static-cores-too", action="store_true", help="also run each system of several workers "
                    "with lending of idle cores off (engine/core_ledger.py), right after it, same rates")  # fmt: skip
    names = [s.name for s in FULL.systems]
    ap.add_argument("--system", action="append", choices=names, help="only this system (repeatable; default all)")
    args = ap.parse_args(argv)
    if not ready_to_serve("tandem bench compare"):
        return 2
    plan = QUICK if args.quick else FULL
    if args.mix:
        plan = replace(plan, mixes={k: m for k, m in plan.mixes.items() if k in args.mix})
    if args.system:
        plan = replace(plan, systems=tuple(s for s in plan.systems if s.name in args.system))
        if not any(s.pd for s in plan.systems) or all(s.pd for s in plan.systems):
            ap.error("--system: name a colocated system and the P/D one (the SLOs come from colocated)")
    if args.max_prefill_chunk is not None:
        plan = replace(plan, max_prefill_chunk=args.max_prefill_chunk)
    if args.speculative != "off":
        plan = replace(plan, speculative=args.speculative)
    try:
        if args.requests is not None:
            plan = replace(plan, requests=args.requests)
        if args.max_seconds is not None:
            plan = replace(plan, max_seconds=args.max_seconds)
    except ValueError as e:
        ap.error(str(e))
    if args.spill_too:
        plan = replace(plan, systems=(*plan.systems, PD_SPILL))
    if args.overflow_too:
        plan = replace(plan, systems=(*plan.systems, PD_OVERFLOW))
    if args.static_cores_too:
        pairs = ((s, static_cores(s)) if s.prefill + s.decode + s.colocated > 1 else (s,) for s in plan.systems)
        plan = replace(plan, systems=tuple(s for pair in pairs for s in pair))
    scales = (args.ttft_scale, args.tpot_scale)
    t0 = time.monotonic()
    base: dict[str, float] = {}
    colocated: dict[str, list[Mapping[str, Unloaded]]] = {}
    measured: Measured = {
        s.name: run_system(s, plan, base, colocated, scales, args.seed, not args.no_progress) for s in plan.systems
    }
    res = evaluate(measured, plan, scales)
    meta = {"quick": args.quick, "seed": args.seed, "elapsed_s": time.monotonic() - t0, "cores": plan.systems[0].cores,
            "systems": [{**vars(s), "cores": s.cores} for s in plan.systems], "base_rps": base,
            "max_prefill_chunk": plan.max_prefill_chunk, "speculative": plan.speculative or "off",
            "requests": plan.requests, "max_seconds": plan.max_seconds}  # fmt: skip
    files: list[str] = []
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        files = [*write_plots(res, measured, out), str(out / "compare.json")]
        (out / "compare.json").write_text(json.dumps({**res, "meta": meta, "files": files}, indent=2))
    if args.json:
        print_json({**res, "meta": meta, "files": files})
    else:
        print_report(res, meta)
        print(f"took {meta['elapsed_s']:.0f} s" + (f"; wrote {', '.join(files)}" if files else ""))
    return 0
