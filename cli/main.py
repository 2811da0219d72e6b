"""The `tandem` command."""

from __future__ import annotations

import argparse
import sys


def _serve(argv: list[str]) -> int:
    from cli.demo import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in ("engine", "transfer", "serve", "compare", "prefix"):
        print("usage: tandem bench {engine,transfer,serve,compare,prefix} [--json] [...]", file=sys.stderr)
        return 2
    if argv[0] == "transfer":
        from bench.transfer_bench import main
    elif argv[0] == "serve":
        from bench.serve_bench import main
    elif argv[0] == "compare":
        from bench.compare import main
    elif argv[0] == "prefix":
        from bench.prefix_bench import main
    else:
        from bench.engine_bench import main

    return main(argv[1:])


def _router(argv: list[str]) -> int:
    from router.server import main

    return main(argv)


def _admin(argv: list[str]) -> int:
    from cli.admin import main

    return main(argv)


COMMANDS = {
    "serve": (_serve, "serve the bundled model (for now: an offline generation demo)"),
    "bench": (_bench, "benchmarks: engine, transfer, serve, compare, prefix"),
    "router": (_router, "start a local cluster and the OpenAI-compatible router"),
    "admin": (_admin, "the router's admin API: pools, scale ROLE N, drain ID, rebalance P D"),
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
    return fn(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
