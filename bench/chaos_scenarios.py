"""The fault scenarios of `tandem bench chaos`, on a live cluster behind the real router, with
real process kills. The integration test runs these same functions and asserts on their results.

Each scenario measures its load undisturbed first (the reference texts, and the latency the
fault's cost is measured against), then again with the fault, and reports a ScenarioResult.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import ray

from bench.chaos_client import ChatClient, Stream, run_streams
from bench.harness import serving, wait_pools
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


def _same_answers(base: list[Stream], run: list[Stream], max_tokens: int) -> dict[str, Any]:
    return {
        "same_text": sum(a.text == b.text for a, b in zip(base, run, strict=True)),
        "usage_exact": sum(
            b.completion_tokens == max_tokens and b.prompt_tokens == a.prompt_tokens > 0
            for a, b in zip(base, run, strict=True)
        ),
        "migrated": sum(int(s.timing.get("migrations", 0)) > 0 for s in run),
    }


def decode_kill(c: Chaos, n: int = 32) -> ScenarioResult:
    """2 decode workers, n streams; SIGKILL the busier one once half the streams are going."""
    c.pools(prefill=1, decode=2)
    prompts = c.prompts(n, "decode-kill")
    base = run_streams(c.client, prompts)
    split = Counter(s.decode_worker for s in base)
    t_fault = 0.0

    def fault(streams: list[Stream]) -> None:
        nonlocal t_fault
        until(lambda: sum(len(s.token_times) >= 4 for s in streams) >= n // 2, 120, "streams under way")
        victim = max(c.workers("decode"), key=lambda d: c.cluster.ledger.load(d).streams)
        c.signal(victim, signal.SIGKILL)
        t_fault = time.monotonic()

    run = c.streamed_with(prompts, fault)
    facts = {**_same_answers(base, run, c.client.max_tokens), "burst_split": sorted(split.values())}
    affected = [s for s in run if int(s.timing.get("migrations", 0)) > 0]
    recovery = c.whole_again(t_fault, prefill=1, decode=2)
    return outcome("decode SIGKILL", base, run, affected, recovery_s=recovery, held_blocks=c.held_after_idle(),
                   facts=facts)  # fmt: skip


def prefill_kill(c: Chaos, n: int = 8) -> ScenarioResult:
    """2 prefill workers, n long prompts; SIGKILL one while it is prefilling and streaming KV."""
    c.pools(prefill=2, decode=1)
    prompts = c.prompts(n, "prefill-kill", words=300)
    base = run_streams(c.client, prompts)
    t_fault = 0.0

    def fault(streams: list[Stream]) -> None:
        nonlocal t_fault
        busy: list[str] = []

        def prefilling() -> bool:
            busy[:] = [p for p in c.workers("prefill") if c.cluster.ledger.load(p).prefill_tokens > 0]
            return len(busy) > 0

        until(prefilling, 60, "a prefill in flight")
        time.sleep(0.2)  # into the prompt, with layers on the wire
        c.signal(busy[0], signal.SIGKILL)
        t_fault = time.monotonic()

    run = c.streamed_with(prompts, fault)
    facts = _same_answers(base, run, c.client.max_tokens)
    affected = [s for s in run if int(s.timing.get("attempts", 1)) > 1 or int(s.timing.get("migrations", 0))]
    facts["attempts"] = sorted(int(s.timing.get("attempts", 0)) for s in run)
    recovery = c.whole_again(t_fault, prefill=2, decode=1)
    return outcome("prefill SIGKILL", base, run, affected, recovery_s=recovery, held_blocks=c.held_after_idle(),
                   facts={**facts, "retried": len(affected)})  # fmt: skip


def decode_stop(c: Chaos, n: int = 16, stop_s: float = 15.0) -> ScenarioResult:
    """2 decode workers, n streams; SIGSTOP the busier one for `stop_s`, then SIGCONT."""
    c.pools(prefill=1, decode=2)
    prompts = c.prompts(n, "decode-stop")
    base = run_streams(c.client, prompts)
    victim = ""
    t_fault = 0.0

    def fault(streams: list[Stream]) -> None:
        nonlocal victim, t_fault
        until(lambda: sum(len(s.token_times) >= 4 for s in streams) >= n // 2, 120, "streams under way")
        victim = max(c.workers("decode"), key=lambda d: c.cluster.ledger.load(d).streams)
        pid = c.signal(victim, signal.SIGSTOP)
        t_fault = time.monotonic()
        time.sleep(stop_s)
        with contextlib.suppress(ProcessLookupError):  # the pool manager may have killed it: also fine
            os.kill(pid, signal.SIGCONT)

    run = c.streamed_with(prompts, fault)
    others = [s.tpot for s in run if s.decode_worker != victim and not s.timing.get("migrations") and s.tpot]
    undisturbed = [s.tpot for s in base if s.tpot]
    affected = [s for s in run if int(s.timing.get("migrations", 0)) > 0]
    facts = {
        **_same_answers(base, run, c.client.max_tokens),
        "others_tpot_ratio": percentile(others, 50) / percentile(undisturbed, 50) if others and undisturbed else 0.0,
        "affected_max_s": max((s.e2e for s in affected), default=0.0),
    }
    recovery = c.whole_again(t_fault, prefill=1, decode=2)
    return outcome("decode SIGSTOP", base, run, affected, recovery_s=recovery, held_blocks=c.held_after_idle(),
                   facts=facts)  # fmt: skip


def redis_kill(c: Chaos, n: int = 16) -> ScenarioResult:
    """n streams; SIGKILL the embedded redis-server; a new request right after must be served."""
    redis = c.cluster.embedded_redis
    if redis is None or redis.pid is None:
        raise RuntimeError("redis_kill needs the cluster's embedded Redis")
    c.pools(prefill=1, decode=1)
    prompts = c.prompts(n, "redis-kill")
    base = run_streams(c.client, prompts)
    probe: list[Stream] = []
    killed = 0
    t_fault = 0.0

    def fault(streams: list[Stream]) -> None:
        nonlocal t_fault, killed
        until(lambda: sum(len(s.token_times) >= 2 for s in streams) >= n // 2, 120, "streams under way")
        killed = redis.pid or 0
        os.kill(killed, signal.SIGKILL)
        t_fault = time.monotonic()
        probe.append(c.client.stream("A new request while Redis is down: say hello."))

    run = c.streamed_with(prompts, fault)
    new = probe[0]
    up = set(c.workers("prefill") + c.workers("decode"))
    until(lambda: c.cluster.state.ping() and set(c.cluster.state.workers()) >= up, 60, "the registry rebuilt", 0.25)
    recovery = time.monotonic() - t_fault
    facts = {
        **_same_answers(base, run, c.client.max_tokens),
        "new_request_ok": new.completed,
        "new_first_token_s": (new.token_times[0] - t_fault) if new.token_times else -1.0,
        "redis_restarted": redis.pid not in (None, killed),
    }
    return outcome("Redis SIGKILL", base, run, run, recovery_s=recovery, held_blocks=c.held_after_idle(),
                   facts=facts)  # fmt: skip


def disconnects(c: Chaos) -> ScenarioResult:
    """A client hangs up while queued in the router, then one during its prefill: the slot and
    every block come back within a second."""
    c.pools(prefill=1, decode=1)
    with serving(c.cluster, max_running=1) as url:
        one = ChatClient(url, c.client.model, 64)
        first = Stream("holder")
        holder = threading.Thread(target=one.stream, args=("Tell me a long story.", first), daemon=True)
        holder.start()
        until(lambda: len(first.token_times) > 0, 60, "the first stream's tokens")
        hang_up = one.hang_up_later("Queued: say hi.")
        until(lambda: _waiting(url) == 1, 10, "a queued request")
        hang_up()
        queued_freed_s = until(lambda: _waiting(url) == 0, 10, "the queue slot back")
        holder.join(120)
    prefilling = c.workers("prefill")

    def queued_prefill() -> int:  # the router's own count: asking a worker would wait for its step
        return sum(c.cluster.ledger.load(p).prefill_tokens for p in prefilling)

    hang_up = c.client.hang_up_later(c.prompts(1, "disconnect", words=1600)[0])
    until(lambda: len(c.cluster.ledger) == 1 and queued_prefill() > 0, 30, "the prefill under way")
    time.sleep(0.5)  # into the prompt's compute, with its first layers on the wire
    in_prefill = queued_prefill() > 0
    hang_up()
    t_fault = time.monotonic()
    freed_s = until(lambda: c.held_blocks() == 0 and len(c.cluster.ledger) == 0, 30, "blocks back", 0.02)
    facts = {"queued_slot_freed_s": queued_freed_s, "prefill_blocks_freed_s": freed_s, "hung_up_in_prefill": in_prefill}
    return ScenarioResult("client disconnects", 2, 0, 0, 0, 0.0, time.monotonic() - t_fault, c.held_after_idle(),
                          facts)  # fmt: skip


def _waiting(url: str) -> int:
    text = httpx.get(f"{url}/metrics", timeout=5).text
    for line in text.splitlines():
        if line.startswith("tandem:num_requests_waiting"):
            return int(float(line.split()[-1]))
    return 0


SCENARIOS: dict[str, Callable[[Chaos], ScenarioResult]] = {
    "decode-kill": decode_kill,
    "prefill-kill": prefill_kill,
    "decode-stop": decode_stop,
    "redis-kill": redis_kill,
    "disconnect": disconnects,
}
