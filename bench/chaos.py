"""tandem bench chaos: faults under load on a live local cluster, and what the clients saw.

Scenarios (bench.chaos_scenarios, bench.chaos_control): a decode worker SIGKILLed mid-stream
(one of two, and the only one), a prefill worker SIGKILLed mid-transfer, a decode worker
SIGSTOPped for 15 s, a prefill worker SIGSTOPped for 15 s mid-transfer, the embedded Redis
SIGKILLed, the pool manager SIGKILLed, a second router joining the pools and leaving, clients
hanging up while queued and in prefill, and the pools resized, drained and flipped under load
(bench.chaos_admin). Each runs its load undisturbed first: that run is the
baseline its added latency is measured against, and the reference its answers must equal.
Per scenario: completed / errored / hung, added p99 latency, time to recovery, blocks held
after idle. The target is 0 errored, 0 hung and 0 held blocks everywhere.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import asdict

from bench.chaos_admin import admin_churn
from bench.chaos_harness import Chaos, ScenarioResult
from bench.chaos_scenarios import SCENARIOS as FAULTS
from bench.harness import ready_to_serve, running_cluster, serving
from bench.harness import unique_namespace as namespace
from bench.json_out import print_json
from cluster.cluster import ClusterConfig
from engine.config import EngineConfig

SCENARIOS = {**FAULTS, "admin-churn": admin_churn}


def run(names: list[str], quick: bool, dtype: str = "auto", speculative: str = "suffix") -> list[ScenarioResult]:
    """Start 1P+2D, serve it, run the named scenarios in order; the cluster is shut down after.
    By default the engine `tandem serve` runs: `auto` dtype, suffix speculation."""
    engine = EngineConfig(dtype=dtype, num_blocks=512, num_threads=1, max_num_seqs=64,  # type: ignore[arg-type]
                          max_num_batched_tokens=256, speculative=speculative)  # fmt: skip
    config = ClusterConfig(namespace=namespace("chaos"), prefill=1, decode=2, engine=engine)
    results = []
    with running_cluster(config) as cluster, serving(cluster, max_running=128) as url:
        chaos = Chaos(cluster, url, max_tokens=32 if quick else 64)
        for name in names:
            results.append(SCENARIOS[name](chaos))
    return results


def table(results: list[ScenarioResult]) -> str:
    rows = [
        "| scenario | completed | errored | hung | added p99 | recovery | held blocks |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        rows.append(
            f"| {r.name} | {r.completed}/{r.requests} | {r.errored} | {r.hung} | {r.added_p99_s:.2f} s "
            f"| {r.recovery_s:.1f} s | {r.held_blocks} |"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench chaos", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="shorter answers (32 tokens instead of 64)")
    ap.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated, of {','.join(SCENARIOS)}")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"],
                    help="as `tandem serve --dtype` (default: auto, as it)")  # fmt: skip
    ap.add_argument("--speculative", default="suffix", choices=["off", "ngram", "suffix"],
                    help="as `tandem serve --speculative` (default: suffix, as it)")  # fmt: skip
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"tandem bench chaos: unknown scenario(s) {unknown}; choose from {list(SCENARIOS)}", file=sys.stderr)
        return 2
    if not ready_to_serve("tandem bench chaos"):
        return 2
    t0 = time.monotonic()
    results = run(names, args.quick, args.dtype, "" if args.speculative == "off" else args.speculative)
    if args.json:
        print_json({"scenarios": [asdict(r) for r in results], "elapsed_s": time.monotonic() - t0})
        return 0
    print(table(results))
    for r in results:
        print(
            f"  {r.name}: "
            + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.facts.items())
        )
    bad = sum(r.errored + r.hung + r.held_blocks for r in results)
    print(f"{'all clean' if bad == 0 else 'FAULTS LEAKED TO CLIENTS OR BLOCKS'} in {time.monotonic() - t0:.0f} s")
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
