"""`tandem bench router`: latency the HTTP router adds over calling `cluster.Cluster` directly,
and the fixed cost of disaggregation at idle.

router overhead   the same requests (a short prompt, max_tokens=1) at the same concurrency on
                  one 1P+1D cluster, through the router and directly, interleaved round by round
                  so drift hits both alike; the router is served by uvicorn in this process.
                  p50/p90 of each and the p50 difference.
fixed cost        one request at a time, a ~40-token chat prompt: TTFT on the P/D route minus
                  TTFT on a colocated worker of the same cluster (same engine config), p50, with
                  the P/D route's breakdown (prefill worker, transfer commit, the rest). Each
                  prompt is new, so no route hits a prefix cache.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.harness import exit_on_sigterm, running_cluster, serving, unique_namespace, wait_pools
from cluster.cluster import Cluster, ClusterConfig
from cluster.outputs import Placement
from cluster.routing import Route
from engine.config import EngineConfig
from engine.model_files import default_model_path
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

PROMPT = "Name one colour of the rainbow."


def _round(fn: Callable[[int], None], concurrency: int) -> list[float]:
    def timed(i: int) -> float:
        t = time.perf_counter()
        fn(i)
        return time.perf_counter() - t

    with ThreadPoolExecutor(concurrency) as pool:
        return list(pool.map(timed, range(concurrency)))


def _pct(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[int(q) - 1] if len(xs) > 1 else xs[0]


def measure(cluster: Cluster, url: str, concurrency: int, rounds: int) -> dict[str, float]:
    tok = Tokenizer.load(default_model_path())
    ids = tok.encode(PROMPT)
    params = SamplingParams(max_tokens=1, temperature=0)
    body = {"model": "SmolLM2-135M-Instruct", "prompt": PROMPT, "max_tokens": 1, "temperature": 0}
    client = httpx.Client(timeout=60, limits=httpx.Limits(max_connections=concurrency))

    def direct(_: int) -> None:
        list(cluster.generate(ids, params))

    def routed(_: int) -> None:
        r = client.post(f"{url}/v1/completions", json=body)
        r.raise_for_status()

    _round(direct, concurrency)  # warm-up: connections, prefix cache
    _round(routed, concurrency)
    d: list[float] = []
    r: list[float] = []
    for _ in range(rounds):
        d += _round(direct, concurrency)
        r += _round(routed, concurrency)
    client.close()
    return {
        "direct_p50_ms": 1000 * _pct(d, 50),
        "direct_p90_ms": 1000 * _pct(d, 90),
        "router_p50_ms": 1000 * _pct(r, 50),
        "router_p90_ms": 1000 * _pct(r, 90),
        "router_overhead_p50_ms": 1000 * (_pct(r, 50) - _pct(d, 50)),
    }


def fixed_cost(cluster: Cluster, rounds: int) -> dict[str, float]:
    """P/D minus colocated TTFT at idle, interleaved, after two warm-up rounds (see the docstring)."""
    wait_pools(cluster, colocated=1)
    tok = Tokenizer.load(default_model_path())
    roles = {w["role"]: w["worker_id"] for w in cluster.workers() if w["state"] == "up"}
    routes = {"pd": Route(roles["decode"], roles["prefill"]), "colocated": Route(roles["colocated"])}
    params = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
    ttft: dict[str, list[float]] = {k: [] for k in routes}
    parts: list[Placement] = []
    for i in range(rounds + 2):
        for name, route in routes.items():
            text = f"Request {i} on {name}: name one colour of the rainbow."
            ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))
            t = time.perf_counter()
            outs = iter(cluster.generate(ids, params, route=route))
            first = next(outs)
            elapsed = time.perf_counter() - t
            for _ in outs:
                pass
            if i >= 2:
                ttft[name].append(elapsed)
                if first.placement is not None and name == "pd":
                    parts.append(first.placement)
    pd, colo = statistics.median(ttft["pd"]), statistics.median(ttft["colocated"])
    prefill = statistics.median(p.queue_s + p.prefill_s for p in parts)
    commit = statistics.median(p.transfer_s for p in parts)
    return {
        "pd_ttft_p50_ms": 1000 * pd,
        "colocated_ttft_p50_ms": 1000 * colo,
        "pd_fixed_cost_ms": 1000 * (pd - colo),
        "pd_prefill_worker_p50_ms": 1000 * prefill,
        "pd_transfer_commit_p50_ms": 1000 * commit,
        "pd_rest_p50_ms": 1000 * (pd - prefill - commit),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench router", description=__doc__)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--fixed-rounds", type=int, default=20, help="idle requests per route for the fixed cost")
    ap.add_argument("--dtype", default="auto", help="the workers' dtype (default: auto)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    exit_on_sigterm()
    config = ClusterConfig(
        namespace=unique_namespace("router-bench"),
        engine=EngineConfig(dtype=args.dtype, num_blocks=256, num_threads=1),
    )
    with running_cluster(config) as cluster:
        with serving(cluster, max_running=args.concurrency * 2) as url:
            res = measure(cluster, url, args.concurrency, args.rounds)
        res.update(fixed_cost(cluster, args.fixed_rounds))
    if args.json:
        print(json.dumps({k: round(v, 3) for k, v in res.items()}))
    else:
        print(f"router overhead: {args.concurrency} concurrent requests, max_tokens=1, {args.rounds} rounds each")
        print(f"{'path':<28}{'p50 ms':>10}{'p90 ms':>10}")
        print(f"{'cluster.Cluster directly':<28}{res['direct_p50_ms']:>10.1f}{res['direct_p90_ms']:>10.1f}")
        print(f"{'HTTP router':<28}{res['router_p50_ms']:>10.1f}{res['router_p90_ms']:>10.1f}")
        print(f"router adds {res['router_overhead_p50_ms']:.1f} ms at p50")
        print(f"fixed cost of P/D at idle ({args.fixed_rounds} requests a route, one at a time):")
        print(f"  TTFT p50: P/D {res['pd_ttft_p50_ms']:.1f} ms, colocated {res['colocated_ttft_p50_ms']:.1f} ms: "
              f"P/D costs {res['pd_fixed_cost_ms']:.1f} ms more (target <= 10)")  # fmt: skip
        print(f"  P/D TTFT p50s: prefill worker {res['pd_prefill_worker_p50_ms']:.1f}, transfer commit "
              f"{res['pd_transfer_commit_p50_ms']:.1f}, calls {res['pd_rest_p50_ms']:.1f} ms")  # fmt: skip
    return 0
