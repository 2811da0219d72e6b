"""The P/D cluster on real Ray, a real redis-server and the real model.

One cluster for the module (Ray and model loads are the slow part); tests change pool
sizes through Redis and wait for the pool manager to reconcile.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray

from cluster.cluster import Cluster, ClusterConfig, NoRoomError
from cluster.outputs import StreamOutput
from cluster.routing import RoutingPolicy
from engine.cache_keys import cache_keys
from engine.config import EngineConfig
from engine.core_ledger import _SLOT, ledger_path
from engine.engine import Engine
from engine.kv_cache import prefix_hashes
from engine.sampling_params import SamplingParams
from tests.integration.serving import serving_engine
from tests.integration.waits import until

GREEDY = SamplingParams(max_tokens=24, temperature=0)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    # the engine `tandem serve` runs (int8 + suffix speculation where the per-row kernels are);
    # 640 blocks of 16: an 8K-token prompt fits
    c = Cluster.connect(ClusterConfig(namespace="itest", engine=serving_engine(num_blocks=640, num_threads=1)))
    try:
        c.wait_ready(240)
        yield c
    finally:
        c.shutdown()


@pytest.fixture(scope="module")
def reference(cluster: Cluster, model_path: str) -> Engine:
    """One engine alone, of the cluster's dtype: the tokens every path must give."""
    return Engine.from_path(model_path, EngineConfig(dtype=cluster.config.engine.dtype, num_blocks=640))


def count(c: Cluster, role: str, state: str = "up") -> int:
    return sum(1 for w in c.workers() if w["role"] == role and w["state"] == state and "free_blocks" in w)


def chat(engine: Engine, text: str) -> list[int]:
    tok = engine.tokenizer
    assert tok is not None
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]))


