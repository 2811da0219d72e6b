"""The Ray actors: the plain workers, plus registration and heartbeats in Redis.

Actors are threaded (max_concurrency) so blocking calls (a prefill, a token stream)
run side by side; they ask for 0 CPUs and one slot of their role's custom resource,
so placement follows the `prefill` / `decode` / `colocated` slots nodes advertise.
"""

from __future__ import annotations

import os
import socket
import threading
from typing import Any

import ray

from cluster.state import ClusterState
from decode_workers.colocated import ColocatedWorker
from decode_workers.worker import DecodeWorker
from engine.config import EngineConfig
from prefill_workers.worker import PrefillWorker

HEARTBEAT_S = 0.5
TTL_S = 3.0


class _Registered:
    """Mixin: keep this worker's entry (and, for prefill, its cached block hashes) in Redis."""

    worker_id: str
    role: str
    state: ClusterState
    _stop_hb: threading.Event

    def _register(self, state_url: str, namespace: str) -> None:
        self.state = ClusterState(state_url, namespace)
        self._stop_hb = threading.Event()
        self.state.register_worker(self.worker_id, self._info(), TTL_S)
        self.state.emit("worker_up", worker_id=self.worker_id, role=self.role)
        threading.Thread(target=self._heartbeat_loop, name="heartbeat", daemon=True).start()

    def _info(self) -> dict[str, Any]:
        info: dict[str, Any] = self.stats()  # type: ignore[attr-defined]
        info["node"] = socket.gethostname()
        info["healthy"] = True
        return info

    def _heartbeat_loop(self) -> None:
        while not self._stop_hb.wait(HEARTBEAT_S):
            try:
                self._publish_blocks()
                if not self.state.heartbeat(self.worker_id, self._info(), TTL_S):
                    # Redis lost our entry (restart, expiry): register again, republish the cache
                    self.state.register_worker(self.worker_id, self._info(), TTL_S)
                    self._republish_blocks()
            except Exception:  # Redis down: keep serving, try again next beat
                continue

    def _publish_blocks(self) -> None:
        pass

    def _republish_blocks(self) -> None:
        pass

    def stop_heartbeat(self) -> None:
        self._stop_hb.set()
        self.state.deregister_worker(self.worker_id)


class PrefillActor(PrefillWorker, _Registered):
    def __init__(
        self,
        worker_id: str,
        model_path: str,
        config: EngineConfig,
        state_url: str,
        namespace: str,
        transport: str = "grpc",
    ) -> None:
        super().__init__(worker_id, model_path, config, transport)
        self._cached: set[int] = set()
        self._register(state_url, namespace)

    def _publish_blocks(self) -> None:
        stored, evicted = self.pop_block_events()
        if stored:
            self.state.add_blocks(self.worker_id, stored)
            self._cached.update(stored)
        if evicted:
            self.state.remove_blocks(self.worker_id, evicted)
            self._cached.difference_update(evicted)

    def _republish_blocks(self) -> None:
        if self._cached:
            self.state.add_blocks(self.worker_id, sorted(self._cached))


class DecodeActor(DecodeWorker, _Registered):
    def __init__(self, worker_id: str, model_path: str, config: EngineConfig, state_url: str, namespace: str) -> None:
        # The KV endpoint other nodes dial; loopback unless the deployment names this node's address.
        super().__init__(worker_id, model_path, config, host=os.environ.get("TANDEM_BIND_HOST", "127.0.0.1"))
        self._register(state_url, namespace)


class ColocatedActor(ColocatedWorker, _Registered):
    def __init__(self, worker_id: str, model_path: str, config: EngineConfig, state_url: str, namespace: str) -> None:
        super().__init__(worker_id, model_path, config)
        self._register(state_url, namespace)


ACTOR_CLASSES: dict[str, type] = {"prefill": PrefillActor, "decode": DecodeActor, "colocated": ColocatedActor}


def actor_name(namespace: str, worker_id: str) -> str:
    return f"tandem-{namespace}-{worker_id}"


def start_worker(
    role: str,
    worker_id: str,
    model_path: str,
    config: EngineConfig,
    state_url: str,
    namespace: str,
    transport: str = "grpc",
) -> Any:
    """Start one worker actor in its role's slot; returns its handle (it loads asynchronously).

    `transport` is how a prefill worker ships KV (grpc, shm); other roles ignore it."""
    cls: Any = ray.remote(ACTOR_CLASSES[role])
    env = {"OMP_NUM_THREADS": str(config.num_threads or os.cpu_count() or 1)}
    if "TANDEM_BIND_HOST" in os.environ:
        env["TANDEM_BIND_HOST"] = os.environ["TANDEM_BIND_HOST"]
    return cls.options(
        name=actor_name(namespace, worker_id),
        namespace=f"tandem-{namespace}",
        resources={role: 1},
        num_cpus=0,
        max_concurrency=64,
        max_restarts=0,
        runtime_env={"env_vars": env},
    ).remote(worker_id, model_path, config, state_url, namespace, *([transport] if role == "prefill" else []))
