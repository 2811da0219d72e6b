"""Faults under load, on real Ray, a real redis-server, the real model and real process kills,
through the real router: the scenarios of `tandem bench chaos` (bench.chaos_scenarios and
bench.chaos_control), asserted.

One cluster (1 prefill + 2 decode to start) and one router for the module; each scenario sets
the pool sizes it needs and ends with check_integrity() on every surviving worker and the
router's ledger (Chaos.held_after_idle).
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
import time
from collections.abc import Iterator

import httpx
import pytest

from bench.chaos_control import manager_kill, redis_kill, second_router
from bench.chaos_harness import Chaos, ScenarioResult
from bench.chaos_scenarios import decode_kill, decode_stop, disconnects, only_decode_kill, prefill_kill, prefill_stop
from bench.harness import running_cluster, serving, unique_namespace
from cluster.cluster import Cluster, ClusterConfig
from cluster.manager_link import CannotJoinError
from tests.integration.burst import burst
from tests.integration.serving import serving_engine
from tests.integration.waits import until

MAX_TOKENS = 32


@pytest.fixture(scope="module")
def chaos() -> Iterator[Chaos]:
    # The engine `tandem serve` runs (a replayed answer must be the undisturbed one to the token
    # there). 256-token prefill chunks: an abort waits for the engine's current step, so steps stay short.
    engine = serving_engine(num_blocks=512, num_threads=1, max_num_seqs=64, max_num_batched_tokens=256)
    config = ClusterConfig(namespace=unique_namespace("faults"), prefill=1, decode=2, engine=engine)
    with running_cluster(config) as cluster, serving(cluster, max_running=128) as url:
        yield Chaos(cluster, url, MAX_TOKENS)


def clean(r: ScenarioResult) -> None:
    assert (r.completed, r.errored, r.hung) == (r.requests, 0, 0), r
    assert r.held_blocks == 0, r


def test_decode_worker_killed_mid_stream(chaos: Chaos) -> None:
    r = decode_kill(chaos, n=32)
    clean(r)
    assert r.facts["same_text"] == r.facts["usage_exact"] == 32, r.facts
    assert r.facts["migrated"] > 0, "the killed worker had streams that moved"
    low, high = r.facts["burst_split"]
    assert 12 <= low <= high <= 20, f"a burst of 32 over 2 decode workers split {low}/{high}"


def test_the_only_decode_worker_killed_mid_stream(chaos: Chaos) -> None:
    r = only_decode_kill(chaos, n=8)
    clean(r)
    assert r.facts["same_text"] == r.facts["usage_exact"] == 8 and r.facts["migrated"] > 0, r.facts
    assert r.facts["new_request_ok"], r.facts
    assert r.facts["mid_push_same_text"], r.facts  # its prefill lost the peer; retried whole on the prefill worker


def test_prefill_worker_killed_mid_transfer(chaos: Chaos) -> None:
    r = prefill_kill(chaos, n=8)
    clean(r)
    assert r.facts["same_text"] == r.facts["usage_exact"] == 8, r.facts
    assert r.facts["retried"] > 0, f"the killed worker had prefills in flight, retried elsewhere: {r.facts}"


def test_decode_worker_frozen_for_15_s(chaos: Chaos) -> None:
    r = decode_stop(chaos, n=16, stop_s=15.0)
    clean(r)
    assert r.facts["same_text"] == 16 and r.facts["migrated"] > 0, r.facts
    assert 0 < r.facts["affected_stall_max_s"] < 15.0, "the frozen worker's streams moved before it woke up"
    assert 0 < r.facts["others_tpot_ratio"] <= 2.0, r.facts


def test_prefill_worker_frozen_for_15_s(chaos: Chaos) -> None:
    r = prefill_stop(chaos, n=8, stop_s=15.0)
    clean(r)  # held_blocks 0: what it prefilled after waking, for reservations long gone, was freed
    assert r.facts["same_text"] == r.facts["usage_exact"] == 8, r.facts
    assert r.facts["retried"] > 0, f"the frozen worker had prefills in flight, retried elsewhere: {r.facts}"
    assert 0 < r.facts["affected_stall_max_s"] < 15.0, "its prompts moved before it woke up"


def test_redis_killed_under_load(chaos: Chaos) -> None:
    r = redis_kill(chaos, n=16)
    clean(r)
    assert r.facts["same_text"] == 16, r.facts
    assert r.facts["new_request_ok"] and 0 < r.facts["new_first_token_s"] < 2.0, r.facts
    assert r.facts["redis_restarted"], r.facts


def test_a_second_router_joins_the_pools_and_leaves_them_running(chaos: Chaos) -> None:
    r = second_router(chaos, n=8)
    clean(r)
    assert r.facts["same_text"] == r.facts["usage_exact"] == 8 and r.facts["migrated"] == 0, r.facts
    assert r.facts["joined_pools"] and r.facts["same_workers"] and r.facts["same_sizes"], r.facts
    assert r.facts["same_engine"], r.facts
    assert r.facts["probe_ok"] and r.facts["probe_same_text"] and r.facts["stop_clean"], r.facts


def test_a_router_that_cannot_serve_the_running_pools_is_refused(chaos: Chaos, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without their Redis it would start one of its own, which the pools know nothing of; with
    another model it would tokenize for the wrong one."""
    monkeypatch.delenv("REDIS_URL", raising=False)
    with pytest.raises(CannotJoinError, match="set REDIS_URL"):
        Cluster.connect(dataclasses.replace(chaos.cluster.config, prefill=2))
    other_model = dataclasses.replace(chaos.cluster.config, model_path="/models/Other-1B.Q8_0.gguf")
    with pytest.raises(CannotJoinError, match=r"run SmolLM2-135M-Instruct.* not Other-1B"):
        Cluster.connect(other_model, redis_url=chaos.cluster.state_url)
    assert chaos.cluster.state.desired()["prefill"] == 1


