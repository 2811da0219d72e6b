"""The router's end of the workers' outboxes (engine/outbox.py): a poller thread per worker with
requests in flight takes that worker's outputs, a batch per engine step, and sorts them into
per-request queues.

    worker w ──frames down its feed channel──▶ poller(w) ──▶ queue[r1], queue[r2], ...
                                                            (cluster.handoff reads its own)

The batches come down a socket the worker pushes them into (cluster/feed_channel.py); a worker
that cannot reach this process is asked instead, a Ray call (`take_outputs`) a step.

A worker whose take fails (dead, or no answer for `wait_s + frozen_s`) fails every queue it
feeds at once, with a `Gone`. A poller with no queue left ends; the next request on that worker
starts one again. Outputs of a request whose queue is closed are dropped.
"""

from __future__ import annotations

import os
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import ray

from cluster.config import bind_host
from cluster.feed_channel import ChannelTake, FeedListener
from engine.messages import TokenOutput
from engine.outbox import Item


@dataclass(frozen=True)
class Gone:
    """The worker feeding a queue is gone: why."""

    reason: str


# What a request's queue holds: an output, the worker's own error for it (a str), or Gone.
Entry = TokenOutput | str | Gone
Take = Callable[[str, Any, str, float], list[Item]]  # (worker id, its handle, subscriber, wait_s)


def ray_take(frozen_s: float) -> Take:
    """`take_outputs` on a worker actor, waiting at most `wait_s + frozen_s` for its answer."""

    def take(worker_id: str, handle: Any, subscriber: str, wait_s: float) -> list[Item]:
        items: list[Item] = ray.get(handle.take_outputs.remote(subscriber, wait_s), timeout=wait_s + frozen_s)
        return items

    return take


def channel_take(frozen_s: float) -> ChannelTake:
    """Feed channels to the workers (the Ray call a step where one cannot connect back), the
    listener on this node's address (`TANDEM_BIND_HOST`)."""

    def attach(handle: Any, subscriber: str, address: tuple[str, int], token: bytes, wait_s: float) -> None:
        ray.get(handle.attach_feed.remote(subscriber, address, token, wait_s), timeout=frozen_s)

    host = bind_host()
    listener = FeedListener(host, host)
    return ChannelTake(listener, attach, ray_take(frozen_s), frozen_s)


class _Poller:
    def __init__(self, feeds: Feeds, worker_id: str, handle: Any) -> None:
        self.feeds = feeds
        self.worker_id = worker_id
        self.handle = handle
        self.queues: dict[str, queue.SimpleQueue[Entry]] = {}
        self.ended = False

    def run(self) -> None:
        f = self.feeds
        while True:
            with f.lock:
                if not self.queues:
                    self._end()
                    return
            try:
                items = f.take(self.worker_id, self.handle, f.subscriber, f.wait_s)
            except Exception as e:
                with f.lock:
                    for q in self.queues.values():
                        q.put(Gone(f"worker {self.worker_id} is gone ({type(e).__name__})"))
                    self._end()
                return
            with f.lock:
                for rid, entry in items:
                    dest = self.queues.get(rid)
                    if dest is not None:
                        dest.put(entry)

    def _end(self) -> None:
        """Caller holds the feeds' lock."""
        self.ended = True
        if self.feeds.pollers.get(self.worker_id) is self:
            del self.feeds.pollers[self.worker_id]


class Feeds:
    """One per router process (cluster.Cluster): its `subscriber` id names its outbox on every
    worker. Thread-safe. `take` is how a worker's next batch is read (`channel_take` by default)."""

    def __init__(self, take: Take | None = None, wait_s: float = 1.0, frozen_s: float = 10.0) -> None:
        self.subscriber = uuid.uuid4().hex
        direct = os.environ.get("TANDEM_FEED_CHANNEL", "1") != "0"  # 0: a Ray call a step (for A/B)
        self.take = take or (channel_take(frozen_s) if direct else ray_take(frozen_s))
        self.wait_s = wait_s
        self.lock = threading.Lock()
        self.pollers: dict[str, _Poller] = {}

    def shutdown(self) -> None:
        """Close the feed channels and their listener (Cluster.shutdown)."""
        if isinstance(self.take, ChannelTake):
            self.take.shutdown()

    def open(self, worker_id: str, handle: Any, request_id: str) -> queue.SimpleQueue[Entry]:
        """A queue for `request_id`'s outputs from `worker_id`: open it before starting the request."""
        q: queue.SimpleQueue[Entry] = queue.SimpleQueue()
        with self.lock:
            p = self.pollers.get(worker_id)
            start = p is None or p.ended
            if p is None or p.ended:
                p = self.pollers[worker_id] = _Poller(self, worker_id, handle)
            p.queues[request_id] = q
        if start:
            threading.Thread(target=p.run, name=f"feed-{worker_id}", daemon=True).start()
        return q

    def close(self, worker_id: str, request_id: str) -> None:
        with self.lock:
            p = self.pollers.get(worker_id)
            if p is not None:
                p.queues.pop(request_id, None)

    def check_integrity(self) -> None:
        with self.lock:
            for wid, p in self.pollers.items():
                assert not p.ended and p.worker_id == wid, f"poller of {wid} ended but listed"
