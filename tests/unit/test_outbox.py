"""Outputs batched per step into a subscriber's outbox (engine/outbox.py), and the router's feeds
(cluster/feeds.py) sorting them into per-request queues. Workers in-process on a tiny model; the
feeds' one fake is their declared `take` boundary."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.feeds import Entry, Feeds, Gone
from cluster.liveness import AttemptFailed, EngineFault, failure_of
from decode_workers.colocated import ColocatedWorker
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.messages import TokenOutput
from engine.outbox import Item, Outboxes
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tests.unit.kv_harness import wait_for
from tests.unit.test_containment import poisoned, runs
from tests.unit.tiny import TINY, tiny_weights

PARAMS = SamplingParams(max_tokens=9, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def worker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ColocatedWorker]:
    from engine.weights import save_hf_dir

    d = tmp_path_factory.mktemp("tiny")
    save_hf_dir(d, TINY, tiny_weights())
    w = ColocatedWorker("c0", str(d), EngineConfig(dtype="fp32", block_size=4, num_blocks=64))
    yield w
    w.shutdown()


def drain(w: ColocatedWorker, subscriber: str, ids: set[str]) -> tuple[dict[str, list[int]], list[list[Item]]]:
    """Take until every request in `ids` finished: their tokens, and the batches as taken."""
    tokens: dict[str, list[int]] = {rid: [] for rid in ids}
    batches: list[list[Item]] = []
    left = set(ids)
    while left:
        batch = w.take_outputs(subscriber, 5.0)
        assert batch, "no output within 5 s"
        batches.append(batch)
        for rid, out in batch:
            assert isinstance(out, TokenOutput), out
            tokens[rid] += out.token_ids
            if out.finished:
                left.discard(rid)
    return tokens, batches


def test_a_step_reaches_its_subscriber_as_one_batch(worker: ColocatedWorker) -> None:
    prompts = {f"r{i}": [(5 * j + i) % 128 for j in range(6 + i)] for i in range(4)}
    for rid, prompt in prompts.items():
        worker.start("router-a", rid, prompt, PARAMS)
    tokens, batches = drain(worker, "router-a", set(prompts))
    for rid, prompt in prompts.items():
        alone = [t for o in worker.generate(f"{rid}-alone", prompt, PARAMS) for t in o.token_ids]
        assert tokens[rid] == alone
    assert max(len({rid for rid, _ in b}) for b in batches) == 4, "one batch carries every request of a step"
    assert worker.take_outputs("router-b", 0.01) == [], "another subscriber sees none of them"
    worker.check_integrity()


def test_bad_input_is_refused_and_leaves_nothing(worker: ColocatedWorker) -> None:
    with pytest.raises(InvalidRequestError):
        worker.start("router-a", "bad", [1, 2], SamplingParams(max_tokens=0))
    worker.check_integrity()
    worker.start("router-a", "ok", [1, 2, 3], PARAMS)
    worker.abort("ok")
    (batch,) = [worker.take_outputs("router-a", 5.0)]
    assert batch[-1][0] == "ok" and isinstance(batch[-1][1], TokenOutput) and batch[-1][1].finish_reason == "abort"
    worker.check_integrity()


def test_a_request_the_engine_fails_on_reaches_the_router_as_an_engine_fault(worker: ColocatedWorker) -> None:
    """engine/containment.py through the outbox: the poisoned request's feed ends in the entry a
    router reads as its engine failing on it (not the worker dying); the others finish."""
    worker.engine.layer_hook = poisoned(runs("bad"))
    try:
        for rid in ("ok", "bad"):
            worker.start("router-a", rid, [3, 1, 4, 1, 5, 9, 2, 6], PARAMS)
        ends: dict[str, Entry] = {}
        while len(ends) < 2:
            batch = worker.take_outputs("router-a", 5.0)
            assert batch, "no output within 5 s"
            ends |= {rid: out for rid, out in batch if isinstance(out, str) or out.finished}
    finally:
        worker.engine.layer_hook = None
    bad, ok = ends["bad"], ends["ok"]
    assert isinstance(ok, TokenOutput) and ok.finish_reason == "length"
    assert isinstance(bad, str) and "RuntimeError: poisoned step" in bad
    assert isinstance(failure_of(bad, "c0"), EngineFault)
    assert type(failure_of("WorkerDraining: the worker is draining", "c0")) is AttemptFailed
    worker.check_integrity()


def test_a_subscriber_that_stops_taking_is_forgotten_and_its_requests_aborted() -> None:
    aborted: list[str] = []
    boxes = Outboxes(aborted.append, orphan_s=0.2)
    sink = boxes.sink("gone", "r1")
    boxes.put(sink, RequestOutput("r1", [7], "x", False, None))
    boxes.take("alive", 0.0)
    assert wait_for(lambda: aborted == ["r1"], 3.0), "the orphan's request is aborted"
    boxes.put(sink, RequestOutput("r1", [8], "y", True, "abort"))  # too late: dropped
    assert boxes.take("gone", 0.0) == []
    boxes.check_integrity(set())
    boxes.close()


def test_a_subscriber_whose_feed_broke_is_forgotten_after_lost_s_unless_it_shows_up() -> None:
    aborted: list[str] = []
    boxes = Outboxes(aborted.append, orphan_s=60.0, lost_s=0.2)
    boxes.sink("dead", "r1")
    boxes.sink("back", "r2")
    boxes.sink("busy", "r3")
    for sub in ("dead", "back", "busy"):
        boxes.lost(sub)
    boxes.take("back", 0.0)  # its router attached a new feed
    boxes.sink("busy", "r4")  # its router started another request here
    assert wait_for(lambda: aborted == ["r1"], 3.0), "the dead router's request is aborted, in seconds"
    time.sleep(0.5)
    assert aborted == ["r1"], "a subscriber that took or started a request since is kept"
    boxes.check_integrity({"r2", "r3", "r4"})
    boxes.close()


def test_only_a_subscriber_forgotten_for_its_broken_feed_reaches_the_lost_hooks() -> None:
    """A worker releases a gone router's KV reservations from there; one that merely stopped
    taking (the Ray-call feed between requests) keeps them until their leases end."""
    boxes = Outboxes(lambda rid: None, orphan_s=0.3, lost_s=0.2)
    told: list[str] = []
    boxes.on_lost.append(told.append)
    for sub in ("lost", "quiet", "seen"):
        boxes.sink(sub, f"r-{sub}")
    boxes.lost("lost")
    boxes.lost("seen")
    boxes.seen("seen")  # it called again (a reservation)
    assert wait_for(lambda: told == ["lost"], 3.0)
    time.sleep(0.6)  # "quiet" and "seen" are orphans by now: forgotten, not reported
    assert told == ["lost"]
    boxes.close()


class Script:
    """A worker's `take_outputs`, scripted: each call returns the next batch, or raises it."""

    def __init__(self, batches: list[list[Item] | Exception]) -> None:
        self.batches = batches
        self.go = threading.Event()  # the first take waits for it
        self.more = threading.Event()

    def take(self, worker_id: str, handle: Any, subscriber: str, wait_s: float) -> list[Item]:
        assert self.go.wait(5)
        if not self.batches:
            self.more.wait(wait_s)
            return []
        b = self.batches.pop(0)
        if isinstance(b, Exception):
            raise b
        return b


