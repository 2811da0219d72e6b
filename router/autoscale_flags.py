"""`tandem serve`'s autoscaler flags and their checked config; light to import (the serve
command parses them before anything heavy loads), the autoscaler itself is router.autoscaler."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from engine.roles import ROLES
from planner.autoscale import Bounds
from planner.slo import SLO, parse_slo


@dataclass(frozen=True)
class AutoscaleConfig:
    slo: SLO
    bounds: Bounds
    interval_s: float = 30.0
    headroom: float = 1.2  # plan for this many times the window's arrival rate


def parse_bounds(text: str) -> tuple[dict[str, int], dict[str, int], int | None]:
    """'prefill=1..4,decode=1..8,pd=6' -> ({min per role}, {max per role}, prefill + decode at
    most, None without `pd=`). Raises ValueError."""
    lo: dict[str, int] = {}
    hi: dict[str, int] = {}
    pd: int | None = None
    for item in filter(None, (s.strip() for s in text.split(","))):
        role, _, span = item.partition("=")
        if role == "pd" and span.isdigit() and int(span) >= 2:
            pd = int(span)
            continue
        a, sep, b = span.partition("..")
        if role not in ROLES or not sep or not a.isdigit() or not b.isdigit() or int(a) > int(b):
            raise ValueError(
                f"autoscale bounds want ROLE=MIN..MAX (ROLE in {', '.join(ROLES)}) or pd=N (N >= 2), got {item!r}"
            )
        lo[role], hi[role] = int(a), int(b)
    if not hi:
        raise ValueError("autoscale bounds are empty")
    return lo, hi, pd


def add_arguments(ap: argparse.ArgumentParser) -> None:
    env = os.environ.get
    ap.add_argument(
        "--autoscale",
        default=env("TANDEM_AUTOSCALE", ""),
        metavar="BOUNDS",
        help="size the pools from the load, within ROLE=MIN..MAX,... (e.g. prefill=1..4,decode=1..4); pd=N: "
        "prefill + decode at most N (fixed hardware: a pool grows by a worker of the other flipping)",
    )
    ap.add_argument("--slo", default=env("TANDEM_SLO", "ttft=2,tpot=0.2"), help="the autoscaler's SLO (seconds)")
    ap.add_argument("--autoscale-interval", type=float, default=30.0, help="seconds between decisions")
    ap.add_argument("--autoscale-cooldown", type=float, default=60.0, help="seconds after a change with no other")
    ap.add_argument("--autoscale-step", type=int, default=1, help="workers a pool gains or loses a decision, at most")
    ap.add_argument("--autoscale-profile", default=env("TANDEM_AUTOSCALE_PROFILE", ""),
                    help="`tandem profile` JSON(s) to plan with, comma-separated: on one host, at each worker's "
                    "threads, and at all its cores and --beside-busy-peer where given (without one, attainment "
                    "alone decides)")  # fmt: skip


def profile_paths(text: str) -> list[str]:
    """`--autoscale-profile`'s files, in order."""
    return [p.strip() for p in text.split(",") if p.strip()]


def config_from_args(args: argparse.Namespace) -> AutoscaleConfig | None:
    """The autoscaler's config, None when off. Raises ValueError on a bad flag (before any start)."""
    if not args.autoscale:
        return None
    lo, hi, pd = parse_bounds(args.autoscale)
    bounds = Bounds(min=lo, max=hi, max_step=args.autoscale_step, cooldown_s=args.autoscale_cooldown, max_pd=pd)
    if args.autoscale_interval <= 0:
        raise ValueError("--autoscale-interval must be > 0")
    for path in profile_paths(args.autoscale_profile):
        if not os.path.exists(path):
            raise ValueError(f"--autoscale-profile: no file {path!r}")
    return AutoscaleConfig(parse_slo(args.slo), bounds, args.autoscale_interval)
