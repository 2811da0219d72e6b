"""What every scenario of `tandem bench chaos` stands on: a live cluster behind the real router
(`Chaos`), the result a scenario reports (`ScenarioResult`), and how it is measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from bench.chaos_client import ChatClient, Stream, run_streams
from bench.harness import wait_pools
from bench.loadgen import first_model
from bench.stats import percentile
from cluster.cluster import Cluster


@dataclass(frozen=True)
class ScenarioResult:
    """completed / errored / hung: the fault run's streams. added_p99_s: p99 end-to-end latency of
    the streams the fault touched, minus the undisturbed p99. recovery_s: from the fault until the
    cluster is whole again. held_blocks: KV blocks still held on every worker once idle."""

    name: str
    requests: int
    completed: int
    errored: int
    hung: int
    added_p99_s: float
    recovery_s: float
    held_blocks: int
    facts: dict[str, Any] = field(default_factory=dict)


def until(cond: Callable[[], bool], timeout_s: float, what: str, every: float = 0.05) -> float:
    """Seconds until `cond()` held. Raises TimeoutError."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(every)
    raise TimeoutError(f"no {what} after {timeout_s:.0f} s")


class Chaos:
    """A live cluster, the router over it, and the tools of the scenarios."""

    def __init__(self, cluster: Cluster, url: str, max_tokens: int) -> None:
        self.cluster = cluster
        self.url = url
        self.client = ChatClient(url, asyncio.run(first_model(url)), max_tokens)

    def pools(self, **sizes: int) -> None:
        wait_pools(self.cluster, **sizes)

    def workers(self, role: str) -> list[str]:
        return sorted(w for w, info in self.cluster.view.refresh().live().items() if info.get("role") == role)

    def stats(self) -> dict[str, dict[str, Any]]:
        handles = self.cluster.handles()
        got = ray.get([h.stats.remote() for h in handles.values()], timeout=30)
        return dict(zip(handles, got, strict=True))

    def signal(self, worker_id: str, sig: signal.Signals) -> int:
        pid = int(self.stats()[worker_id]["pid"])
        os.kill(pid, sig)
        return pid

    def held_blocks(self) -> int:
        return sum(int(s["num_blocks"]) - int(s["free_blocks"]) for s in self.stats().values())

    def held_after_idle(self, timeout_s: float = 10.0) -> int:
        """Blocks held once nothing runs (waiting up to `timeout_s` for them to come back);
        every worker's check_integrity() passes too, and the router's ledger is empty."""
        with contextlib.suppress(TimeoutError):
            until(lambda: self.held_blocks() == 0 and len(self.cluster.ledger) == 0, timeout_s, "idle", 0.25)
        self.cluster.check_integrity()
        return self.held_blocks()

    def whole_again(self, t_fault: float, timeout_s: float = 180.0, **sizes: int) -> float:
        """Seconds from `t_fault` until the pools are back at `sizes` and a new request is served."""
        wait_pools(self.cluster, timeout_s, **sizes)
        probe = self.client.stream("Say hello.")
        if not probe.completed:
            raise RuntimeError(f"the cluster serves no request after recovering: {probe.error}")
        return time.monotonic() - t_fault

    def prompts(self, n: int, tag: str, words: int = 0) -> list[str]:
        filler = " ".join(f"Fact {j}: the sea is wide and deep." for j in range(words // 8))
        return [f"[{tag}-{i}] {filler} Write a short story about lighthouse number {i}." for i in range(n)]

    def streamed_with(self, prompts: list[str], fault: Callable[[list[Stream]], None]) -> list[Stream]:
        return run_streams(self.client, prompts, fault)


def outcome(name: str, base: list[Stream], run: list[Stream], affected: list[Stream], **kw: Any) -> ScenarioResult:
    p99 = percentile([s.e2e for s in base if s.completed], 99) if base else 0.0
    hit = [s.e2e for s in affected if s.completed]
    return ScenarioResult(
        name=name,
        requests=len(run),
        completed=sum(s.completed for s in run),
        errored=sum(bool(s.error) for s in run),
        hung=sum(s.hung for s in run),
        added_p99_s=max(0.0, percentile(hit, 99) - p99) if hit else 0.0,
        **kw,
    )


def same_answers(base: list[Stream], run: list[Stream], max_tokens: int) -> dict[str, Any]:
    return {
        "same_text": sum(a.text == b.text for a, b in zip(base, run, strict=True)),
        "usage_exact": sum(
            b.completion_tokens == max_tokens and b.prompt_tokens == a.prompt_tokens > 0
            for a, b in zip(base, run, strict=True)
        ),
        "migrated": sum(int(s.timing.get("migrations", 0)) > 0 for s in run),
    }
