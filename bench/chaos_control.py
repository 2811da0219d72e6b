"""The control plane dies, the data plane serves on: `tandem bench chaos` scenarios that kill
the embedded Redis or the pool manager under load (real SIGKILLs), or start and stop a second
router over the same pools. Streams talk to the workers directly, so none of them may lose a
token, and new requests are served from the router's last view of the pools until the killed
part is back.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from typing import Any

from bench.chaos_client import ChatClient, Stream, run_streams
from bench.chaos_harness import Chaos, ScenarioResult, outcome, same_answers, until
from bench.harness import serving
from cluster.cluster import Cluster


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
        **same_answers(base, run, c.client.max_tokens),
        "new_request_ok": new.completed,
        "new_first_token_s": (new.token_times[0] - t_fault) if new.token_times else -1.0,
        "redis_restarted": redis.pid not in (None, killed),
    }
    return outcome("Redis SIGKILL", base, run, run, recovery_s=recovery, held_blocks=c.held_after_idle(),
                   facts=facts)  # fmt: skip


def manager_kill(c: Chaos, n: int = 16) -> ScenarioResult:
    """n streams over 1P+2D; SIGKILL the pool manager once half are under way. Ray restarts it and
    it adopts the running workers: the same processes serve on, and a request sent while it is
    down is served from the router's last view."""
    c.pools(prefill=1, decode=2)
    prompts = c.prompts(n, "manager-kill")
    base = run_streams(c.client, prompts)
    before = {wid: s["pid"] for wid, s in c.stats().items()}
    old = c.cluster.manager_status()
    if old is None:
        raise RuntimeError("manager_kill: the pool manager does not answer")
    probe: list[Stream] = []
    t_fault = 0.0

    def fault(streams: list[Stream]) -> None:
        nonlocal t_fault
        until(lambda: sum(len(s.token_times) >= 2 for s in streams) >= n // 2, 120, "streams under way")
        os.kill(old.pid, signal.SIGKILL)
        t_fault = time.monotonic()
        probe.append(c.client.stream("A new request while the pool manager is down: say hello."))

    run = c.streamed_with(prompts, fault)
    until(
        lambda: (m := c.cluster.manager_status()) is not None and m.pid != old.pid and m.rounds > 0,
        60,
        "a new pool manager",
        0.1,
    )
    back_s = time.monotonic() - t_fault
    recovery = c.whole_again(t_fault, prefill=1, decode=2)
    new = c.cluster.manager_status()
    facts = {
        **same_answers(base, run, c.client.max_tokens),
        "new_request_ok": probe[0].completed,
        "manager_back_s": back_s,
        "adopted": len(new.adopted) if new else 0,
        "same_workers": {wid: s["pid"] for wid, s in c.stats().items()} == before,
    }
    return outcome("pool manager SIGKILL", base, run, run, recovery_s=recovery, held_blocks=c.held_after_idle(),
                   facts=facts)  # fmt: skip


def second_router(c: Chaos, n: int = 8) -> ScenarioResult:
    """n streams over 1P+1D; once half are under way, a second router joins the same pools (as a
    router restarted on a shared cluster does), asked for 2P+2D with half the KV blocks, serves a
    request, and stops. It must take the pools as they are (no worker started, the sizes in Redis
    and the engine config unchanged), answer as the first router does, and leave the pools running
    when it stops: the streams lose nothing."""
    c.pools(prefill=1, decode=1)
    prompts = c.prompts(n, "second-router")
    base = run_streams(c.client, prompts)
    before = {wid: s["pid"] for wid, s in c.stats().items()}
    desired = c.cluster.state.desired()
    probe = "A request through the second router: say hello."
    facts: dict[str, Any] = {}
    t_fault = 0.0

    def fault(streams: list[Stream]) -> None:
        nonlocal t_fault
        until(lambda: sum(len(s.token_times) >= 2 for s in streams) >= n // 2, 120, "streams under way")
        t_fault = time.monotonic()
        mine = c.cluster.config
        assert mine.engine.num_blocks is not None  # chaos names it (bench/chaos.py)
        engine = dataclasses.replace(mine.engine, num_blocks=mine.engine.num_blocks // 2)
        config = dataclasses.replace(mine, prefill=2, decode=2, engine=engine, keep_pools=True)
        other = Cluster.connect(config, redis_url=c.cluster.state_url)
        try:
            facts["join_s"] = time.monotonic() - t_fault
            facts["joined_pools"] = other.joined_pools
            facts["same_engine"] = other.config.engine == mine.engine
            with serving(other) as url:
                facts["probe"] = ChatClient(url, c.client.model, c.client.max_tokens).stream(probe)
            other.check_integrity()
        finally:
            t_stop = time.monotonic()
            stopped = other.shutdown()
            facts["stop_s"] = time.monotonic() - t_stop
            facts["stop_clean"] = not stopped.left_behind and not stopped.skipped

    run = c.streamed_with(prompts, fault)
    recovery = time.monotonic() - t_fault
    via_second: Stream = facts.pop("probe")
    facts |= {
        **same_answers(base, run, c.client.max_tokens),
        "probe_ok": via_second.completed,
        "probe_same_text": via_second.text == c.client.stream(probe).text,
        "same_workers": {wid: s["pid"] for wid, s in c.stats().items()} == before,
        "same_sizes": c.cluster.state.desired() == desired,
    }
    return outcome("second router joins, leaves", base, run, run, recovery_s=recovery, held_blocks=c.held_after_idle(),
                   facts=facts)  # fmt: skip
