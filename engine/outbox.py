"""Outboxes: a worker's outputs, batched per engine step for each subscriber (a router), taken by
long polls. One message a step a subscriber, instead of one object a token a request.

    engine loop ──step──▶ dispatch: each request's output into its subscriber's outbox
                          after the step: wake every subscriber with something new
    router ──take(sub, wait_s)──▶ [(request_id, output | error), ...]  everything since its last take

Profiled before this (colocated, C = 8): each stream a Ray streaming generator on its own actor
thread, waking per step to wrap, pickle and send one object per token, lengthened the engine's
step through the GIL and the shared cores, the more the higher C.

A subscriber that stops taking (its router died) is forgotten after `orphan_s`, and the requests
it started are aborted, so that nothing runs or holds blocks for no one. One whose feed connection
broke (`lost`: the worker's send failed, cluster/feed_channel.py) is forgotten after `lost_s`
unless it takes, starts a request or is otherwise `seen` first: a router that died is let go of
in seconds, not half a minute (measured: 4 streams of a SIGKILLed router decoded on for 37 s),
and a live one, whose requests on this worker its own end of the broken feed has already
failed, loses nothing. `on_lost` hooks hear of such a router (a decode worker then releases the
KV it reserved for it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from engine.messages import TokenOutput
from engine.outputs import RequestOutput

# (request_id, its output, or why it failed)
Item = tuple[str, TokenOutput | str]


@dataclass
class _Box:
    items: list[Item] = field(default_factory=list)
    requests: set[str] = field(default_factory=set)
    taken: float = field(default_factory=time.monotonic)
    lost: float | None = None  # when its feed connection broke, if nothing has come from it since


class Sink:
    """A request's end of its subscriber's outbox: what EngineLoop puts its outputs into."""

    def __init__(self, outboxes: Outboxes, subscriber: str, request_id: str) -> None:
        self._outboxes = outboxes
        self.subscriber = subscriber
        self.request_id = request_id

    def put(self, item: RequestOutput | BaseException) -> None:
        self._outboxes.put(self, item)


class Outboxes:
    """Thread-safe. `abort(request_id)` is how a forgotten subscriber's requests are stopped."""

    def __init__(self, abort: Callable[[str], object], orphan_s: float = 30.0, lost_s: float = 3.0) -> None:
        self._abort = abort
        self.orphan_s, self.lost_s = orphan_s, lost_s
        # called with a subscriber forgotten for its broken feed, after its requests are aborted
        self.on_lost: list[Callable[[str], object]] = []
        self._boxes: dict[str, _Box] = {}
        self._cond = threading.Condition()
        self._dirty = False
        self._stop = threading.Event()
        threading.Thread(target=self._reap, name="outbox-reaper", daemon=True).start()

    def close(self) -> None:
        self._stop.set()

    def _reap(self) -> None:
        while not self._stop.wait(min(self.orphan_s / 4, self.lost_s / 2)):
            self._forget_orphans()

    def sink(self, subscriber: str, request_id: str) -> Sink:
        with self._cond:
            box = self._boxes.setdefault(subscriber, _Box())
            box.requests.add(request_id)
            box.lost = None  # it is there: it just started a request
        return Sink(self, subscriber, request_id)

    def seen(self, subscriber: str) -> None:
        """`subscriber` called this worker (a KV reservation, say): it is there."""
        with self._cond:
            box = self._boxes.get(subscriber)
            if box is not None:
                box.lost = None

    def lost(self, subscriber: str) -> None:
        """`subscriber`'s feed connection broke: forget it after `lost_s` unless it shows up first."""
        with self._cond:
            box = self._boxes.get(subscriber)
            if box is not None:
                box.lost = time.monotonic()

    def discard(self, sink: Sink) -> None:
        """Forget a request that never started (its `open` raised)."""
        with self._cond:
            box = self._boxes.get(sink.subscriber)
            if box is not None:
                box.requests.discard(sink.request_id)

    def put(self, sink: Sink, item: RequestOutput | BaseException) -> None:
        """Queue one output; the subscriber wakes at `flush` (once a step), not here."""
        entry = f"{type(item).__name__}: {item}" if isinstance(item, BaseException) else TokenOutput.of(item)
        with self._cond:
            box = self._boxes.get(sink.subscriber)
            if box is None:  # forgotten: its router is gone
                return
            box.items.append((sink.request_id, entry))
            if isinstance(entry, str) or entry.finished:
                box.requests.discard(sink.request_id)
            self._dirty = True

    def flush(self) -> None:
        """Wake the subscribers waiting in `take` (the engine loop calls this after each step)."""
        with self._cond:
            if self._dirty:
                self._dirty = False
                self._cond.notify_all()

    def take(self, subscriber: str, wait_s: float) -> list[Item]:
        """Everything queued for `subscriber` since its last take; waits up to `wait_s` for a
        first item. A subscriber that has not taken for `orphan_s` is forgotten."""
        end = time.monotonic() + wait_s
        with self._cond:
            box = self._boxes.setdefault(subscriber, _Box())
            while not box.items and (left := end - time.monotonic()) > 0:
                self._cond.wait(left)
                box = self._boxes.setdefault(subscriber, _Box())
            items, box.items = box.items, []
            box.taken, box.lost = time.monotonic(), None
        return items

    def give_back(self, subscriber: str, items: list[Item]) -> None:
        """Put taken items back in front of `subscriber`'s outbox (a taker that could not deliver
        them); dropped if the subscriber is forgotten."""
        if not items:
            return
        with self._cond:
            box = self._boxes.get(subscriber)
            if box is not None:
                box.items[:0] = items
                self._cond.notify_all()

    @property
    def undelivered(self) -> int:
        """Items queued that no subscriber has taken yet (a forgotten subscriber's are dropped)."""
        with self._cond:
            return sum(len(b.items) for b in self._boxes.values())

    def _forget_orphans(self) -> None:
        now = time.monotonic()
        with self._cond:
            gone = [
                s
                for s, b in self._boxes.items()
                if now - b.taken > self.orphan_s or (b.lost is not None and now - b.lost > self.lost_s)
            ]
            lost = [s for s in gone if self._boxes[s].lost is not None]
            stranded = [rid for s in gone for rid in self._boxes.pop(s).requests]
        for rid in stranded:
            self._abort(rid)
        for sub in lost:
            for hook in self.on_lost:
                hook(sub)

    def check_integrity(self, streaming: set[str]) -> None:
        """Raise AssertionError unless every request an outbox waits on is one the engine loop
        streams (`streaming`), and no request belongs to two subscribers."""
        with self._cond:
            owners = [rid for b in self._boxes.values() for rid in b.requests]
        assert len(owners) == len(set(owners)), "a request in two outboxes"
        stray = set(owners) - streaming
        assert not stray, f"outboxes wait on requests the loop does not run: {sorted(stray)[:4]}"
