"""`tandem bench serve`: load any OpenAI-compatible endpoint and report latency, throughput and goodput.

    tandem bench serve --url http://127.0.0.1:8000 --mix chat --rate 0.5,1,2 --slo-ttft 2 --slo-tpot 0.1

Several rates (comma-separated) make a sweep: each rate gets the same shapes with fresh text, so
no rate is served from the prefix cache an earlier rate filled.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench import plots
from bench.json_out import print_json
from bench.loadgen import Target, first_model, run_load
from bench.stats import SLO, RequestResult, summarize
from bench.workloads import MIXES, WorkItem, load_jsonl, make_items


def _rates(text: str) -> list[float]:
    try:
        rates = [float(r) for r in text.split(",") if r.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"rates must be numbers, comma-separated: {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError("rates must be > 0")
    return rates


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tandem bench serve", description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is ok)")
    ap.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    load = ap.add_mutually_exclusive_group()
    load.add_argument("--rate", type=_rates, help="open loop: requests/s, or a comma-separated sweep")
    load.add_argument("--concurrency", type=int, help="closed loop: clients each with one request in flight")
    ap.add_argument("--arrival", choices=["poisson", "constant"], default="poisson")
    src = ap.add_mutually_exclusive_group()
    src.add_argument(
        "--mix",
        choices=sorted(MIXES),
        default="chat",
        help="; ".join(f"{k}: {m.description}" for k, m in MIXES.items()),
    )
    src.add_argument("--prompts", help='JSONL: {"prompt", "max_tokens"} or {"messages", "max_tokens"} per line')
    ap.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="per rate (default 100; with --duration, enough for it, at most 10000 closed-loop)",
    )
    ap.add_argument("--duration", type=float, default=None, help="stop sending after this many seconds")
    ap.add_argument("--slo-ttft", type=float, default=None, help="TTFT SLO in seconds")
    ap.add_argument("--slo-tpot", type=float, default=None, help="TPOT SLO in seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--no-ignore-eos", action="store_true", help="do not send ignore_eos (for strict servers)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", default="out/bench/serve", help="directory for results.json, requests.jsonl, PNGs")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def workload(args: argparse.Namespace, n: int, salt: int) -> list[WorkItem]:
    if args.prompts:
        items = load_jsonl(args.prompts)
        return (items * (n // len(items) + 1))[:n]
    return make_items(MIXES[args.mix], n, seed=args.seed, salt=salt)


def count(args: argparse.Namespace, rate: float | None) -> int:
    if args.num_requests is not None:
        return int(args.num_requests)
    if args.duration is not None:
        return int(rate * args.duration * 1.5) + 10 if rate else 10_000
    return 100


def run(args: argparse.Namespace) -> dict[str, Any]:
    """The whole benchmark as a JSON-able dict; per-request results under the private "_requests"."""
    model = args.model or asyncio.run(first_model(args.url, args.api_key))
    target = Target(args.url, model, args.api_key, not args.no_ignore_eos, args.timeout)
    slo = SLO(args.slo_ttft, args.slo_tpot)
    loads: list[tuple[float | None, int | None]] = (
        [(r, None) for r in args.rate] if args.rate else [(None, args.concurrency or 1)]
    )
    runs: list[dict[str, Any]] = []
    requests: dict[str, list[RequestResult]] = {}
    for i, (rate, conc) in enumerate(loads):
        items = workload(args, count(args, rate), salt=i)
        label = f"{rate:g} req/s" if rate else f"concurrency {conc}"
        results, duration = asyncio.run(
            run_load(target, items, rate=rate, concurrency=conc, arrival=args.arrival, seed=args.seed + i,
                     duration_s=args.duration, progress=not args.no_progress, desc=label)
        )  # fmt: skip
        requests[label] = results
        runs.append({"label": label, "rate": rate, "concurrency": conc, **summarize(results, duration, slo)})
    return {
        "url": args.url,
        "model": model,
        "workload": {"prompts": args.prompts} if args.prompts else {"mix": args.mix, "seed": args.seed},
        "arrival": args.arrival if args.rate else "closed-loop",
        "slo": asdict(slo),
        "runs": runs,
        "_requests": requests,
    }


def write(res: dict[str, Any], out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    requests: dict[str, list[RequestResult]] = res["_requests"]
    with (out / "requests.jsonl").open("w") as f:
        for label, results in requests.items():
            for r in results:
                f.write(json.dumps({"run": label, **asdict(r), "tpot": r.tpot}) + "\n")
    slo = SLO(**res["slo"])
    files = [out / "requests.jsonl", plots.latency_cdfs(requests, out / "latency_cdf.png", slo, res["model"])]
    points = [(r["rate"] or r["throughput_rps"], r["slo_attainment"]) for r in res["runs"]]
    files.append(plots.attainment_vs_rate({res["model"]: {"measured": points}}, out / "slo_attainment.png"))
    files.append(out / "results.json")
    public = {k: v for k, v in res.items() if not k.startswith("_")}
    (out / "results.json").write_text(json.dumps({**public, "files": [str(p) for p in files]}, indent=2))
    return [str(p) for p in files]


def _fmt(d: dict[str, float] | None, key: str) -> str:
    return "-" if d is None else f"{d[key]:.3f}"


def print_report(res: dict[str, Any]) -> None:
    slo = res["slo"]
    print(f"bench serve: {res['url']} model {res['model']}, {res['workload']}, {res['arrival']}, SLO {slo}")
    head = f"{'load':<16}{'ok/sent':>9}{'req/s':>7}{'out tok/s':>10}"
    for m in ("TTFT", "TPOT", "E2E"):
        head += f"{m + ' p50/p90/p99 (s)':>24}"
    print(head + f"{'SLO met':>9}{'goodput':>9}")
    for r in res["runs"]:
        line = f"{r['label']:<16}{r['completed']:>4}/{r['requests']:<4}"
        line += f"{r['throughput_rps']:>7.2f}{r['output_tok_s']:>10.1f}"
        for key in ("ttft_s", "tpot_s", "e2e_s"):
            line += f"{'/'.join(_fmt(r[key], p) for p in ('p50', 'p90', 'p99')):>24}"
        print(line + f"{r['slo_attainment']:>9.1%}{r['goodput_rps']:>9.2f}")
        if r["breakdown"]:
            parts = [f"{k[:-2]} {v['mean']:.3f}/{v['p90']:.3f}" for k, v in r["breakdown"].items()]
            print(f"{'':<16}server breakdown, mean/p90 s: " + ", ".join(parts))
        if r["prefix_hit_rate"] is not None:
            print(f"{'':<16}prefix cache hit rate {r['prefix_hit_rate']:.1%}")
        for e in r["errors"]:
            print(f"{'':<16}error: {e}")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.concurrency is not None and args.concurrency < 1:
        print("--concurrency must be >= 1", file=sys.stderr)
        return 2
    res = run(args)
    files = write(res, Path(args.out)) if args.out else []
    public = {k: v for k, v in res.items() if not k.startswith("_")}
    if args.json:
        print_json({**public, "files": files})
    else:
        print_report(public)
        if files:
            print(f"wrote {', '.join(files)}")
    return 0 if all(r["completed"] for r in res["runs"]) else 1
