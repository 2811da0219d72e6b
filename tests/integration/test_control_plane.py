"""The control plane never kills healthy work: real Ray, a real redis-server, the real model.

One cluster for the module (1 prefill + 1 decode worker). Pings are timed from a side thread
while the decode worker runs its maximum number of streams, and while the embedded Redis is
SIGKILLed or stopped; the same worker processes (pids) must serve from start to end.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import ray

from cluster.cluster import Cluster, ClusterConfig
from cluster.manager_link import ManagerStatus
from cluster.redis_server import EmbeddedRedis
from cluster.request_run import RequestRun
from cluster.state import StateUnavailable
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from tests.integration.waits import until

STREAMS = 64
FULL_LOAD = STREAMS * 7 // 8  # streams running at once that count as the worker's full load
# ~0.3-0.4 s per decode step of 64 sequences on one CPU thread: ~60 tokens run 18-24 s, with
# ~170 pings to each worker at full load (measured 352 of 424 pings in all)
LONG = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
PING_BUDGET_S = 1.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    engine = EngineConfig(dtype="fp32", num_blocks=800, max_num_seqs=STREAMS, num_threads=1)
    c = Cluster.connect(ClusterConfig(namespace="ctrlplane", engine=engine))
    try:
        c.wait_ready(240)
        yield c
    finally:
        c.shutdown()


def pids(c: Cluster) -> dict[str, int]:
    return {wid: int(ray.get(h.stats.remote(), timeout=30)["pid"]) for wid, h in c.handles().items()}


def check_all(c: Cluster) -> None:
    ray.get([h.check_integrity.remote() for h in c.handles().values()], timeout=60)


def status(c: Cluster) -> ManagerStatus:
    result = c.manager_status(10)
    assert result is not None, "the pool manager does not answer"
    return result


def registered(c: Cluster) -> set[str]:
    try:
        return set(c.state.workers())
    except StateUnavailable:
        return set()


def desired(c: Cluster) -> dict[str, int] | None:
    try:
        return c.state.desired()
    except StateUnavailable:
        return None


def embedded_redis(c: Cluster) -> EmbeddedRedis:
    assert c.embedded_redis is not None
    return c.embedded_redis


def workers_down(c: Cluster) -> list[dict[str, str]]:
    return [e for _, e in c.state.events(count=10_000) if e.get("kind") == "worker_down"]


class PingProbe:
    """Pings every worker in turn from its own thread and records each round trip (s)."""

    def __init__(self, handles: Mapping[str, Any]) -> None:
        self.handles = dict(handles)
        self.samples: list[tuple[float, str, float]] = []  # (sent at, worker, seconds)
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ping-probe", daemon=True)

    def __enter__(self) -> PingProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        while not self._stop.is_set():
            for wid, handle in self.handles.items():
                t = time.monotonic()
                try:
                    ray.get(handle.ping.remote(), timeout=60)
                except Exception as e:
                    self.errors.append(f"{wid}: {type(e).__name__}: {e}")
                    continue
                self.samples.append((t, wid, time.monotonic() - t))
            self._stop.wait(0.1)

    def worst(self) -> float:
        return max((s for _, _, s in self.samples), default=0.0)


class Streams:
    """`n` cluster.generate streams, one thread each: tokens, decode worker, migrations, end time.

    Use as a context manager: leaving it cancels what still runs (a failed test must not leave
    threads calling into a Ray that the fixture is about to shut down)."""

    def __init__(self, c: Cluster, n: int, params: SamplingParams) -> None:
        self.tokens: list[int | BaseException | None] = [None] * n
        self.decode_worker: list[str] = [""] * n
        self.migrations: list[int] = [0] * n
        self.done_at: list[float] = [0.0] * n
        self.started = 0
        self.spans: list[tuple[float, float]] = []  # (first token, end), monotonic, per finished stream
        self._lock = threading.Lock()
        self._runs: list[RequestRun] = []
        self._threads = [threading.Thread(target=self._run, args=(c, i, params), daemon=True) for i in range(n)]

    def __enter__(self) -> Streams:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            runs = list(self._runs)
        for run in runs:
            run.cancel()
        self.join(60)

    def join(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        for t in self._threads:
            t.join(max(0.0, end - time.monotonic()))

    def _run(self, c: Cluster, i: int, params: SamplingParams) -> None:
        prompt = [1, 504, 3458, 282, 253, 1345, 30, 2295, 100 + i, 198]
        n = 0
        first = float("inf")
        try:
            run = c.generate(prompt, params)
            with self._lock:
                self._runs.append(run)
            for out in run:
                self.migrations[i] = out.migrations
                if out.placement is not None:
                    self.decode_worker[i] = out.placement.decode_worker
                if n == 0:
                    first = time.monotonic()
                    with self._lock:
                        self.started += 1
                n += len(out.token_ids)
            self.tokens[i] = n
        except BaseException as e:
            self.tokens[i] = e
        self.done_at[i] = time.time()
        with self._lock:
            self.spans.append((first, time.monotonic()))

    def running_at(self, t: float) -> int:
        """How many streams had emitted their first token and not yet ended at `t` (monotonic)."""
        with self._lock:
            return sum(start <= t < end for start, end in self.spans)


def test_pings_answer_within_a_second_while_a_decode_worker_runs_its_maximum_streams(cluster: Cluster) -> None:
    before = pids(cluster)
    downs = len(workers_down(cluster))
    with PingProbe(cluster.handles()) as probe, Streams(cluster, STREAMS, LONG) as streams:
        until(lambda: streams.started == STREAMS, 240, f"{STREAMS} streams to emit their first token")
        streams.join(600)
    # Full load: nearly every stream decodes. Not all of them: the first prompt or few reach the
    # prefill worker alone, and their streams can end before the batched rest has started.
    full_load = [s for t, _, s in probe.samples if streams.running_at(t) >= FULL_LOAD]
    print(
        f"\nping under {STREAMS} streams: {len(probe.samples)} pings, {len(full_load)} with >= {FULL_LOAD} "
        f"streams running, worst {probe.worst():.3f} s, worst of those {max(full_load, default=0):.3f} s, "
        f"most running at a ping {max((streams.running_at(t) for t, _, _ in probe.samples), default=0)}"
    )
    assert streams.tokens == [LONG.max_tokens] * STREAMS
    assert not probe.errors
    assert len(full_load) >= 10, "the streams ran long enough to ping at full load"
    assert probe.worst() < PING_BUDGET_S
    assert pids(cluster) == before
    assert len(workers_down(cluster)) == downs
    check_all(cluster)


def test_a_sigkilled_redis_is_restarted_and_the_cluster_state_rebuilt(cluster: Cluster) -> None:
    redis = embedded_redis(cluster)
    before, sizes, restarts = pids(cluster), cluster.state.desired(), redis.restarts
    short = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with PingProbe(cluster.handles()) as probe, Streams(cluster, 4, short) as streams:
        until(lambda: streams.started == 4, 120, "4 streams to start")
        assert redis.pid is not None
        os.kill(redis.pid, signal.SIGKILL)
        until(lambda: redis.restarts == restarts + 1, 30, "the watchdog to start redis-server again")
        until(lambda: registered(cluster) >= set(before), 30, "every worker to register again")
        until(lambda: desired(cluster) == sizes, 30, "the pool manager to write the desired sizes back")
        streams.join(300)
    print(f"\nping across a Redis SIGKILL: {len(probe.samples)} pings, worst {probe.worst():.3f} s")
    assert streams.tokens == [short.max_tokens] * 4
    assert not probe.errors and probe.worst() < PING_BUDGET_S
    assert pids(cluster) == before
    check_all(cluster)


def test_a_redis_outage_kills_no_worker_and_loses_no_size(cluster: Cluster) -> None:
    redis = embedded_redis(cluster)
    before, sizes = pids(cluster), cluster.state.desired()
    short = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with PingProbe(cluster.handles()) as probe:
        with Streams(cluster, 4, short) as streams:
            until(lambda: streams.started == 4, 120, "4 streams to start")
            redis.stop()  # on purpose: the watchdog leaves it down
            rounds = status(cluster).rounds
            # 12 rounds is ~6 s: twice the heartbeat TTL, so every registry entry would have expired
            until(lambda: status(cluster).rounds >= rounds + 12, 60, "12 pool-manager rounds without Redis")
            during = status(cluster)
            assert not during.state_ok and during.desired == sizes
            streams.join(300)  # the workers serve on through the outage
        redis.start()
        until(lambda: registered(cluster) >= set(before), 30, "every worker to register again")
        until(lambda: desired(cluster) == sizes, 30, "the pool manager to write the desired sizes back")
    assert streams.tokens == [short.max_tokens] * 4
    assert not probe.errors and probe.worst() < PING_BUDGET_S
    assert pids(cluster) == before
    assert set(cluster.handles()) == set(before)
    check_all(cluster)


def test_a_sigkilled_pool_manager_comes_back_and_adopts_its_workers_mid_stream(cluster: Cluster) -> None:
    """The workers are detached and Ray restarts the manager: the new one finds the same worker
    processes, up, and takes over their pools; the streams on them never notice."""
    before, sizes, old = pids(cluster), cluster.state.desired(), status(cluster)
    downs = len(workers_down(cluster))
    short = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    with PingProbe(cluster.handles()) as probe, Streams(cluster, 4, short) as streams:
        until(lambda: streams.started == 4, 120, "4 streams to start")
        os.kill(old.pid, signal.SIGKILL)
        until(
            lambda: (m := cluster.manager_status()) is not None and m.pid != old.pid,
            60,
            "Ray to restart the pool manager",
        )
        streams.join(300)
    new = status(cluster)
    assert set(new.adopted) == set(before), new
    until(lambda: status(cluster).rounds >= 3, 30, "the new manager's rounds")
    assert {w["worker_id"]: w["state"] for w in cluster.workers()} == {wid: "up" for wid in before}
    assert streams.tokens == [short.max_tokens] * 4 and streams.migrations == [0] * 4
    assert not probe.errors and probe.worst() < PING_BUDGET_S
    assert pids(cluster) == before, "the same worker processes serve on"
    assert set(cluster.handles()) == set(before) and cluster.state.desired() == sizes
    assert len(workers_down(cluster)) == downs
    check_all(cluster)


def decode_workers(c: Cluster) -> list[dict[str, Any]]:
    return [w for w in c.workers() if w["role"] == "decode"]


def test_a_drain_lets_every_stream_finish_and_ends_on_an_idle_answer(cluster: Cluster) -> None:
    (victim,) = [w["worker_id"] for w in decode_workers(cluster)]
    cluster.scale("decode", 2)
    until(lambda: sum(w["state"] == "up" for w in decode_workers(cluster)) == 2, 180, "a second decode worker")
    params = SamplingParams(max_tokens=100, temperature=0, ignore_eos=True)
    with Streams(cluster, 8, params) as streams:
        until(lambda: streams.started == 8, 120, "8 streams to start")
        on_victim = [i for i, w in enumerate(streams.decode_worker) if w == victim]
        assert on_victim, streams.decode_worker
        cluster.scale("decode", 1)  # with the drain below the pool is back at 1: the victim goes
        assert cluster.drain(victim)
        streams.join(300)
    until(lambda: victim not in {w["worker_id"] for w in cluster.workers()}, 60, "the drained worker to go")
    assert streams.tokens == [params.max_tokens] * 8
    assert streams.migrations == [0] * 8, "no stream was moved off the draining worker"
    (down,) = [e for e in workers_down(cluster) if e["worker_id"] == victim]
    assert down["reason"] == "drained"
    assert float(down["ts"]) >= max(streams.done_at[i] for i in on_victim) - 0.5
    until(lambda: len(decode_workers(cluster)) == 1, 60, "one decode worker")
    check_all(cluster)
