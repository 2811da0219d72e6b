"""Prefill, decode and colocated workers in-process (no Ray): parity, abort, drain, integrity."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from decode_workers.colocated import ColocatedWorker
from decode_workers.worker import DecodeWorker
from engine.config import EngineConfig
from engine.errors import WorkerDraining
from engine.sampling_params import SamplingParams
from kv_transfer.errors import KVTransferError
from prefill_workers.worker import PrefillResult, PrefillWorker

CFG = EngineConfig(dtype="fp32", block_size=4, num_blocks=128, max_num_batched_tokens=16)
PARAMS = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def workers(model_dir: str) -> Iterator[tuple[PrefillWorker, DecodeWorker, ColocatedWorker]]:
    p = PrefillWorker("p0", model_dir, replace(CFG, role="prefill"))
    d = DecodeWorker("d0", model_dir, replace(CFG, role="decode"))
    c = ColocatedWorker("c0", model_dir, CFG)
    yield p, d, c
    for w in (p, d, c):
        w.shutdown()


def disaggregated(p: PrefillWorker, d: DecodeWorker, rid: str, prompt: list[int]) -> tuple[list[int], PrefillResult]:
    res = d.reserve(rid, len(prompt))
    out = p.prefill(rid, prompt, PARAMS, res)
    tokens = [t for o in d.generate(rid, prompt, out.first.token_ids[0], PARAMS) for t in o.token_ids]
    return tokens, out


def test_disaggregated_equals_colocated(workers: tuple[PrefillWorker, DecodeWorker, ColocatedWorker]) -> None:
    p, d, c = workers
    for i, n in enumerate((3, 17, 40)):
        prompt = [(7 * j + i) % 128 for j in range(n)]
        tokens, out = disaggregated(p, d, f"r{i}", prompt)
        alone = [t for o in c.generate(f"c{i}", prompt, PARAMS) for t in o.token_ids]
        assert tokens == alone
        assert set(out.timing()) == {"queue_s", "prefill_s", "transfer_s"} and out.transfer.bytes > 0
    for w in workers:
        w.check_integrity()
    assert d.stats()["free_blocks"] == 128 and p.stats()["free_blocks"] == 128


def test_prefix_cache_reuse_is_reported(workers: tuple[PrefillWorker, DecodeWorker, ColocatedWorker]) -> None:
    p, d, _ = workers
    prompt = list(range(1, 30))
    disaggregated(p, d, "a", prompt)
    stored, _ = p.pop_block_events()
    assert stored, "cached block hashes are reported for the prefix index"
    _, out = disaggregated(p, d, "b", prompt + [5])
    assert out.cached_tokens == 28


def test_abort_mid_stream_frees_blocks(workers: tuple[PrefillWorker, DecodeWorker, ColocatedWorker]) -> None:
    p, d, c = workers
    gen = c.generate("x", [1, 2, 3], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True))
    next(gen)
    gen.close()  # the caller went away
    c.check_integrity()
    assert c.stats()["free_blocks"] == 128
    assert c.stats()["device"].startswith("cpu, ")  # what /admin/pools shows
    res = d.reserve("y", 10)
    d.release("y")
    with pytest.raises(KVTransferError):
        p.prefill("y", list(range(10)), PARAMS, res)  # the reservation is gone: typed error, no hang
    p.check_integrity()
    d.check_integrity()
    assert p.stats()["free_blocks"] == 128 and d.stats()["free_blocks"] == 128


def test_a_gone_routers_reservations_are_released(workers: tuple[PrefillWorker, DecodeWorker, ColocatedWorker]) -> None:
    """Its feed broke and it did not come back (engine/outbox.py's lost_s): its reservations go
    with its requests. Another router's stay, and so do those of one that reserved since."""
    _, d, _ = workers
    d.outboxes.lost_s = 0.2
    try:
        for sub in ("gone", "other", "back"):
            d.outboxes.take(sub, 0.0)  # each has a feed (its pusher takes)
        d.reserve("g1", 10, owner="gone")
        d.reserve("g2", 20, owner="gone")
        d.reserve("o1", 10, owner="other")
        d.outboxes.lost("gone")
        d.outboxes.lost("back")
        d.reserve("b1", 10, owner="back")  # it called again: it is there
        wait = time.monotonic() + 5
        while d.receiver.owned_by("gone") and time.monotonic() < wait:
            time.sleep(0.05)
        assert d.receiver.owned_by("gone") == [] and d.receiver.owned_by("other") == ["o1"]
        time.sleep(0.5)
        assert d.receiver.owned_by("back") == ["b1"]
        d.check_integrity()
    finally:
        d.outboxes.lost_s = 3.0
        for rid in ("o1", "b1"):
            d.release(rid)
    assert d.stats()["free_blocks"] == 128
    d.check_integrity()


def test_drain_refuses_new_work(model_dir: str) -> None:
    c = ColocatedWorker("c1", model_dir, CFG)
    try:
        c.drain()
        with pytest.raises(WorkerDraining):
            next(c.generate("z", [1, 2], PARAMS))
        assert c.idle()
    finally:
        c.shutdown()


def test_a_worker_shares_its_hosts_cores_or_serves_on_its_own(model_dir: str, tmp_path: Path) -> None:
    c = ColocatedWorker("c2", model_dir, replace(CFG, num_threads=1))
    try:
        c.share_cores(tmp_path / "missing-dir" / "cores")  # cannot be opened: no ledger, still serves
        assert c.ledger is None and c.loop.cores is None
        assert len([t for o in c.generate("a", [1, 2, 3], PARAMS) for t in o.token_ids]) == 12
        c.share_cores(tmp_path / "cores")
        assert c.ledger is not None and c.loop.cores is c.ledger
        assert len([t for o in c.generate("b", [1, 2, 3], PARAMS) for t in o.token_ids]) == 12
        assert c.ledger.lent_steps == 0  # the only worker of its ledger: its 1 thread is the whole split
        c.check_integrity()
    finally:
        c.shutdown()
    assert not (tmp_path / "cores").exists()  # the last to leave removes the ledger


def test_tiny_checkpoint_without_tokenizer(model_dir: str) -> None:
    assert not (Path(model_dir) / "tokenizer.json").exists()


def test_concurrent_requests_do_not_deadlock(workers: tuple[PrefillWorker, DecodeWorker, ColocatedWorker]) -> None:
    """Reserve (receiver lock) and admit (engine lock, inside the engine loop) run at once;
    the two locks must always be taken in the same order."""
    import threading

    p, d, _ = workers
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            for j in range(3):
                disaggregated(p, d, f"cc{i}-{j}", [(i * 13 + j * 7 + k) % 128 for k in range(5 + 3 * i)])
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "requests hung: lock-order deadlock"
    assert not errors, errors
    d.check_integrity()
    p.check_integrity()
    assert d.stats()["free_blocks"] == 128


def ping_while_the_engine_lock_is_held(w: PrefillWorker | DecodeWorker | ColocatedWorker) -> list[str]:
    import threading

    held, release = threading.Event(), threading.Event()

    def hold() -> None:
        with w.loop.lock:
            held.set()
            release.wait(30)

    holder = threading.Thread(target=hold, daemon=True)
    holder.start()
    assert held.wait(10)
    answered: list[str] = []
    pinger = threading.Thread(target=lambda: answered.append(w.ping()), daemon=True)
    pinger.start()
    pinger.join(2)
    release.set()
    holder.join(10)
    return answered


def test_ping_never_takes_the_engine_lock(workers: tuple[PrefillWorker, DecodeWorker, ColocatedWorker]) -> None:
    """ping() answers while something else holds the engine lock (a long step)."""
    for w in workers:
        assert ping_while_the_engine_lock_is_held(w) == [w.worker_id], f"{w.worker_id}: ping waited for the lock"
        w.check_integrity()


def test_idle_waits_for_serving_calls_to_return(model_dir: str) -> None:
    """The engine is done with a request before the call that serves it has returned its last
    output: idle() (what a drain waits for) counts the call, then a short settle."""
    import time

    from engine.worker_base import IDLE_SETTLE_S

    c = ColocatedWorker("c2", model_dir, CFG)
    try:
        assert c.idle()
        with c.serving():
            outs = list(c.generate("s", [1, 2, 3], PARAMS))
            assert outs[-1].finished and c.loop.num_streams == 0
            assert not c.idle()
        returned = time.monotonic()
        assert not c.idle()
        while not c.idle():
            assert time.monotonic() - returned < IDLE_SETTLE_S + 5
            time.sleep(0.02)
        assert time.monotonic() - returned >= IDLE_SETTLE_S
        c.check_integrity()
    finally:
        c.shutdown()


def test_idle_waits_for_the_router_to_take_the_last_outputs(model_dir: str) -> None:
    """A request started into an outbox (`start`) is done in the engine, and its stream closed,
    before its router takes the last outputs: idle() waits for the take, or a drain would end
    the worker with a stream's last tokens in it."""
    import time

    from engine.worker_base import IDLE_SETTLE_S

    c = ColocatedWorker("c3", model_dir, CFG)
    try:
        c.start("router-1", "r", [1, 2, 3], PARAMS)
        deadline = time.monotonic() + 30
        while c.loop.num_streams or c.loop.call(lambda e: e.has_unfinished()):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(IDLE_SETTLE_S + 0.1)  # past the settle of the start call
        assert c.outboxes.undelivered > 0 and not c.idle()
        items = c.take_outputs("router-1", 0)
        assert items[-1][0] == "r" and not isinstance(items[-1][1], str) and items[-1][1].finished
        assert c.outboxes.undelivered == 0 and c.idle()
        c.check_integrity()
    finally:
        c.shutdown()


def test_kv_over_tls_between_workers(
    model_dir: str, workers: tuple[PrefillWorker, DecodeWorker, ColocatedWorker], tmp_path: Path
) -> None:
    """The TLS config a deployment passes (ClusterConfig.kv_tls) reaches both ends: same tokens."""
    from tests.unit.pki import write_pki

    server_tls, client_tls = write_pki(tmp_path)
    p = PrefillWorker("p-tls", model_dir, replace(CFG, role="prefill"), tls=client_tls)
    d = DecodeWorker("d-tls", model_dir, replace(CFG, role="decode"), tls=server_tls)
    plain = PrefillWorker("p-plain", model_dir, replace(CFG, role="prefill"))
    try:
        prompt = [(5 * j) % 128 for j in range(23)]
        tokens, out = disaggregated(p, d, "tls-1", prompt)
        assert tokens == [t for o in workers[2].generate("tls-c", prompt, PARAMS) for t in o.token_ids]
        assert out.transfer.bytes > 0
        with pytest.raises(KVTransferError):  # a plaintext sender cannot reach a TLS endpoint
            disaggregated(plain, d, "tls-2", prompt)
        assert d.release("tls-2")  # its release could not get through either: the hand-off's owner frees it
        for w in (p, d, plain):
            w.check_integrity()
        assert d.stats()["free_blocks"] == 128 and p.stats()["free_blocks"] == 128
    finally:
        for w in (p, d, plain):
            w.shutdown()


def test_stats_answer_at_once_while_a_step_holds_the_engine(
    workers: tuple[PrefillWorker, DecodeWorker, ColocatedWorker],
) -> None:
    """A heartbeat must not wait out a long step: stats() gives the last figures, marked stale."""
    w = workers[0]
    fresh = w.stats()
    assert "stale" not in fresh and fresh["free_blocks"] > 0
    out: list[dict[str, Any]] = []
    with w.loop.lock:  # what a multi-second prefill step does to everyone else
        t = time.monotonic()
        reader = threading.Thread(target=lambda: out.append(w.stats()))
        reader.start()
        reader.join(5)
        assert time.monotonic() - t < 1.0
    assert out[0]["stale"] is True and out[0]["free_blocks"] == fresh["free_blocks"]
    assert out[0]["worker_id"] == fresh["worker_id"] == "p0"
    assert "stale" not in w.stats()
