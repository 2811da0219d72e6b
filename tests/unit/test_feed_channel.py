"""cluster/feed_channel.py: a worker's outbox pushed down a socket to the router, on loopback.
Both ends are real (Outboxes, Pushers, FeedListener, ChannelTake); the Ray calls between them
(`attach`, the fallback take) are the declared boundaries, here direct calls."""

from __future__ import annotations

import socket
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from cluster.feed_channel import ChannelTake, FeedListener, Pushers, closed_by_peer, recv_frame, send_frame
from engine.messages import TokenOutput
from engine.outbox import Item, Outboxes
from engine.outputs import RequestOutput
from tests.unit.kv_harness import wait_for

WAIT_S, FROZEN_S = 0.05, 0.5


def out(t: int, done: bool = False) -> RequestOutput:
    return RequestOutput("r", [t], str(t), done, "length" if done else None, num_prompt_tokens=3)


class Worker:
    """A worker's outbox and pushers; `attach` is what the Ray call runs on it."""

    def __init__(self, lost_s: float = 3.0) -> None:
        self.aborted: list[str] = []
        self.outboxes = Outboxes(abort=self.aborted.append, lost_s=lost_s)
        self.pushers = Pushers()
        self.attached = 0

    def attach(self, handle: Any, subscriber: str, address: tuple[str, int], token: bytes, wait_s: float) -> None:
        self.attached += 1
        self.pushers.attach(
            self.outboxes.take, self.outboxes.give_back, self.outboxes.lost, subscriber, address, token, wait_s
        )

    def emit(self, sub: str, rid: str, *tokens: int) -> None:
        sink = self.outboxes.sink(sub, rid)
        for t in tokens:
            sink.put(out(t))
        self.outboxes.flush()


@pytest.fixture
def listener() -> Iterator[FeedListener]:
    lst = FeedListener("127.0.0.1", "127.0.0.1", accept_s=1.0)
    yield lst
    lst.close()


def no_fallback(worker_id: str, handle: Any, subscriber: str, wait_s: float) -> list[Item]:
    raise AssertionError("the direct feed was expected")


def tokens(take: ChannelTake, worker_id: str, sub: str, n: int) -> list[int]:
    got: list[int] = []
    while len(got) < n:
        for _, entry in take(worker_id, None, sub, WAIT_S):
            assert isinstance(entry, TokenOutput)
            got.extend(entry.token_ids)
    return got


def test_outputs_come_down_the_socket_in_order_and_an_idle_worker_says_it_is_alive(listener: FeedListener) -> None:
    w = Worker()
    take = ChannelTake(listener, w.attach, no_fallback, FROZEN_S)
    w.emit("s", "a", 1, 2)
    assert tokens(take, "w1", "s", 2) == [1, 2]
    assert take("w1", None, "s", WAIT_S) == []  # idle: an empty frame within wait_s, not a timeout
    w.emit("s", "a", 3)
    assert tokens(take, "w1", "s", 1) == [3]
    assert w.attached == 1  # one channel, kept between takes
    take.shutdown()  # the router going away: the worker's pusher stops at its next send
    assert wait_for(lambda: w.pushers.live == 0), "its pusher stops once the router's end is gone"


def test_a_router_that_goes_away_has_its_requests_aborted_in_seconds(listener: FeedListener) -> None:
    """Its end of the feed closes (a SIGKILL closes it too): the worker's next send fails, and the
    requests it started there are aborted after lost_s, not the outbox's orphan_s. A pusher stopped
    on purpose (a new attach, the worker's own close) marks nothing."""
    kept = Worker(lost_s=0.2)
    take = ChannelTake(listener, kept.attach, no_fallback, FROZEN_S)
    kept.emit("s", "b", 1)
    assert tokens(take, "w2", "s", 1) == [1]
    kept.pushers.close()
    w = Worker(lost_s=0.2)
    take = ChannelTake(listener, w.attach, no_fallback, FROZEN_S)
    w.emit("s", "a", 1)
    assert tokens(take, "w1", "s", 1) == [1]
    take.shutdown()
    assert wait_for(lambda: w.aborted == ["a"], 5.0), "the gone router's request is aborted"
    assert kept.aborted == []


def test_a_worker_that_goes_away_fails_the_read_and_the_next_take_attaches_again(listener: FeedListener) -> None:
    w = Worker()
    take = ChannelTake(listener, w.attach, no_fallback, FROZEN_S)
    w.emit("s", "a", 1)
    assert tokens(take, "w1", "s", 1) == [1]
    w.pushers.close()  # as its process dying closes the socket
    with pytest.raises(ConnectionError):
        for _ in range(100):
            take("w1", None, "s", WAIT_S)
    w.emit("s", "b", 7)
    assert tokens(take, "w1", "s", 1) == [7] and w.attached == 2
    w.pushers.close()


