"""`tandem bench prefix`: what prefix caching and cache-aware routing buy on multi-turn chat.

    TTFT      1 prefill + 1 decode worker, the same conversations with prefix caching on and off
              (EngineConfig.enable_prefix_caching); median over follow-up turns (turn >= 1)
    reuse     how a next turn finds the last answer's KV, caching on: (a) the local route (the
              default: the turn runs on the decode worker that wrote the answer), (b) write-back
              (the answer's KV copied to the prefill worker after each turn, local route off),
              and neither (the prefill worker holds only the prompts it prefilled)
    hit rate  the same shapes, fresh text each run, on 1 prefill worker and on 2 prefill workers
              routed cache-aware (the router's default: the longest prefix in the shared index)
              or round robin (bench.harness.RoundRobinPrefill, a Backend wrapper)

Hit rate: prompt tokens the prefill worker found cached over all prompt tokens, summed over
requests, from the `cached_tokens` the router reports per request (the prefill engine's own
count at admission), not an estimate from the index.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import plots
from bench.harness import (
    ready_to_serve,
    running_cluster,
    serving,
    unique_namespace,
    wait_pools,
)
from bench.json_out import print_json
from bench.loadgen import Target, first_model, run_load
from bench.stats import SLO, RequestResult, distribution, hit_rate
from bench.workloads import MIXES, Mix, make_items
from cluster.cluster import Cluster, ClusterConfig
from engine.config import EngineConfig


@dataclass(frozen=True)
class Plan:
    mix: Mix
    requests: int
    concurrency: int  # closed loop: clients with one request in flight each
    active: int  # conversations under way at once
    num_blocks: int = 1024


FULL = Plan(MIXES["multiturn"].scaled(input=0.6, output=0.4), requests=64, concurrency=4, active=8)
QUICK = Plan(MIXES["multiturn"].scaled(input=0.5, output=0.25), requests=24, concurrency=4, active=6, num_blocks=512)


@dataclass
class Run:
    name: str
    results: list[RequestResult]
    duration_s: float

    def followup_ttfts(self) -> list[float]:
        return [r.ttft for r in self.results if r.ok and r.turn >= 1]

    def summary(self) -> dict[str, Any]:
        ok = [r for r in self.results if r.ok]
        return {
            "requests": len(self.results),
            "failed": len(self.results) - len(ok),
            "errors": sorted({r.error for r in self.results if not r.ok})[:3],
            "duration_s": self.duration_s,
            "hit_rate": hit_rate(self.results),
            "ttft_followup_s": distribution(self.followup_ttfts()),
            "ttft_all_s": distribution(r.ttft for r in ok),
            "prompt_tokens": sum(r.prompt_tokens for r in ok),
            "cached_tokens": sum(r.cached_tokens or 0 for r in ok),
            "requests_per_prefill_worker": dict(Counter(str(r.timing.get("prefill_worker")) for r in ok if r.timing)),
        }


def run_once(
    cluster: Cluster,
    plan: Plan,
    name: str,
    salt: int,
    seed: int,
    progress: bool,
    rr: bool = False,
    reuse: str = "local",
) -> Run:
    """One pass of the workload through a fresh router over `cluster`. `reuse`: how a next turn
    finds the last answer's KV: "local" (the router's default: the turn runs on the decode worker
    that wrote it), "write_back" (copied to the prefill worker after each turn, local route off)
    or "none" (both off: the prefill worker holds only what it prefilled)."""
    print(f"[prefix] {name}", file=sys.stderr)
    items = make_items(plan.mix, plan.requests, seed=seed, salt=salt, active=plan.active)
    cluster.config.write_back = reuse == "write_back"
    settings = {} if reuse == "local" else {"local_below_tokens": 0}
    with serving(cluster, round_robin=rr, **settings) as url:
        target = Target(url, asyncio.run(first_model(url)), timeout_s=180.0)
        results, duration = asyncio.run(
            run_load(target, items, concurrency=plan.concurrency, progress=progress, desc=name)
        )
    return Run(name, results, duration)


def config(plan: Plan, caching: bool) -> ClusterConfig:
    engine = EngineConfig(num_blocks=plan.num_blocks, num_threads=1, enable_prefix_caching=caching)
    return ClusterConfig(namespace=unique_namespace("bench-prefix"), prefill=1, decode=1, engine=engine)


def measure(plan: Plan, seed: int, progress: bool) -> dict[str, Run]:
    """Two clusters: caching on (1 prefill worker, then 2), caching off. Salts keep runs apart:
    nothing one run leaves in a cache is a prefix of another run's prompts."""
    runs: dict[str, Run] = {}
    with running_cluster(config(plan, caching=True)) as cluster:
        runs["single"] = run_once(cluster, plan, "1 prefill worker, caching on", 0, seed, progress)
        runs["write_back"] = run_once(cluster, plan, "write-back, local route off", 3, seed, progress,
                                      reuse="write_back")  # fmt: skip
        runs["prefill_only"] = run_once(cluster, plan, "no write-back, local route off", 4, seed, progress,
                                        reuse="none")  # fmt: skip
        wait_pools(cluster, prefill=2, decode=1)
        runs["cache_aware"] = run_once(cluster, plan, "2 prefill workers, cache-aware", 1, seed, progress)
        runs["round_robin"] = run_once(cluster, plan, "2 prefill workers, round robin", 2, seed, progress, rr=True)
    with running_cluster(config(plan, caching=False)) as cluster:
        runs["cold"] = run_once(cluster, plan, "1 prefill worker, caching off", 0, seed, progress)
    return runs


