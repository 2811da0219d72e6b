"""The token feed over a socket: a worker pushes each step's outputs for a router down one TCP
connection, instead of the router asking through a Ray actor call a step.

    router: FeedListener (one per process) ── address, token ──▶ worker.attach_feed (one Ray call)
    worker: Pusher thread: outboxes.take(subscriber) ──frame──▶ the router's poller for it
                           (an empty frame every wait_s when idle: the router sees it alive)

Why: a Ray actor call costs the caller ~1.4 ms of CPU at 80 calls a second (its threads wake
and sleep around each), and the worker as much again, on the cores the engine steps on. At one
call an engine step it was most of the router's work a token.

Frames are a 4-byte big-endian length and a pickle of `list[Item]`. A connection is accepted
only after its first 32 bytes match a token the router handed to that worker through Ray, so
nothing else that reaches the port gets anything unpickled. A connection lives as long as
both ends: the router keeps one per worker (`ChannelTake`), and a poller that ends leaves it
for the next. A worker that dies closes it (the poller sees EOF at once); a frozen one sends
nothing, and the read times out after `wait_s + frozen_s`, as the Ray call did.
"""

from __future__ import annotations

import contextlib
import logging
import pickle
import secrets
import select
import socket
import struct
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from engine.outbox import Item

log = logging.getLogger(__name__)
TOKEN_BYTES = 32
_LEN = struct.Struct(">I")

TakeFn = Callable[[str, float], list[Item]]  # Outboxes.take
GiveBackFn = Callable[[str, list[Item]], None]  # Outboxes.give_back
LostFn = Callable[[str], None]  # Outboxes.lost


def send_frame(sock: socket.socket, items: list[Item]) -> None:
    body = pickle.dumps(items, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(body)) + body)


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("the worker closed its feed")
        buf += chunk
    return bytes(buf)


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the router closed its end of `sock` (it sends nothing after its token, so anything
    there to read is the end). Raises OSError for a reset connection."""
    poll = select.poll()
    poll.register(sock, select.POLLIN)
    return bool(poll.poll(0)) and not sock.recv(1, socket.MSG_PEEK)


def recv_frame(sock: socket.socket) -> list[Item]:
    """One frame, within the socket's timeout (raises TimeoutError, or ConnectionError at EOF)."""
    (n,) = _LEN.unpack(_recv_exactly(sock, _LEN.size))
    items: list[Item] = pickle.loads(_recv_exactly(sock, n))
    return items


class FeedListener:
    """The router's end: one listening socket; `expect(token)` waits for the worker given that
    token to connect. Connections with any other first 32 bytes are closed unread."""

    def __init__(self, host: str = "", advertise: str = "127.0.0.1", accept_s: float = 5.0) -> None:
        self._sock = socket.create_server((host, 0))
        self.address = (advertise, self._sock.getsockname()[1])
        self.accept_s = accept_s
        self._lock = threading.Lock()
        self._waiting: dict[bytes, Future[socket.socket]] = {}
        self._thread = threading.Thread(target=self._accept, name="feed-listener", daemon=True)
        self._thread.start()

    def expect(self) -> tuple[bytes, Future[socket.socket]]:
        token = secrets.token_bytes(TOKEN_BYTES)
        fut: Future[socket.socket] = Future()
        with self._lock:
            self._waiting[token] = fut
        return token, fut

    def forget(self, token: bytes) -> None:
        with self._lock:
            self._waiting.pop(token, None)

    def close(self) -> None:
        """Stop listening. Closing alone does not wake a thread blocked in accept() on Linux (it
        stayed there for the life of the process); shutting the socket down first does."""
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=5.0)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            threading.Thread(target=self._hello, args=(conn,), name="feed-hello", daemon=True).start()

    def _hello(self, conn: socket.socket) -> None:
        try:
            conn.settimeout(self.accept_s)
            token = _recv_exactly(conn, TOKEN_BYTES)
        except (OSError, ConnectionError):
            conn.close()
            return
        with self._lock:
            fut = self._waiting.pop(token, None)
        if fut is None or not fut.set_running_or_notify_cancel():
            conn.close()
            return
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        fut.set_result(conn)


