"""A worker flips role in place on the real cluster (real Ray, Redis, the real model) while
streams are in flight: none is lost, greedy output is unchanged, the worker keeps its process
(no reload), and every worker passes check_integrity() after.

One cluster: 2 prefill workers + 1 decode worker on `--transport shm`, so KV goes in place into
the decode workers' shared caches (kv_transfer/in_place.py), a flipped worker's included. A
prefill worker flips to decode under load, serves decode, then flips back while streams run on it;
then the decode worker's flip is caught halfway by a SIGKILL of the pool manager.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator

import pytest
import ray

from cluster.cluster import Cluster, ClusterConfig
from engine.sampling_params import SamplingParams
from tests.integration.serving import serving_engine
from tests.integration.waits import until

PARAMS = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
N = 6


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    engine = serving_engine(num_blocks=256, num_threads=1)  # a flip drains: its streams end where they began
    c = Cluster.connect(ClusterConfig(namespace="roleflip", prefill=2, decode=1, engine=engine, transport="shm"))
    try:
        c.wait_ready(240)
        until(lambda: sum(w["state"] == "up" for w in c.workers()) == 3, 240, "three workers up")
        yield c
    finally:
        c.shutdown()


def prompt(i: int) -> list[int]:
    return [1, 504, 3458, 282, 253, 1345, 30, 2295, 100 + i, 198]


class Streams:
    """One thread per prompt: its tokens (or the error) and the decode worker that served it."""

    def __init__(self, c: Cluster, n: int) -> None:
        self.tokens: list[list[int] | BaseException] = [[] for _ in range(n)]
        self.decoded_on = [""] * n
        self.first = threading.Barrier(n + 1)
        self._threads = [threading.Thread(target=self._run, args=(c, i), daemon=True) for i in range(n)]
        for t in self._threads:
            t.start()

    def _run(self, c: Cluster, i: int) -> None:
        got: list[int] = []
        waited = False
        try:
            for out in c.generate(prompt(i), PARAMS):
                got += out.token_ids
                if out.placement is not None:
                    self.decoded_on[i] = out.placement.decode_worker
                if not waited:
                    waited = True
                    self.first.wait(120)
            self.tokens[i] = got
        except BaseException as e:
            self.tokens[i] = e
            if not waited:
                self.first.abort()

    def join(self) -> None:
        for t in self._threads:
            t.join(300)


def role_of(c: Cluster, wid: str) -> tuple[str, str]:
    w = next(w for w in c.workers() if w["worker_id"] == wid)
    return w["role"], w["state"]


def events(c: Cluster, kind: str, wid: str) -> list[dict[str, str]]:
    return [e for _, e in c.state.events(count=10_000) if e.get("kind") == kind and e.get("worker_id") == wid]


def stats(c: Cluster, wid: str) -> dict[str, object]:
    result: dict[str, object] = ray.get(c.handles()[wid].stats.remote(), timeout=30)
    return result


def pid(c: Cluster, wid: str) -> int:
    return int(str(stats(c, wid)["pid"]))


def check_all(c: Cluster) -> None:
    ray.get([h.check_integrity.remote() for h in c.handles().values()], timeout=60)


def test_a_prefill_worker_flips_to_decode_and_back_under_load_losing_nothing(cluster: Cluster) -> None:
    reference = Streams(cluster, N)
    reference.first.wait(120)
    reference.join()
    assert all(isinstance(t, list) and len(t) == PARAMS.max_tokens for t in reference.tokens), reference.tokens
    (decode0,) = [w["worker_id"] for w in cluster.workers() if w["role"] == "decode"]
    assert stats(cluster, decode0)["kv_in_place"], "on shm the decode worker's cache is shared"
    flipper = sorted(w["worker_id"] for w in cluster.workers() if w["role"] == "prefill")[0]
    before = pid(cluster, flipper)

    streams = Streams(cluster, N)  # prefill -> decode, with every stream started
    streams.first.wait(120)
    assert cluster.flip(flipper, "decode")
    assert role_of(cluster, flipper) == ("prefill", "flipping")
    until(lambda: role_of(cluster, flipper) == ("decode", "up"), 120, "the flip to decode")
    streams.join()
    assert streams.tokens == reference.tokens, "a stream was lost or changed by the flip"
    assert pid(cluster, flipper) == before, "the worker flipped in its own process, not a new one"
    assert stats(cluster, flipper)["kv_in_place"], "its cache moved into shared memory as it turned decode"
    assert {r: cluster.state.desired().get(r) for r in ("prefill", "decode")} == {"prefill": 1, "decode": 2}
    (done,) = events(cluster, "worker_flipped", flipper)
    assert done["role"] == "decode" and done["was"] == "prefill" and float(done["switch_s"]) > 0
    assert events(cluster, "worker_flipping", flipper)
    check_all(cluster)

    on_it = Streams(cluster, N)  # decode -> prefill, with streams decoding on the flipper itself
    on_it.first.wait(120)
    assert flipper in on_it.decoded_on, f"no stream was decoded on the new decode worker: {on_it.decoded_on}"
    assert cluster.flip(flipper, "prefill")
    until(lambda: role_of(cluster, flipper) == ("prefill", "up"), 180, "the flip back to prefill")
    on_it.join()
    assert on_it.tokens == reference.tokens
    assert set(on_it.decoded_on) <= {decode0, flipper}
    assert pid(cluster, flipper) == before
    assert {r: cluster.state.desired().get(r) for r in ("prefill", "decode")} == {"prefill": 2, "decode": 1}
    assert not [e for _, e in cluster.state.events(count=10_000) if e.get("kind") in ("worker_down", "flip_failed")]

    again = Streams(cluster, N)  # and it prefills again
    again.first.wait(120)
    again.join()
    assert again.tokens == reference.tokens
    check_all(cluster)


def test_a_flip_under_way_is_finished_by_the_pool_manager_ray_restarts(cluster: Cluster) -> None:
    """The worker keeps the role it was drained to turn into; the new manager adopts it as
    flipping and turns it in place: same process, no worker down, the streams on it unchanged."""
    reference = Streams(cluster, N)
    reference.first.wait(120)
    reference.join()
    (flipper,) = [w["worker_id"] for w in cluster.workers() if w["role"] == "decode"]
    handle, before, old = cluster.handles()[flipper], pid(cluster, flipper), cluster.manager_status()
    assert old is not None

    streams = Streams(cluster, N)  # decoding on the flipper while it drains
    streams.first.wait(120)
    assert cluster.flip(flipper, "prefill")
    assert ray.get(handle.stats.remote(), timeout=30)["flip_to"] == "prefill", "the worker knows where it goes"
    os.kill(old.pid, signal.SIGKILL)  # before the old manager could turn it: its streams still run
    until(lambda: (m := cluster.manager_status()) is not None and m.pid != old.pid, 60, "Ray to restart the manager")
    (adopted,) = [e for e in events(cluster, "worker_adopted", flipper)]
    assert adopted["state"] == "flipping", adopted
    until(lambda: role_of(cluster, flipper) == ("prefill", "up"), 180, "the new manager to finish the flip")
    streams.join()
    assert streams.tokens == reference.tokens, "a stream was lost or changed by the flip"
    assert pid(cluster, flipper) == before, "turned in place, not replaced"
    assert {r: cluster.state.desired().get(r) for r in ("prefill", "decode")} == {"prefill": 3, "decode": 0}
    assert [e["was"] for e in events(cluster, "worker_flipped", flipper)][-1] == "decode"
    assert not [e for _, e in cluster.state.events(count=10_000) if e.get("kind") in ("worker_down", "flip_failed")]

    assert cluster.flip(flipper, "decode")  # and the new manager flips it back, as any other
    until(lambda: role_of(cluster, flipper) == ("decode", "up"), 180, "the flip back to decode")
    again = Streams(cluster, N)
    again.first.wait(120)
    again.join()
    assert again.tokens == reference.tokens and pid(cluster, flipper) == before
    check_all(cluster)