def test_pool_manager_killed_under_load(chaos: Chaos) -> None:
    r = manager_kill(chaos, n=16)
    clean(r)
    assert r.facts["same_text"] == r.facts["usage_exact"] == 16 and r.facts["migrated"] == 0, r.facts
    assert r.facts["new_request_ok"] and r.facts["same_workers"] and r.facts["adopted"] == 3, r.facts


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_client_disconnects_free_everything(chaos: Chaos) -> None:
    # Ray logs a call that ended in an error and was dropped unread as "Unhandled error", with
    # its traceback: the router let go of every call it stopped waiting on (cluster.liveness.let_go)
    ray_log, records = logging.getLogger("ray._private.worker"), Records()
    ray_log.addHandler(records)
    try:
        r = disconnects(chaos)
        gc.collect()
        time.sleep(3)  # the dropped refs' errors are reported from Ray's own threads
    finally:
        ray_log.removeHandler(records)
    assert r.held_blocks == 0
    assert r.facts["hung_up_in_prefill"], "the client hung up before its first token"
    assert r.facts["queued_slot_freed_s"] < 1.0 and r.facts["prefill_blocks_freed_s"] < 1.0, r.facts
    assert not [m for m in records.messages if "Unhandled error" in m], records.messages


def test_a_mixed_burst_with_clients_leaving_leaves_nothing_behind(chaos: Chaos) -> None:
    """Streamed and whole, n of 1-3, guided answers (each guide twice and more, so the worker's
    tree drafts a whole one), echo with logprobs, lists of prompts, and a quarter of the clients
    hanging up early: every request read to its end is answered, and every admission slot and
    KV block comes back (the router's count once leaked a slot on a streamed n > 1 hang-up; a
    guided draft ending in its stop token failed whole engine steps)."""
    chaos.pools(prefill=1, decode=1)
    got = asyncio.run(burst(chaos.url, chaos.client.model, requests=48, concurrency=16, seed=3))
    assert got.failures == [] and got.left > 0, got

    def router_idle() -> bool:
        metrics = httpx.get(f"{chaos.url}/metrics", timeout=5).text
        return "tandem:num_requests_running 0.0" in metrics and "tandem:num_requests_waiting 0.0" in metrics

    until(router_idle, 10, "every admission slot back")
    assert chaos.held_after_idle() == 0
