"""FairRLock: a busy loop that releases and re-takes the lock cannot starve a waiter; typed
errors survive pickling (Ray) with their fields."""

from __future__ import annotations

import pickle
import threading
import time

import pytest

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.fair_lock import FairRLock
from kv_transfer.errors import ChunkRejected


def test_a_waiter_gets_the_lock_after_one_turn_of_a_busy_loop() -> None:
    lock = FairRLock()
    stop = threading.Event()
    turns = [0]

    def busy() -> None:  # the engine loop: take, work, let go, take again at once
        while not stop.is_set():
            with lock:
                turns[0] += 1
                time.sleep(0.02)

    t = threading.Thread(target=busy, daemon=True)
    t.start()
    time.sleep(0.1)
    waited = []
    for _ in range(5):
        t0 = time.monotonic()
        start = turns[0]
        with lock:
            waited.append((time.monotonic() - t0, turns[0] - start))
    stop.set()
    t.join(5)
    assert all(n <= 1 for _, n in waited), waited  # at most the step that was running
    assert max(s for s, _ in waited) < 0.5, waited


def test_reentrant_timeout_and_release_by_a_stranger() -> None:
    lock = FairRLock()
    with lock, lock:  # reentrant for its owner
        got: list[bool] = []
        th = threading.Thread(target=lambda: got.append(lock.acquire(timeout=0.05)))
        th.start()
        th.join()
        assert got == [False]
        assert not lock.acquire(blocking=False) or lock.release() is None  # the owner may re-enter
    assert lock.acquire(blocking=False)
    lock.release()
    with pytest.raises(RuntimeError):
        lock.release()


def test_typed_errors_survive_pickling_with_their_fields() -> None:
    e = pickle.loads(pickle.dumps(ChunkRejected("bad_token", "wrong or reused transfer token")))
    assert isinstance(e, ChunkRejected) and e.code == "bad_token" and "wrong or reused" in str(e)
    p = pickle.loads(pickle.dumps(PromptTooLongError("too long", "prompt")))
    assert isinstance(p, PromptTooLongError) and p.param == "prompt" and str(p) == "too long"
    assert pickle.loads(pickle.dumps(InvalidRequestError("bad"))).param is None