def report(runs: dict[str, Run], plan: Plan) -> dict[str, Any]:
    def median(xs: list[float]) -> float | None:
        return statistics.median(xs) if xs else None

    return {
        "cached_ttft_s": median(runs["single"].followup_ttfts()),
        "cold_ttft_s": median(runs["cold"].followup_ttfts()),
        "write_back_ttft_s": median(runs["write_back"].followup_ttfts()),
        "prefill_cache_only_ttft_s": median(runs["prefill_only"].followup_ttfts()),
        "hit_rate_cache_aware": hit_rate(runs["cache_aware"].results),
        "hit_rate_round_robin": hit_rate(runs["round_robin"].results),
        "hit_rate_single": hit_rate(runs["single"].results),
        "definitions": {
            "ttft": "median TTFT of follow-up turns (turn >= 1), 1P+1D, closed loop",
            "cached_ttft_s": "(a) the default: a next turn runs on the decode worker that wrote the answer",
            "write_back_ttft_s": "(b) the answer's KV copied to the prefill worker after each turn; (a) off",
            "prefill_cache_only_ttft_s": "neither: the prefill worker's cache holds only what it prefilled",
            "hit_rate": "sum of per-request cached prompt tokens (prefill engine) / sum of prompt tokens",
        },
        "workload": {
            "mix": plan.mix.name,
            "input_per_turn": vars(plan.mix.input),
            "output": vars(plan.mix.output),
            "turns": plan.mix.turns,
            "system_tokens": plan.mix.system,
            "requests": plan.requests,
            "concurrency": plan.concurrency,
            "active_conversations": plan.active,
        },
        "runs": {k: {"name": r.name, **r.summary()} for k, r in runs.items()},
    }


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench prefix", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke check: fewer, shorter conversations")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", default="out/bench/prefix", help="directory for prefix.json and a TTFT CDF plot")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    if not ready_to_serve("tandem bench prefix"):
        return 2
    plan = QUICK if args.quick else FULL
    t0 = time.monotonic()
    runs = measure(plan, args.seed, not args.no_progress)
    res = {**report(runs, plan), "quick": args.quick, "elapsed_s": time.monotonic() - t0}
    if args.out:
        out = Path(args.out)
        series = {
            "caching on, (a) local route": runs["single"].results,
            "caching on, (b) write-back": runs["write_back"].results,
            "caching off": runs["cold"].results,
        }
        png = plots.latency_cdfs(series, out / "prefix_ttft_cdf.png", SLO(), "multi-turn chat, 1P+1D")
        res["files"] = [str(png), str(out / "prefix.json")]
        (out / "prefix.json").write_text(json.dumps(res, indent=2))
    if args.json:
        print_json(res)
        return 0
    print(f"multi-turn chat ({plan.requests} requests, closed loop x{plan.concurrency}), 1 thread per worker")
    print(f"  follow-up TTFT, median: caching on {_s(res['cached_ttft_s'])}, off {_s(res['cold_ttft_s'])}")
    print(f"  answer reuse: (a) local route {_s(res['cached_ttft_s'])}, (b) write-back "
          f"{_s(res['write_back_ttft_s'])}, neither {_s(res['prefill_cache_only_ttft_s'])}")  # fmt: skip
    print(f"  prefix hit rate: 1 prefill worker {_pct(res['hit_rate_single'])}; 2 workers cache-aware "
          f"{_pct(res['hit_rate_cache_aware'])}, round robin {_pct(res['hit_rate_round_robin'])}")  # fmt: skip
    for r in res["runs"].values():
        for err in r["errors"]:
            print(f"  {r['name']}: error: {err}")
    print(f"took {res['elapsed_s']:.0f} s" + (f"; wrote {', '.join(res['files'])}" if "files" in res else ""))
    return 0