def test_after_the_router_drops_a_channel_the_next_requests_lose_nothing(listener: FeedListener) -> None:
    """The router drops a channel (a read failed) while the worker's pusher still waits in its
    outbox. The next take attaches a new one, which stops the old pusher first: whatever the
    old one takes after that goes back to the outbox, in front, for the new one."""
    w = Worker()
    take = ChannelTake(listener, w.attach, no_fallback, FROZEN_S)
    w.emit("s", "a", 1)
    assert tokens(take, "w1", "s", 1) == [1]
    take.close("w1")
    assert take("w1", None, "s", WAIT_S) == [] and w.attached == 2  # attached again
    for i in range(20):  # many steps' outputs, while the old pusher wakes and gives back
        w.emit("s", "b", 100 + i)
    assert tokens(take, "w1", "s", 20) == list(range(100, 120))
    w.pushers.close()


def test_a_stopped_pushers_items_go_back_in_front() -> None:
    boxes = Outboxes(abort=lambda rid: None)
    sink = boxes.sink("s", "a")
    sink.put(out(1))
    first = boxes.take("s", 0.0)
    sink.put(out(2))
    boxes.give_back("s", first)
    assert [e.token_ids for _, e in boxes.take("s", 0.0) if isinstance(e, TokenOutput)] == [(1,), (2,)]


def test_a_connection_without_the_token_is_closed_unread(listener: FeedListener) -> None:
    token, fut = listener.expect()
    with socket.create_connection(listener.address, timeout=2) as s:
        s.sendall(b"x" * 32)
        s.settimeout(2)
        assert s.recv(1) == b""  # closed by the listener
    assert not fut.done()
    listener.forget(token)


def test_closing_the_listener_ends_its_thread_and_refuses_connections() -> None:
    def listening() -> int:
        return sum(t.name == "feed-listener" for t in threading.enumerate())

    before = listening()
    lst = FeedListener("127.0.0.1", "127.0.0.1")
    assert listening() == before + 1
    lst.close()
    assert listening() == before  # a bare close() left it blocked in accept() for good
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(lst.address, timeout=2)


def test_a_worker_that_cannot_connect_back_is_read_through_the_fallback(listener: FeedListener) -> None:
    def attach(handle: Any, subscriber: str, address: tuple[str, int], token: bytes, wait_s: float) -> None:
        raise ConnectionRefusedError("no route to the router")

    calls: list[str] = []

    def fallback(worker_id: str, handle: Any, subscriber: str, wait_s: float) -> list[Item]:
        calls.append(worker_id)
        return []

    take = ChannelTake(listener, attach, fallback, FROZEN_S)
    assert take("w1", None, "s", WAIT_S) == [] and take("w1", None, "s", WAIT_S) == []
    assert calls == ["w1", "w1"]


def test_a_frozen_worker_times_out_after_wait_plus_frozen(listener: FeedListener) -> None:
    """A worker whose pusher stops sending (not even the idle frames): the read gives up."""
    frozen: list[socket.socket] = []

    def attach(handle: Any, subscriber: str, address: tuple[str, int], token: bytes, wait_s: float) -> None:
        s = socket.create_connection(address)
        s.sendall(token)
        frozen.append(s)  # connected, then silent

    take = ChannelTake(listener, attach, no_fallback, frozen_s=0.2)
    t = threading.Timer(5, lambda: [s.close() for s in frozen])
    t.start()
    try:
        with pytest.raises(TimeoutError):
            take("w1", None, "s", WAIT_S)
    finally:
        t.cancel()
        for s in frozen:
            s.close()


def test_frames_round_trip_whole() -> None:
    a, b = socket.socketpair()
    with a, b:
        items: list[Item] = [("r1", TokenOutput.of(out(5))), ("r2", "RuntimeError: boom")]
        send_frame(a, items)
        assert recv_frame(b) == items


def test_a_closed_router_end_is_seen_before_any_send() -> None:
    """The worker looks for the router's end closing before each frame: the first send to a dead
    router's socket would still succeed, delaying `lost` by a frame."""
    worker, router = socket.socketpair()
    with worker:
        assert not closed_by_peer(worker)
        router.close()
        assert closed_by_peer(worker)