def out(t: int, done: bool = False) -> TokenOutput:
    return TokenOutput((t,), str(t), done, "length" if done else None, 3, 1)


def get(q: queue.SimpleQueue[Entry]) -> Entry:
    return q.get(timeout=5)


def test_feeds_sort_batches_into_queues_and_fail_them_all_when_the_worker_goes() -> None:
    script = Script([[("a", out(1)), ("b", out(2)), ("stray", out(9))], [("a", out(3, True))], RuntimeError("died")])
    feeds = Feeds(script.take, wait_s=0.05)
    qa, qb = feeds.open("w1", None, "a"), feeds.open("w1", None, "b")
    script.go.set()
    assert get(qa) == out(1) and get(qb) == out(2) and get(qa) == out(3, True)
    feeds.close("w1", "a")
    gone = get(qb)
    assert isinstance(gone, Gone) and "w1" in gone.reason
    assert wait_for(lambda: "w1" not in feeds.pollers), "a failed poller ends"
    feeds.check_integrity()
    script.batches = [[("c", out(4))]]
    qc = feeds.open("w1", None, "c")  # a new poller for the next request
    assert get(qc) == out(4)
    feeds.close("w1", "c")
    script.more.set()
    assert wait_for(lambda: "w1" not in feeds.pollers), "a poller with no queue left ends"
    feeds.check_integrity()
