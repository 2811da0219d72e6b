"""`tandem bench router`: latency the HTTP router adds over calling `cluster.Cluster` directly,
its own per-request work over a null backend, and the fixed cost of disaggregation at idle.

router overhead   the same requests (a short prompt, max_tokens=1) at the same concurrency on
                  one 1P+1D cluster, through the router and directly, interleaved round by round
                  so drift hits both alike; the router is served by uvicorn in this process.
                  p50/p90 of each and the p50 difference.
null backend      no cluster: the router app over bench.null_backend.NullBackend (every request
                  answered at once) and a bare ASGI app answering the same bytes, each on its own
                  uvicorn in this process; one client, one request at a time, alternating between
                  the two, whole and streamed. The router's own work = its p50 - the bare app's.
fixed cost        one request at a time, a ~40-token chat prompt: TTFT on the P/D route minus
                  TTFT on a colocated worker of the same cluster (same engine config), p50, with
                  the P/D route's breakdown (prefill worker, transfer commit, the rest). Each
                  prompt is new, so no route hits a prefix cache.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx

from bench.harness import exit_on_sigterm, running_cluster, serving, unique_namespace, uvicorn_thread, wait_pools
from bench.json_out import print_json
from bench.null_backend import BareApp, NullBackend
from cluster.cluster import Cluster, ClusterConfig
from cluster.outputs import Placement
from cluster.routing import Route
from engine.config import EngineConfig
from engine.model_files import default_model_path
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.app import create_app
from router.settings import RouterSettings

PROMPT = "Name one colour of the rainbow."
NULL_WARMUP = 20  # requests per path before the timed ones (fewer when fewer are timed)
ROUNDS = {"rounds": 8, "fixed_rounds": 20, "null_rounds": 500}  # the defaults of the flags of these names
QUICK_ROUNDS = {"rounds": 2, "fixed_rounds": 5, "null_rounds": 100}


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


def _timed(client: httpx.Client, url: str, body: dict[str, object]) -> float:
    """Seconds from sending `body` to the last byte of the answer."""
    t = time.perf_counter()
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        for _ in r.iter_raw():
            pass
    return time.perf_counter() - t


def measure_null(rounds: int) -> dict[str, float]:
    """The router over NullBackend against BareApp, `rounds` requests a path (see the docstring)."""
    backend = NullBackend(Tokenizer.load(default_model_path()))
    body: dict[str, object] = {"model": backend.model.name, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    stream = {**body, "stream": True}
    warmup = min(NULL_WARMUP, rounds)
    times: dict[tuple[str, bool], list[float]] = {(p, s): [] for p in ("router", "bare") for s in (False, True)}
    with httpx.Client(timeout=30) as client, uvicorn_thread(create_app(backend, RouterSettings())) as router:
        whole = client.post(f"{router}/v1/completions", json=body).raise_for_status().content
        events = client.post(f"{router}/v1/completions", json=stream).raise_for_status().content
        bare_app = BareApp(whole, [e + b"\n\n" for e in events.split(b"\n\n") if e])
        with uvicorn_thread(bare_app) as bare:
            urls = {"router": router, "bare": bare}
            for i in range(warmup + rounds):
                order = list(urls) if i % 2 else list(reversed(urls))  # neither always goes first
                for streamed in (False, True):
                    for path in order:
                        elapsed = _timed(client, urls[path], stream if streamed else body)
                        if i >= warmup:
                            times[path, streamed].append(elapsed)
    res: dict[str, float] = {}
    for streamed, tag in ((False, ""), (True, "_stream")):
        r, b = times["router", streamed], times["bare", streamed]
        res |= {
            f"router_null_backend{tag}_ms": 1000 * _pct(r, 50),
            f"router_null_backend{tag}_p90_ms": 1000 * _pct(r, 90),
            f"bare_asgi{tag}_ms": 1000 * _pct(b, 50),
            f"bare_asgi{tag}_p90_ms": 1000 * _pct(b, 90),
            f"router_own{tag}_ms": 1000 * (_pct(r, 50) - _pct(b, 50)),
        }
    return res


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


def _print_null(res: dict[str, float], rounds: int) -> None:
    print(f"router over a null backend: {rounds} requests a path, one at a time, alternating with a bare "
          "ASGI app on the same uvicorn")  # fmt: skip
    print(f"{'path':<40}{'p50 ms':>10}{'p90 ms':>10}")
    for tag, how in (("", "whole"), ("_stream", "stream=true, read to the end")):
        router, bare = f"router_null_backend{tag}", f"bare_asgi{tag}"
        print(f"{f'router, {how}':<40}{res[f'{router}_ms']:>10.2f}{res[f'{router}_p90_ms']:>10.2f}")
        print(f"{f'bare ASGI, {how}':<40}{res[f'{bare}_ms']:>10.2f}{res[f'{bare}_p90_ms']:>10.2f}")
    for tag, how in (("", "whole"), ("_stream", "streamed")):
        ratio = res[f"router_null_backend{tag}_ms"] / res[f"bare_asgi{tag}_ms"]
        print(f"router's own work, {how}: {res[f'router_own{tag}_ms']:.2f} ms at p50 "
              f"({ratio:.1f}x the bare app; target <= 1 ms)")  # fmt: skip


def _print_cluster(res: dict[str, float], args: argparse.Namespace) -> None:
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="tandem bench router", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--rounds", type=int, help="rounds of the router overhead (default 8; --quick 2)")
    ap.add_argument(
        "--fixed-rounds", type=int, help="idle requests per route for the fixed cost (default 20; --quick 5)"
    )
    ap.add_argument(
        "--null-rounds", type=int, help="requests per path on the null backend (default 500; --quick 100; 0: skip)"
    )
    ap.add_argument("--null-only", action="store_true", help="only the null-backend part: no cluster")
    ap.add_argument("--quick", action="store_true", help="fewer rounds of each part")
    ap.add_argument("--dtype", default="auto", help="the workers' dtype (default: auto)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    for name, value in (QUICK_ROUNDS if args.quick else ROUNDS).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    exit_on_sigterm()
    res: dict[str, float] = {}
    if args.null_rounds > 0:  # first: no workers busy on the cores yet
        res |= measure_null(args.null_rounds)
    if not args.null_only:
        config = ClusterConfig(
            namespace=unique_namespace("router-bench"),
            engine=EngineConfig(dtype=args.dtype, num_blocks=256, num_threads=1),
        )
        with running_cluster(config) as cluster:
            with serving(cluster, max_running=args.concurrency * 2) as url:
                res |= measure(cluster, url, args.concurrency, args.rounds)
            res |= fixed_cost(cluster, args.fixed_rounds)
    if args.json:
        print_json({k: round(v, 3) for k, v in res.items()})
        return 0
    if args.null_rounds > 0:
        _print_null(res, args.null_rounds)
    if not args.null_only:
        _print_cluster(res, args)
    return 0
