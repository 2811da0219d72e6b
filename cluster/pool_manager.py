"""PoolManager: a named, detached Ray actor that makes the live workers match the desired sizes.

Every half second it reads the desired sizes from Redis and:
  - replaces workers that stopped answering (dead actor, crashed process);
  - starts workers where a pool is short;
  - drains workers where a pool is long (no new work; killed once idle);
  - remembers the desired sizes, and writes them back if Redis lost them (a restart).
A role change is a drain of one pool and a start in the other.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.actors import start_worker
from cluster.state import ClusterState
from engine.config import EngineConfig

ROLES = ("prefill", "decode", "colocated")


@dataclass
class _Worker:
    worker_id: str
    role: str
    handle: Any
    state: str = "starting"  # starting | up | draining
    started: float = field(default_factory=time.monotonic)
    failures: int = 0


class PoolManager:
    def __init__(
        self,
        state_url: str,
        namespace: str,
        model_path: str,
        configs: dict[str, EngineConfig],
        transport: str = "grpc",
        interval_s: float = 0.5,
        start_timeout_s: float = 180.0,
    ) -> None:
        self.state = ClusterState(state_url, namespace)
        self.state_url = state_url
        self.namespace = namespace
        self.model_path = model_path
        self.transport = transport
        self.configs = configs
        self.interval_s = interval_s
        self.start_timeout_s = start_timeout_s
        self.workers: dict[str, _Worker] = {}
        self._desired: dict[str, int] = {}
        self._ids = itertools.count()
        self._lock = threading.RLock()
        self._stop = threading.Event()
        threading.Thread(target=self._run, name="reconcile", daemon=True).start()

    def ping(self) -> bool:
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.reconcile()
            except Exception:  # Redis briefly away, a slow actor: try again next round
                continue

    def reconcile(self) -> None:
        with self._lock:
            desired = self.state.desired()
            if not desired and self._desired:
                for role, n in self._desired.items():  # Redis restarted without persistence
                    self.state.set_desired(role, n)
                desired = dict(self._desired)
            self._desired = desired
            self._check_health()
            for role in ROLES:
                want = desired.get(role, 0)
                active = [w for w in self.workers.values() if w.role == role and w.state != "draining"]
                for _ in range(want - len(active)):
                    self._start(role)
                if len(active) > want:
                    victims = sorted(active, key=lambda w: (w.state == "up", -w.started))[: len(active) - want]
                    for w in victims:
                        self._drain(w)
            self._reap_drained()

    def _start(self, role: str) -> None:
        worker_id = f"{role[0]}{next(self._ids)}-{int(time.time() * 1000) % 100000}"
        handle = start_worker(
            role, worker_id, self.model_path, self.configs[role], self.state_url, self.namespace, self.transport
        )
        self.workers[worker_id] = _Worker(worker_id, role, handle)

    def _drain(self, w: _Worker) -> None:
        w.state = "draining"
        w.handle.drain.remote()
        self.state.emit("worker_draining", worker_id=w.worker_id, role=w.role)

    def _check_health(self) -> None:
        refs = {w.worker_id: w.handle.ping.remote() for w in self.workers.values()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=2.0)
        ready_set = set(ready)
        for wid, ref in refs.items():
            w = self.workers[wid]
            ok = False
            if ref in ready_set:
                try:
                    ray.get(ref)
                    ok = True
                except Exception:
                    ok = False
            if ok:
                w.failures = 0
                if w.state == "starting":
                    w.state = "up"
                continue
            dead = ref in ready_set  # answered with an error: the actor is gone
            if w.state == "starting" and not dead:  # still loading its model
                if time.monotonic() - w.started > self.start_timeout_s:
                    self._remove(w, "did not start")
                continue
            w.failures += 1
            if dead or w.failures >= 6:
                self._remove(w, "died" if dead else "unresponsive")

    def _reap_drained(self) -> None:
        for w in [w for w in self.workers.values() if w.state == "draining"]:
            try:
                idle = ray.get(w.handle.idle.remote(), timeout=2.0)
            except Exception:
                idle = True
            if idle:
                self._remove(w, "drained")

    def _remove(self, w: _Worker, why: str) -> None:
        self.workers.pop(w.worker_id, None)
        with contextlib.suppress(Exception):
            ray.kill(w.handle)
        self.state.deregister_worker(w.worker_id)
        self.state.emit("worker_down", worker_id=w.worker_id, role=w.role, reason=why)

    def drain(self, worker_id: str) -> bool:
        """Drain one worker now. The pool starts a replacement if it falls below its size."""
        with self._lock:
            w = self.workers.get(worker_id)
            if w is None:
                return False
            self._drain(w)
            return True

    def snapshot(self) -> list[dict[str, Any]]:
        """Each worker: id, role, state (starting / up / draining) and actor name."""
        with self._lock:
            return [{"worker_id": w.worker_id, "role": w.role, "state": w.state} for w in self.workers.values()]

    def handles(self) -> dict[str, Any]:
        with self._lock:
            return {w.worker_id: w.handle for w in self.workers.values() if w.state == "up"}

    def shutdown(self) -> None:
        """Stop reconciling and kill every worker."""
        self._stop.set()
        with self._lock:
            for w in list(self.workers.values()):
                self._remove(w, "shutdown")
