"""`tandem plan`: the goodput of every P:D split and of colocated serving for a trace, from the
simulator (planner.simulator), and with prices, the cheapest mix of node kinds per phase.

    tandem plan --trace T.jsonl --slo ttft=2,tpot=0.1 --nodes local=2 --profile profile-local.json
    tandem plan --synthetic chat:50:20000 --day --slo ttft=1,tpot=50ms \\
        --nodes H100-SXM=500@12.3,H200-SXM=300@15.1 --model llama-3.1-8b

For each node kind: goodput (requests a second at which >= 90% meet the SLO) of n colocated
workers and of P:D splits of n. With prices: at the trace's own rate, the fewest workers of each
kind (colocated) and of each pair of kinds (prefill, decode) meeting the SLOs, cheapest first.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

from bench.json_out import print_json
from bench.workloads import MIXES
from engine.model_files import default_model_path
from planner.kinds import model_config, parse_nodes, resolve
from planner.profile import EngineProfile
from planner.roofline import ModelShape, gpu_kv_dtype
from planner.search import Handoff, Option, cheapest, max_rate, splits
from planner.slo import parse_slo
from planner.trace import Trace, day_curve, synthetic


def load_trace(args: argparse.Namespace) -> Trace:
    if args.trace:
        return Trace.load(args.trace)
    mix_name, _, rest = args.synthetic.partition(":")
    rate, _, n = rest.partition(":")
    if mix_name not in MIXES:
        raise ValueError(f"--synthetic: no mix {mix_name!r}; one of {sorted(MIXES)}")
    try:
        r, count = float(rate), int(n or 1000)
    except ValueError:
        raise ValueError(f"--synthetic wants MIX:RATE[:N], got {args.synthetic!r}") from None
    if r <= 0 or count < 2:
        raise ValueError("--synthetic wants RATE > 0 and N >= 2")
    return synthetic(MIXES[mix_name], r, count, args.seed, day_curve() if args.day else ())


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="tandem plan", description=__doc__, formatter_class=raw)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--trace", help="JSONL: arrival, prompt, cached, output, class (planner.trace)")
    src.add_argument("--synthetic", help="MIX:RATE[:N]: N requests (default 1000) of a bench mix at RATE a second")
    ap.add_argument("--day", action="store_true", help="with --synthetic: the rate follows a day (peak 15:00)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo", required=True, help="ttft=SECONDS,tpot=SECONDS (or 50ms)")
    ap.add_argument("--nodes", required=True, help="NAME=COUNT[@PRICE an hour],...")
    ap.add_argument("--profile", action="append", default=[], help="a `tandem profile` JSON (repeatable)")
    ap.add_argument("--model", default=None, help="for hardware nodes: a checkpoint or a shape in models.json")
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "int8", "fp8"], help="hardware nodes")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "bf16", "fp16", "int8", "fp8"],
                    help="hardware nodes' KV cache (auto: as the engine on a GPU, the activations' dtype)")  # fmt: skip
    ap.add_argument("--transfer-fixed-ms", type=float, default=5.0, help="a P/D hand-off's fixed cost")
    ap.add_argument("--splits", type=int, default=16, help="P:D splits tried per node kind, at most (0: none)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    try:
        slo, nodes, trace = parse_slo(args.slo), parse_nodes(args.nodes), load_trace(args)
        profiles = [EngineProfile.load(p) for p in args.profile]
        model = args.model or str(default_model_path())
        config = model_config(model)
        kv_dtype = gpu_kv_dtype(args.dtype, args.kv_dtype)
        kinds = resolve(nodes, profiles, config, model, args.dtype, kv_dtype)
    except (ValueError, OSError, KeyError) as e:
        print(f"tandem plan: {e}", file=sys.stderr)
        return 2
    kv_dtype = profiles[0].kv_dtype if profiles and not args.model else kv_dtype
    dtype = profiles[0].dtype if profiles and not args.model else args.dtype
    handoff = Handoff(args.transfer_fixed_ms / 1e3, ModelShape.of(config, dtype, kv_dtype).kv_bytes_per_token)
    report: dict[str, object] = {"requests": len(trace), "rate": trace.rate, "slo": asdict(slo)}
    by_kind = {k.name: splits(k, k.available or 1, trace, slo, handoff, args.splits) for k in kinds if args.splits}
    report["splits"] = {name: [asdict(o) for o in opts] for name, opts in by_kind.items()}
    priced = [k for k in kinds if k.price > 0]
    cheap = cheapest(priced, trace, slo, handoff) if priced else []
    report["cheapest"] = [asdict(o) for o in cheap]
    if args.json:
        print_json(report)
        return 0
    print(f"trace: {len(trace)} requests, {trace.rate:.2f}/s; SLO TTFT {slo.ttft_s:g} s, TPOT {slo.tpot_s * 1e3:g} ms; "
          f">= 90% must meet it")  # fmt: skip
    limit = max_rate(trace, slo)
    for name, opts in by_kind.items():
        print(f"\n{name}: goodput of each split (req/s), best first; >=: the trace is too short to find the limit")
        for o in opts:
            per_dollar = f"{o.goodput * 3600 / o.price:12.0f} req/$" if o.price else ""
            bound = ">=" if o.goodput >= 0.999 * limit else "  "
            print(f"  {o.label:<14}{bound}{o.goodput:10.2f}{per_dollar}")
        print(f"  best: {opts[0].label}")
    if cheap:
        print(f"\ncheapest at the trace's rate ({trace.rate:.2f} req/s):")
        for o in cheap[:5]:
            print(f"  {o.label:<48}${o.price:10.2f}/h  {_per_dollar(o):10.0f} req/$")
    elif priced:
        print("\nno mix of the priced nodes meets the SLOs at the trace's rate")
    return 0


def _per_dollar(o: Option) -> float:
    return o.goodput * 3600 / o.price if o.price else 0.0


if __name__ == "__main__":
    raise SystemExit(main())