class Pusher:
    """The worker's end, on its own thread: take `subscriber`'s outputs, send them, again, until
    the connection fails (then `lost(subscriber)`) or `stop()`. Items taken but not sent go back
    to the outbox, in front."""

    def __init__(self, take: TakeFn, give_back: GiveBackFn, lost: LostFn, subscriber: str, wait_s: float) -> None:
        self._take, self._give_back, self._lost = take, give_back, lost
        self.subscriber, self.wait_s = subscriber, wait_s
        self._stopped = threading.Event()
        self._sock: socket.socket | None = None

    def start(self, address: tuple[str, int], token: bytes, connect_s: float = 5.0) -> None:
        """Connect and say the token (raises OSError), then push from a thread."""
        sock = socket.create_connection(address, timeout=connect_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)
        sock.sendall(token)
        self._sock = sock
        threading.Thread(target=self._run, name=f"feed-push-{self.subscriber[:8]}", daemon=True).start()

    def stop(self) -> None:
        self._stopped.set()
        if self._sock is not None:
            self._sock.close()

    @property
    def stopped(self) -> bool:
        return self._stopped.is_set()

    def _run(self) -> None:
        assert self._sock is not None
        while not self._stopped.is_set():
            items = self._take(self.subscriber, self.wait_s)
            if self._stopped.is_set():
                self._give_back(self.subscriber, items)
                return
            try:
                if closed_by_peer(self._sock):  # a dead router's socket: without this, the first send still "succeeds"
                    raise ConnectionResetError("the router closed its feed")
                send_frame(self._sock, items)
            except OSError:
                self._give_back(self.subscriber, items)
                if not self._stopped.is_set():  # broke, rather than closed by stop()
                    self._stopped.set()
                    self._lost(self.subscriber)
                self._sock.close()
                return


class Pushers:
    """A worker's pushers, one per subscriber. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._by_subscriber: dict[str, Pusher] = {}

    def attach(
        self,
        take: TakeFn,
        give_back: GiveBackFn,
        lost: LostFn,
        subscriber: str,
        address: tuple[str, int],
        token: bytes,
        wait_s: float,
    ) -> None:
        """Push `subscriber`'s outputs to `address` (raises OSError when it cannot connect). A
        pusher it had stops first: what it takes after that goes back to the outbox, for this one."""
        with self._lock:
            old = self._by_subscriber.pop(subscriber, None)
        if old is not None:
            old.stop()
        pusher = Pusher(take, give_back, lost, subscriber, wait_s)
        pusher.start(address, token)  # connects: not under the lock
        with self._lock:
            other, self._by_subscriber[subscriber] = self._by_subscriber.get(subscriber), pusher
        if other is not None:  # attached twice at once: the later one wins
            other.stop()

    @property
    def live(self) -> int:
        """Pushers still sending (one stops when its router's end closes)."""
        with self._lock:
            return sum(not p.stopped for p in self._by_subscriber.values())

    def close(self) -> None:
        with self._lock:
            for p in self._by_subscriber.values():
                p.stop()
            self._by_subscriber.clear()


class ChannelTake:
    """`cluster.feeds.Take` over feed channels: the first take for a worker attaches one (a Ray
    call, `attach`), later ones read its frames. A worker that cannot connect back is read with
    `fallback` (the Ray call a step) instead. A failed read closes the channel and raises: the
    poller fails its queues, and the next take for that worker attaches again."""

    def __init__(
        self,
        listener: FeedListener,
        attach: Callable[[Any, str, tuple[str, int], bytes, float], None],
        fallback: Callable[[str, Any, str, float], list[Item]],
        frozen_s: float,
    ) -> None:
        self.listener, self._attach, self._fallback, self.frozen_s = listener, attach, fallback, frozen_s
        self._lock = threading.Lock()
        self._channels: dict[str, socket.socket] = {}
        self._unreachable: set[str] = set()

    def __call__(self, worker_id: str, handle: Any, subscriber: str, wait_s: float) -> list[Item]:
        with self._lock:
            sock, direct = self._channels.get(worker_id), worker_id not in self._unreachable
        if not direct:
            return self._fallback(worker_id, handle, subscriber, wait_s)
        if sock is None:
            sock = self._open(worker_id, handle, subscriber, wait_s)
            if sock is None:
                return self._fallback(worker_id, handle, subscriber, wait_s)
        sock.settimeout(wait_s + self.frozen_s)
        try:
            return recv_frame(sock)
        except (OSError, ConnectionError, pickle.UnpicklingError, EOFError):
            self.close(worker_id)
            raise

    def _open(self, worker_id: str, handle: Any, subscriber: str, wait_s: float) -> socket.socket | None:
        token, fut = self.listener.expect()
        try:
            self._attach(handle, subscriber, self.listener.address, token, wait_s)
            sock = fut.result(timeout=self.listener.accept_s + self.frozen_s)
        except Exception as e:  # the worker could not connect back, or is older: Ray calls for it
            self.listener.forget(token)
            log.warning("worker %s: no direct feed (%s: %s); its outputs come through Ray calls",
                        worker_id, type(e).__name__, e)  # fmt: skip
            with self._lock:
                self._unreachable.add(worker_id)
            return None
        with self._lock:
            self._channels[worker_id] = sock
        return sock

    def close(self, worker_id: str) -> None:
        with self._lock:
            sock = self._channels.pop(worker_id, None)
        if sock is not None:
            sock.close()

    def shutdown(self) -> None:
        """Close every channel and the listener."""
        with self._lock:
            socks, self._channels = list(self._channels.values()), {}
        for sock in socks:
            sock.close()
        self.listener.close()