def tokens_of(outs: list[StreamOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def generate_when_room(c: Cluster, ids: list[int], params: SamplingParams, within_s: float = 60) -> list[StreamOutput]:
    """The request's outputs, tried again while the cluster has no room for it yet (NoRoomError:
    the blocks of requests that just ended come back with the next heartbeat), as the router's
    admission does."""
    end = time.monotonic() + within_s
    while True:
        try:
            return list(c.generate(ids, params))
        except NoRoomError:
            if time.monotonic() > end:
                raise
            time.sleep(0.25)


def prefill_queue(c: Cluster) -> int:
    """Prompt tokens this router has sent to prefill workers and not yet seen a first token of."""
    return sum(c.ledger.load(w["worker_id"]).prefill_tokens for w in c.workers() if w["role"] == "prefill")


def prefilling(c: Cluster) -> bool:
    """A prefill worker has a request, as its heartbeat says (`stale`: busy in a long step)."""
    return any(
        w["role"] == "prefill" and (w.get("stale") or w.get("running", 0) + w.get("waiting", 0) > 0)
        for w in c.workers()
    )


def test_parity_with_one_engine_and_colocated(cluster: Cluster, reference: Engine) -> None:
    cluster.scale("colocated", 1)
    until(lambda: count(cluster, "colocated") == 1, 180, "a colocated worker")
    for q in ["What is the capital of France?", "Write one sentence about rivers."]:
        ids = chat(reference, q)
        outs = list(cluster.generate(ids, GREEDY))
        expected = reference.generate([ids], GREEDY)[0].token_ids
        assert tokens_of(outs) == expected
        placement = outs[0].placement
        assert placement is not None and placement.prefill_s > 0 and placement.transfer_bytes > 0
        (colo,) = [h for wid, h in cluster.handles().items() if wid.startswith("c")]
        gen = colo.generate.options(num_returns="streaming").remote("colo-" + q[:8], ids, GREEDY)
        assert [t for r in gen for t in ray.get(r).token_ids] == expected
    cluster.scale("colocated", 0)
    until(lambda: count(cluster, "colocated", "up") == 0, 60, "the colocated worker to drain")
    cluster.check_integrity()


def test_prefix_index_routes_to_the_worker_that_holds_it(cluster: Cluster, reference: Engine) -> None:
    cluster.scale("prefill", 2)
    until(lambda: count(cluster, "prefill") == 2, 180, "two prefill workers")
    history = chat(reference, "Here is a long story about a lighthouse keeper. " * 12)
    first = next(iter(cluster.generate(history, GREEDY)))
    assert first.placement is not None
    holder = first.placement.prefill_worker
    hashes = prefix_hashes(history[:-1], cluster.config.engine.block_size)
    until(lambda: cluster.state.longest_prefix(hashes, [holder]).get(holder, 0) == len(hashes), 10, "the index")
    second = next(iter(cluster.generate(history + [198, 504], GREEDY)))
    assert second.placement is not None
    assert second.placement.prefill_worker == holder
    assert second.placement.cached_tokens > 0
    cluster.scale("prefill", 1)
    until(lambda: count(cluster, "prefill") == 1, 60, "prefill back to 1")
    cluster.check_integrity()


def test_scaling_decode_up_and_down_loses_no_request(cluster: Cluster, reference: Engine) -> None:
    cluster.scale("decode", 2)
    until(lambda: count(cluster, "decode") == 2, 180, "two decode workers")
    ids = chat(reference, "Count slowly from one to twenty.")
    long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
    results: list[Any] = []
    streaming = threading.Semaphore(0)

    def run() -> None:
        try:
            outs = []
            for out in cluster.generate(ids, long):
                if not outs:
                    streaming.release()
                outs.append(out)
            results.append(tokens_of(outs))
        except Exception as e:
            streaming.release()
            results.append(e)

    threads = [threading.Thread(target=run) for _ in range(4)]
    for t in threads:
        t.start()
    for _ in threads:
        assert streaming.acquire(timeout=120), "a stream never started"
    cluster.scale("decode", 1)  # one of the two drains while every request is in flight
    for t in threads:
        t.join(120)
    assert all(isinstance(r, list) and len(r) == 60 for r in results), results
    until(lambda: count(cluster, "decode") == 1 and count(cluster, "decode", "draining") == 0, 60, "decode at 1")
    cluster.check_integrity()


def test_a_killed_decode_workers_stream_ends_on_the_prefill_worker(cluster: Cluster, reference: Engine) -> None:
    """1P+1D, the only decode worker killed mid-stream: with no other decode worker, the replay
    runs whole on the prefill worker (RoutingPolicy.cross_pool), and the client gets every token
    of a run with no fault. The pool manager replaces the dead worker."""
    ids = chat(reference, "Tell me a long story about a dragon.")
    params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    gen = cluster.generate(ids, params)
    first = next(gen)
    assert first.placement is not None
    victim, prefill = first.placement.decode_worker, first.placement.prefill_worker
    ray.kill(cluster.handles()[victim])
    rest = list(gen)
    assert rest[-1].finished and rest[-1].migrations == 1
    assert tokens_of([first, *rest]) == reference.generate([ids], params)[0].token_ids
    assert prefill in cluster.handles()
    until(
        lambda: victim not in {w["worker_id"] for w in cluster.workers()} and count(cluster, "decode") == 1,
        180,
        "a replacement decode worker",
    )
    assert tokens_of(list(cluster.generate(ids, GREEDY))) == reference.generate([ids], GREEDY)[0].token_ids
    events = [e for _, e in cluster.state.events(count=1000)]
    assert any(e.get("kind") == "worker_down" and e.get("worker_id") == victim for e in events)
    cluster.check_integrity()


def test_redis_restart_while_idle(cluster: Cluster, reference: Engine) -> None:
    redis = cluster.embedded_redis
    assert redis is not None
    before = {w["worker_id"] for w in cluster.workers()}
    redis.restart()  # no persistence: every key is gone
    until(lambda: set(cluster.state.workers()) >= before, 30, "workers to re-register")
    until(lambda: cluster.state.desired().get("decode") == 1, 30, "desired sizes restored")
    ids = chat(reference, "Say hello.")
    assert tokens_of(list(cluster.generate(ids, GREEDY))) == reference.generate([ids], GREEDY)[0].token_ids
    cluster.check_integrity()


def test_next_turn_runs_on_the_decode_worker_that_wrote_the_answer(cluster: Cluster, reference: Engine) -> None:
    """Turn 2 (turn 1's prompt + answer + a new message) reuses the KV that turn 1 left on its
    decode worker: the local route, with the cached count in the breakdown and a cold run's tokens.
    The answer is marked as decoded (`SamplingParams.decoded`, as the router marks a chat's
    answers), so the cold run computes it as decode rows too: int8 needs that to the bit."""
    tok = reference.tokenizer
    assert tok is not None
    ids = chat(reference, "Name three rivers in Europe and say one thing about each.")
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    first = list(cluster.generate(ids, params))
    answer = tokens_of(first)
    assert first[0].placement is not None
    holder = first[0].placement.decode_worker
    bs = cluster.config.engine.block_size
    hashes = prefix_hashes(cache_keys(ids + answer[:-1], len(ids), params), bs)  # the last token sampled is never run
    until(lambda: cluster.state.longest_prefix(hashes, [holder]).get(holder, 0) == len(hashes), 10, "the index")
    turn2 = ids + answer + tok.encode("<|im_end|>\n<|im_start|>user\nAnd a fourth?<|im_end|>\n<|im_start|>assistant\n")
    marked = dataclasses.replace(GREEDY, decoded=((len(ids), len(ids) + len(answer)),))
    second = list(cluster.generate(turn2, marked))
    placement = second[0].placement
    assert placement is not None
    assert placement.prefill_worker == placement.decode_worker == holder
    assert placement.cached_tokens == len(hashes) * bs
    assert placement.transfer_bytes == 0
    assert tokens_of(second) == reference.generate([turn2], marked)[0].token_ids
    cluster.check_integrity()


def test_a_decode_worker_steps_on_the_idle_prefill_workers_core(cluster: Cluster, reference: Engine) -> None:
    """1P+1D x 1 thread on this host's 2 cores (engine/core_ledger.py): while the prefill worker
    is idle, the decode worker's steps borrow its core; the answer is a single engine's; both
    workers hold a slot of the namespace's ledger, and both are idle again after."""
    ids = chat(reference, "Count from one to twenty in words.")
    lent = {w["worker_id"]: w.get("lent_steps", 0) for w in cluster.workers()}
    outs = list(cluster.generate(ids, GREEDY))
    assert tokens_of(outs) == reference.generate([ids], GREEDY)[0].token_ids
    decode = outs[0].placement.decode_worker  # type: ignore[union-attr]
    until(lambda: lent_steps(cluster, decode) > lent[decode], 10, "the decode worker's heartbeat to show lent steps")
    workers = [w for w in cluster.workers() if w["state"] == "up" and "pid" in w]
    slots = ledger_slots(ledger_path(cluster.config.namespace))
    assert {w["pid"] for w in workers} <= {pid for pid, _, _ in slots}
    # at this process's niceness, not Ray's 15 for its workers (cluster.config.ray_env), which
    # leaves them nothing of a core that any nice-0 process wants
    assert {os.getpriority(os.PRIO_PROCESS, w["pid"]) for w in workers} == {os.getpriority(os.PRIO_PROCESS, 0)}
    until(lambda: not any(busy for _, _, busy in ledger_slots(ledger_path(cluster.config.namespace))), 10, "idle")
    cluster.check_integrity()


def lent_steps(c: Cluster, worker_id: str) -> int:
    return int(next(w.get("lent_steps", 0) for w in c.workers() if w["worker_id"] == worker_id))


def ledger_slots(path: Path) -> list[tuple[int, int, int]]:
    """The ledger's taken slots: (pid, base threads, busy)."""
    data = path.read_bytes()
    slots = [_SLOT.unpack_from(data, i * _SLOT.size) for i in range(len(data) // _SLOT.size)]
    return [s for s in slots if s[0]]


def test_a_short_prompt_spills_whole_to_the_prefill_worker(cluster: Cluster, reference: Engine) -> None:
    """With the decode worker ahead by `spill_streams` (here two routes just picked, each held in
    the ledger), a short prompt runs whole on the prefill worker: a cold run's tokens, no KV
    moved, every block freed after. (The guard against long prefills is unit-tested.)"""
    ids = chat(reference, "Name a river in Asia.")
    policy = RoutingPolicy(spill_streams=2, spill_stall_s=float("inf"))
    assert all(cluster.route(ids, GREEDY, policy=policy).prefill is not None for _ in range(2))
    spill = cluster.route(ids, GREEDY, policy=policy)
    assert spill.local and spill.prefill is None
    assert {w["worker_id"]: w["role"] for w in cluster.workers()}[spill.decode] == "prefill"
    ran_whole(cluster, reference, ids, list(cluster.generate(ids, GREEDY, route=spill)), spill.decode)


def ran_whole(c: Cluster, engine: Engine, ids: list[int], outs: list[StreamOutput], worker: str) -> None:
    """`outs` came from `worker` alone: a cold run's tokens, no KV moved; then every block is
    free, and the two routes picked but not run have lapsed."""
    placement = outs[0].placement
    assert placement is not None and placement.prefill_worker == placement.decode_worker == worker
    assert placement.transfer_bytes == 0
    assert tokens_of(outs) == engine.generate([ids], GREEDY)[0].token_ids
    c.check_integrity()
    until(lambda: c.ledger.num_holds == 0, 10, "the two unused routes' holds to lapse")


def test_a_prompt_overflows_whole_to_the_decode_worker_while_prefill_is_backlogged(
    cluster: Cluster, reference: Engine
) -> None:
    """With the prefill worker backlogged (here two long prompts' routes just picked, each held in
    the ledger), a prompt under `overflow_below_tokens` runs whole on the decode worker: a cold
    run's tokens, no KV moved; its tokens sit in the decode worker's prefill queue until its
    first token, and every block is freed after. (The ETA comparison is unit-tested.)"""
    text = "Summarize: " + " ".join(f"The river number {i} runs east to the sea." for i in range(40))
    ids = chat(reference, text)
    assert 256 <= len(ids) < 1024, len(ids)
    long_ids = ids * 3
    policy = RoutingPolicy(overflow_below_tokens=1024)
    assert all(cluster.route(long_ids, GREEDY, policy=policy).prefill is not None for _ in range(2))
    over = cluster.route(ids, GREEDY, policy=policy)
    assert over.local and over.prefill is None
    assert {w["worker_id"]: w["role"] for w in cluster.workers()}[over.decode] == "decode"
    run = cluster.generate(ids, GREEDY, route=over)
    outs = [next(run)]
    assert cluster.ledger.load(over.decode).prefill_tokens == 0  # out of the queue at its first token
    ran_whole(cluster, reference, ids, outs + list(run), over.decode)


def test_write_back_puts_the_answer_in_the_prefill_workers_cache(cluster: Cluster, reference: Engine) -> None:
    """Option (b) of multi-turn reuse: after a P/D turn, the decode worker copies the answer's KV to
    the prefill worker; turn 2 on P/D (local route off) then prefills only its new message there."""
    tok = reference.tokenizer
    assert tok is not None
    ids = chat(reference, "Name three lakes in Africa and say one thing about each.")
    params = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    cluster.config.write_back = True
    try:
        first = list(cluster.generate(ids, params))
    finally:
        cluster.config.write_back = False
    answer = tokens_of(first)
    placement = first[0].placement
    assert placement is not None and placement.prefill_worker != placement.decode_worker
    writer = placement.prefill_worker
    bs = cluster.config.engine.block_size
    hashes = prefix_hashes(cache_keys(ids + answer[:-1], len(ids), params), bs)  # what the decode worker ran
    until(lambda: cluster.state.longest_prefix(hashes, [writer]).get(writer, 0) == len(hashes), 10, "the write-back")
    cluster.check_integrity()  # the write-back's blocks: cached at ref 0 on the prefill side, held by none
    turn2 = ids + answer + tok.encode("<|im_end|>\n<|im_start|>user\nAnd a fourth?<|im_end|>\n<|im_start|>assistant\n")
    marked = dataclasses.replace(GREEDY, decoded=((len(ids), len(ids) + len(answer)),))  # as the router marks it
    route = cluster.route(turn2, marked, policy=RoutingPolicy(local_below_tokens=0))
    assert route.prefill == writer and route.cached_tokens == len(hashes) * bs
    second = list(cluster.generate(turn2, marked, route=route))
    placement = second[0].placement
    assert placement is not None and placement.prefill_worker == writer
    assert placement.cached_tokens == len(hashes) * bs
    assert tokens_of(second) == reference.generate([turn2], marked)[0].token_ids
    cluster.check_integrity()


def test_a_reservation_outlives_a_queue_longer_than_its_lease(cluster: Cluster, reference: Engine) -> None:
    """A short prompt queued behind a long prefill waits longer than its reservation's lease: the
    router renews the lease while it sees the pair alive, so nothing expires and nothing retries.
    (Without the renewal, the first chunk meets "no reservation ... expired" and the request fails
    before its first token.)"""
    # Two long prompts: the short one's step then carries a 512-token chunk of each, deep in its
    # context (chunked prefill lets it in at the next step, not after them): ~0.4 s a chunk of one
    # in int8 here, so the step outlasts a lease of 0.3 s, which renewals every ~0.1 s keep alive.
    lease_s = 0.3
    longs = [chat(reference, f"Tell me about sea number {i}. " * 600) for i in range(2)]  # ~4K tokens each
    short = chat(reference, "Name a river in Asia.")
    waits = cluster.config.waits
    cluster.config.waits = dataclasses.replace(waits, lease_s=lease_s, stall_s=0.05, poll_s=0.02)
    try:
        blockers = [
            threading.Thread(target=lambda ids=ids: list(cluster.generate(ids, SamplingParams(max_tokens=2))))
            for ids in longs
        ]
        for b in blockers:
            b.start()
        queued = sum(len(ids) for ids in longs) - 64  # less what their cached system prompt saves
        until(lambda: prefill_queue(cluster) >= queued and prefilling(cluster), 60, "the long prompts' prefill")
        route = cluster.route(short, GREEDY, policy=RoutingPolicy(local_below_tokens=0))
        assert route.prefill is not None
        outs = list(cluster.generate(short, GREEDY, route=route))
        for b in blockers:
            b.join(120)
    finally:
        cluster.config.waits = waits
    placement = outs[0].placement
    assert placement is not None and placement.transfer_bytes > 0 and outs[-1].migrations == 0
    print(f"\nqueue + prefill {placement.queue_s + placement.prefill_s:.2f} s against a lease of {lease_s} s")
    assert placement.queue_s + placement.prefill_s > lease_s, f"the queue did not outlast the lease: {placement}"
    assert tokens_of(outs) == reference.generate([short], GREEDY)[0].token_ids
    cluster.check_integrity()


def test_an_8k_token_prompt_completes_on_pd(cluster: Cluster, reference: Engine) -> None:
    """No fixed deadline stands in the way of a long prompt: the reservation's lease follows the
    prefill's estimate and every chunk renews it, the push's deadlines follow its progress."""
    tok = reference.tokenizer
    assert tok is not None
    ids = tok.encode("The history of the lighthouse keeper and the sea. " * 800)[:8000]
    params = SamplingParams(max_tokens=4, temperature=0)
    outs = generate_when_room(cluster, ids, params)
    placement = outs[0].placement
    assert placement is not None and placement.prefill_worker != placement.decode_worker
    assert placement.transfer_bytes > 0
    if reference.config.dtype == "fp32":
        assert tokens_of(outs) == [378, 1463, 282, 260]  # the engine alone, fp32 (measured once: 64 s)
    else:
        assert tokens_of(outs) == reference.generate([ids], params)[0].token_ids
    cluster.check_integrity()
