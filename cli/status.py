"""`tandem status`: a live terminal view of the pools and the load, for an operator on the head
node over ssh. It polls the router: `/admin/pools` (token from TANDEM_ADMIN_TOKEN) for the
workers, `/metrics` for latency and throughput, and shows the rates and quantiles of the last
interval (since start on the first frame). `--once` prints one frame and exits."""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

HISTOGRAMS = {"ttft": "tandem:time_to_first_token_seconds", "tpot": "tandem:inter_token_latency_seconds"}
COUNTERS = {"generated": "tandem:generation_tokens_total", "prompt": "tandem:prompt_tokens_total"}
GAUGES = {"running": "tandem:num_requests_running", "waiting": "tandem:num_requests_waiting"}


@dataclass(frozen=True)
class Scrape:
    """What one read of /metrics says: cumulative buckets per histogram, counters, gauges."""

    at: float
    buckets: dict[str, list[tuple[float, float]]]  # (le, cumulative count), ascending le
    counters: dict[str, float]
    gauges: dict[str, float]


def parse_metrics(text: str, at: float) -> Scrape:
    buckets: dict[str, list[tuple[float, float]]] = {k: [] for k in HISTOGRAMS}
    counters, gauges = dict.fromkeys(COUNTERS, 0.0), dict.fromkeys(GAUGES, 0.0)
    by_bucket = {v + "_bucket": k for k, v in HISTOGRAMS.items()}
    by_counter = {v: k for k, v in COUNTERS.items()}
    by_gauge = {v: k for k, v in GAUGES.items()}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name in by_bucket:
                buckets[by_bucket[s.name]].append((float(s.labels["le"]), float(s.value)))
            elif s.name in by_counter:
                counters[by_counter[s.name]] = float(s.value)
            elif s.name in by_gauge:
                gauges[by_gauge[s.name]] = float(s.value)
    return Scrape(at, {k: sorted(v) for k, v in buckets.items()}, counters, gauges)


def quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """Prometheus's histogram_quantile over cumulative (le, count) buckets: linear within the
    bucket the rank falls in; None with no observations; the last finite bound past it."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower_le, lower_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if le == float("inf"):
                return lower_le
            if count == lower_count:
                return le
            return lower_le + (le - lower_le) * (rank - lower_count) / (count - lower_count)
        lower_le, lower_count = le, count
    return lower_le


def window(now: Scrape, before: Scrape | None) -> Scrape:
    """The observations between two scrapes (all of `now`'s on the first)."""
    if before is None:
        return now
    buckets = {k: [(le, c - dict(before.buckets[k]).get(le, 0.0)) for le, c in now.buckets[k]] for k in now.buckets}
    counters = {k: now.counters[k] - before.counters[k] for k in now.counters}
    return Scrape(now.at - before.at, buckets, counters, now.gauges)


@dataclass(frozen=True)
class Frame:
    url: str
    pools: dict[str, Any] | None  # /admin/pools, or None where refused
    pools_error: str
    recent: Scrape  # at: the window's length in seconds (or the scrape time on the first frame)
    first: bool
    notes: list[str] = field(default_factory=list)


def render(frame: Frame) -> Group:
    load = Table(title=f"tandem status: {frame.url}", title_justify="left", expand=False)
    for col in ("", "p50", "p90", "p99"):
        load.add_column(col, justify="right")
    for name, label in (("ttft", "TTFT (s)"), ("tpot", "TPOT (s)")):
        qs = [quantile(frame.recent.buckets[name], q) for q in (0.5, 0.9, 0.99)]
        load.add_row(label, *("-" if v is None else f"{v:.3f}" for v in qs))
    span = "since start" if frame.first else f"last {frame.recent.at:.0f} s"

    def rate(n: float) -> str:
        return "-" if frame.first else f"{n / max(frame.recent.at, 1e-9):.1f}"

    g = frame.recent.gauges
    summary = Text(
        f"{span}: {rate(frame.recent.counters['generated'])} generated tok/s, "
        f"{rate(frame.recent.counters['prompt'])} prompt tok/s; "
        f"{g['running']:.0f} running, {g['waiting']:.0f} waiting in the router"
    )
    parts: list[Any] = [load, summary]
    if frame.pools is None:
        parts.append(Text(f"workers: {frame.pools_error}", style="yellow"))
    else:
        up, desired = frame.pools.get("up", {}), frame.pools.get("desired", {})
        sizes = ", ".join(f"{role} {n}/{desired.get(role, n)}" for role, n in up.items())
        workers = Table(title=f"pools (up/desired): {sizes}", title_justify="left")
        for col in ("worker", "role", "node", "state", "running", "waiting", "KV used"):
            workers.add_column(col, justify="right" if col in ("running", "waiting", "KV used") else "left")
        for w in sorted(frame.pools.get("workers", []), key=lambda w: (str(w.get("role")), str(w.get("worker_id")))):
            state = "draining" if w.get("draining") else str(w.get("state", "?"))
            kv = w.get("kv_usage")
            workers.add_row(str(w.get("worker_id")), str(w.get("role")), str(w.get("node", "")), state,
                            str(w.get("running", "")), str(w.get("waiting", "")),
                            "-" if kv is None else f"{float(kv):.0%}")  # fmt: skip
        parts.append(workers)
    parts += [Text(n, style="red") for n in frame.notes]
    return Group(*parts)


class Poller:
    """Reads the router once a frame through `http` (an httpx.Client with its timeout: a declared
    boundary, so tests pass the app's TestClient)."""

    def __init__(self, http: httpx.Client, url: str, token: str) -> None:
        self.http, self.url = http, url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.last: Scrape | None = None

    def frame(self) -> Frame:
        notes: list[str] = []
        pools, pools_error = None, ""
        try:
            r = self.http.get(self.url + "/admin/pools", headers=self.headers)
            if r.status_code == 200:
                pools = r.json()
            else:
                pools_error = f"/admin/pools answered {r.status_code} (set TANDEM_ADMIN_TOKEN)"
        except httpx.HTTPError as e:
            pools_error = f"/admin/pools: {e}"
        now = Scrape(time.monotonic(), {k: [] for k in HISTOGRAMS}, dict.fromkeys(COUNTERS, 0.0),
                     dict.fromkeys(GAUGES, 0.0))  # fmt: skip
        try:
            now = parse_metrics(self.http.get(self.url + "/metrics").text, time.monotonic())
        except (httpx.HTTPError, ValueError) as e:
            notes.append(f"/metrics: {e}")
        first = self.last is None
        recent, self.last = window(now, self.last), now
        return Frame(self.url, pools, pools_error, recent, first, notes)


def main(argv: list[str] | None = None, http: httpx.Client | None = None, console: Console | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem status", description=__doc__)
    ap.add_argument("--url", default=os.environ.get("TANDEM_ROUTER_URL", "http://127.0.0.1:8000"))
    ap.add_argument("--interval", type=float, default=2.0, help="seconds between frames")
    ap.add_argument("--once", action="store_true", help="print one frame and exit")
    args = ap.parse_args(argv)
    if args.interval <= 0:
        ap.error("--interval must be positive")
    console = console or Console()
    poller = Poller(http or httpx.Client(timeout=10), args.url, os.environ.get("TANDEM_ADMIN_TOKEN", ""))
    first = poller.frame()
    if first.pools is None and first.notes:
        print(f"tandem status: cannot read {args.url}: {first.notes[0]}", file=sys.stderr)
        return 1
    if args.once:
        console.print(render(first))
        return 0
    try:
        with Live(render(first), console=console, refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(poller.frame()))
    except KeyboardInterrupt:
        return 0
