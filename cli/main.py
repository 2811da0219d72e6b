"""The `tandem` command."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable


def _serve(argv: list[str]) -> int:
    from router.server import main

    return main(argv)


BENCHES = {
    "engine": "bench.engine_bench",
    "transfer": "bench.transfer_bench",
    "serve": "bench.serve_bench",
    "compare": "bench.compare",
    "prefix": "bench.prefix_bench",
    "router": "bench.router_overhead",
    "chaos": "bench.chaos",
    "efficiency": "bench.efficiency",
    "spec": "bench.spec_bench",
    "planner": "bench.planner_bench",
    "hol": "bench.hol_bench",
}


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHES:
        print(f"usage: tandem bench {{{','.join(BENCHES)}}} [--json] [...]", file=sys.stderr)
        return 2
    main: Callable[[list[str]], int] = importlib.import_module(BENCHES[argv[0]]).main
    return main(argv[1:])


def _admin(argv: list[str]) -> int:
    from cli.admin import main

    return main(argv)


def _profile(argv: list[str]) -> int:
    from planner.measure import main

    return main(argv)


def _plan(argv: list[str]) -> int:
    from planner.plan_cli import main

    return main(argv)


def _status(argv: list[str]) -> int:
    from cli.status import main

    return main(argv)


COMMANDS = {
    "serve": (_serve, "start (or join) the cluster and serve the OpenAI-compatible API"),
    "bench": (_bench, "benchmarks: " + ", ".join(BENCHES)),
    "admin": (_admin, "the router's admin API: pools, scale ROLE N, drain ID, flip ID ROLE, rebalance P D"),
    "profile": (_profile, "measure this machine's engine profile for the planner (--compare: vs the roofline)"),
    "plan": (_plan, "goodput of every P:D split and colocated for a trace, and the cheapest node mix (simulated)"),
    "status": (_status, "a live terminal view of the pools and the load (--once: one frame)"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS:
        ap = argparse.ArgumentParser(prog="tandem", description="Disaggregated prefill/decode LLM serving.")
        ap.add_argument(
            "command", choices=sorted(COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in COMMANDS.items())
        )
        ap.parse_args(argv)
        return 2
    fn, _ = COMMANDS[argv[0]]
    if "--json" not in argv:
        return fn(argv[1:])
    from bench.json_out import json_only

    with json_only():  # stdout: the command's one JSON object, whatever else prints meanwhile
        return fn(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
