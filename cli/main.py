"""The `tandem` command."""

from __future__ import annotations

import argparse
import sys


def _serve(argv: list[str]) -> int:
    from cli.demo import main

    return main(argv)


def _bench(argv: list[str]) -> int:
    if not argv or argv[0] not in ("engine", "transfer"):
        print("usage: tandem bench {engine,transfer} [--json] [...]", file=sys.stderr)
        return 2
    if argv[0] == "transfer":
        from bench.transfer_bench import main
    else:
        from bench.engine_bench import main

    return main(argv[1:])


COMMANDS = {
    "serve": (_serve, "serve the bundled model (for now: an offline generation demo)"),
    "bench": (_bench, "benchmarks: engine, transfer"),
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
