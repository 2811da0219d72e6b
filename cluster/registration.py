"""A worker actor's presence in Redis: its registry entry kept alive by heartbeats and, for
prefill and decode workers, its cached KV block hashes in the prefix index (cluster.state).

Mixins of the actors in cluster.actors; each runs its own daemon thread, on a Redis client that
gives up at once, so an outage never holds a request.
"""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from cluster.state import ClusterState, StateUnavailable

HEARTBEAT_S = 0.5
TTL_S = 3.0
# The heartbeat thread's Redis client: it gives up on a call at once rather than sit out an
# outage (the next beat tries again), so a dead Redis never holds anything for long.
HEARTBEAT_REDIS_TIMEOUT_S = 0.5


class Registered:
    """Mixin: keep this worker's entry in Redis."""

    state: ClusterState
    _stop_hb: threading.Event

    if TYPE_CHECKING:  # the actor's, read from the worker it holds

        @property
        def worker_id(self) -> str: ...

        @property
        def role(self) -> str: ...

    def _register(self, state_url: str, namespace: str) -> None:
        self.state = ClusterState(state_url, namespace, socket_timeout_s=HEARTBEAT_REDIS_TIMEOUT_S, retries=0)
        self._stop_hb = threading.Event()
        try:
            self.state.register_worker(self.worker_id, self._info(), TTL_S)
            self.state.emit("worker_up", worker_id=self.worker_id, role=self.role)
        except StateUnavailable:  # Redis is away: serve anyway, the first beat that reaches it registers
            pass
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()

    def _reregister(self) -> None:
        """Write this worker's entry now (its role changed): best effort, as every beat."""
        try:
            self.state.register_worker(self.worker_id, self._info(), TTL_S)
            self.state.emit("worker_up", worker_id=self.worker_id, role=self.role)
        except StateUnavailable:
            pass

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.stats()  # type: ignore[attr-defined]
        info["node"] = socket.gethostname()
        if "device" not in info:  # stats() names it once loaded
            import torch  # here, in the worker: the module is imported by the pool manager too

            from engine.worker_base import device_label

            info["device"] = device_label(torch.device("cpu"))
        info["healthy"] = True
        return info

    def _heartbeat_loop(self) -> None:
        while not self._stop_hb.wait(HEARTBEAT_S):
            try:
                if not self.state.heartbeat(self.worker_id, self._info(), TTL_S):
                    # Redis lost our entry (restart, expiry): register again, republish the cache
                    self.state.register_worker(self.worker_id, self._info(), TTL_S)
                    self._republish_blocks()
            except Exception:  # Redis down: keep serving, try again next beat
                continue

    def _republish_blocks(self) -> None:
        pass

    def stop_heartbeat(self) -> None:
        self._stop_hb.set()
        self.state.deregister_worker(self.worker_id)


class PublishesBlocks(Registered):
    """Mixin: also keep this worker's cached block hashes in the prefix index. Prefill and decode
    workers: a decode worker's cache holds the prompts it received and the answers it wrote,
    which a conversation's next turn reuses (cluster.routing's local route).

    Its own thread publishes every HEARTBEAT_S, and at once after `publish_soon()` (a request
    ended), so that a next turn sent right after an answer finds the answer in the index."""

    pop_block_events: Callable[[], tuple[list[int], list[int]]]

    def _register(self, state_url: str, namespace: str) -> None:
        self._cached: set[int] = set()
        self._unpublished: tuple[list[int], list[int]] = ([], [])
        self._index_lock = threading.Lock()
        self._publish_now = threading.Event()
        super()._register(state_url, namespace)
        threading.Thread(target=self._publish_loop, name="block-index", daemon=True).start()

    def publish_soon(self) -> None:
        self._publish_now.set()

    def _publish_loop(self) -> None:
        while not self._stop_hb.is_set():
            self._publish_now.wait(HEARTBEAT_S)
            self._publish_now.clear()
            try:
                self._publish_blocks()
            except Exception:  # Redis down: the events wait in _unpublished for the next round
                continue

    def _publish_blocks(self) -> None:
        with self._index_lock:
            stored, evicted = self.pop_block_events()
            # Kept until Redis has them: an outage must not lose index updates.
            self._unpublished[0].extend(stored)
            self._unpublished[1].extend(evicted)
            stored, evicted = self._unpublished
            if stored:
                self.state.add_blocks(self.worker_id, stored)
                self._cached.update(stored)
                stored.clear()
            if evicted:
                self.state.remove_blocks(self.worker_id, evicted)
                self._cached.difference_update(evicted)
                evicted.clear()

    def _republish_blocks(self) -> None:
        with self._index_lock:
            if self._cached:
                self.state.add_blocks(self.worker_id, sorted(self._cached))
