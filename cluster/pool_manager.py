"""PoolManager: a named, detached Ray actor that makes the live workers match the desired sizes.
Ray restarts it if it dies; the new one adopts the workers the old one started (cluster/worker_actors.py).

Every half second, one round on its own thread:

    desired  <- Redis (short timeout; on an outage, the last sizes it read)   no lock
    records  <- a copy of the worker table                                     lock, briefly
    probes   -> ping (health lane) every worker, idle() every drained one,
                wait up to probe_s for the answers (cluster/worker_table.py)    no lock
    plan     =  pool_plan.decide(...)                                          pure
    table    <- promotions, removals, drains; publish a new WorkerTable        lock, briefly
    actions  -> kill removed actors, drain(), flip(), start actors, events     no lock

No lock is held over a Ray or Redis call, and `handles()` / `snapshot()` read the published
WorkerTable, an immutable value swapped in one assignment, without any lock: the request
path never waits on a round. Redis losing the desired sizes (a restart without persistence)
gets them written back; Redis being away changes nothing (no kill, no size change).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import threading
import time
from typing import Any

import ray

from cluster.manager_link import ManagerStatus, PoolSpec
from cluster.pool_plan import Limits, RoundPlan, WorkerHealth, decide
from cluster.start_failures import StartFailures
from cluster.state import ClusterState, StateUnavailable
from cluster.worker_actors import adopt, new_worker_id, next_count, start_worker
from cluster.worker_table import Seen, WorkerRecord, WorkerTable, probe
from engine.config import EngineConfig
from engine.roles import FLIPPABLE
from kv_transfer.security import KVTLSConfig

log = logging.getLogger(__name__)
# A round gives up on Redis after this and goes on from what it knew.
REDIS_TIMEOUT_S = 1.0


class PoolManager:
    def __init__(
        self,
        state_url: str,
        namespace: str,
        model_path: str,
        configs: dict[str, EngineConfig],
        transport: str = "grpc",
        interval_s: float = 0.5,
        limits: Limits | None = None,
        probe_s: float = 1.0,
        kv_tls: KVTLSConfig | None = None,
        worker_env: dict[str, str] | None = None,
    ) -> None:
        self.state = ClusterState(state_url, namespace, socket_timeout_s=REDIS_TIMEOUT_S, retries=0)
        self.state_url, self.namespace, self.model_path, self.configs = state_url, namespace, model_path, configs
        self.transport, self.kv_tls = transport, kv_tls
        self.worker_env = dict(worker_env or {})  # ClusterConfig.worker_env
        self.interval_s, self.limits, self.probe_s = interval_s, limits or Limits(), probe_s
        self._workers = {w.worker_id: w for w in adopt(namespace)}
        self._desired: dict[str, int] | None = None
        self._ids = itertools.count(next_count(self._workers))
        self._lock = threading.Lock()  # guards _workers, record states, _epoch; never held over a call
        self._round_lock = threading.Lock()  # one round at a time; the request path never takes it
        self._epoch = 0  # bumped by drain(): a round planned before it must not also resize
        self._failures = StartFailures()  # workers dead before their first answer, by role (rounds only)
        self._table = WorkerTable(tuple(w.entry() for w in self._workers.values()))
        self._status = ManagerStatus(0, True, None, os.getpid(), tuple(self._workers))
        for w in self._workers.values():
            self._emit("worker_adopted", worker_id=w.worker_id, role=w.role, state=w.state)
            if w.state in ("draining", "flipping"):
                self._send_drain(w)  # again: its drain_ref and idle() answers then end (or turn) it as before
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="reconcile", daemon=True)
        self._thread.start()

    def ping(self) -> bool:
        return True

    # ---- the request path: lock-free reads ---------------------------------------------------

    def handles(self) -> dict[str, Any]:
        """Actor handles of the workers that are up."""
        return self._table.handles()

    def snapshot(self) -> list[dict[str, Any]]:
        """Each worker: id, role and state (starting / up / draining)."""
        return [{"worker_id": e.worker_id, "role": e.role, "state": e.state} for e in self._table.entries]

    def status(self) -> ManagerStatus:
        return self._status

    def spec(self) -> PoolSpec:
        return PoolSpec(self.model_path, self.configs["colocated"], self.transport)

    # ---- operations --------------------------------------------------------------------------

    def drain(self, worker_id: str) -> bool:
        """Drain one worker now (False if unknown). The pool starts a replacement if it falls
        below its size; the worker is killed once it answers idle()."""
        with self._lock:
            w = self._workers.get(worker_id)
            if w is None:
                return False
            if w.state == "draining":
                return True
            w.state = "draining"
            self._epoch += 1
            self._publish()
        self._send_drain(w)
        return True

    def flip(self, worker_id: str, role: str) -> bool:
        """Turn an up prefill or decode worker into the other role in place: drained (what it
        holds finishes), then switched with its weights and cache kept (PDActor.flip). The
        desired sizes move with it, so no pool starts or drains for it. False if no such worker
        is up in the other role. Raises StateUnavailable (Redis away: nothing changed)."""
        if role not in FLIPPABLE:
            raise ValueError(f"a worker flips between {sorted(FLIPPABLE)}, not to {role!r}")
        with self._round_lock:  # between rounds: none plans around a half-made change
            with self._lock:
                w = self._workers.get(worker_id)
                if w is None or w.state != "up" or w.role == role or w.role not in FLIPPABLE:
                    return False
                was = w.role
            desired = self.state.desired() or dict(self._desired or {})
            desired[was] = max(0, desired.get(was, 0) - 1)
            desired[role] = desired.get(role, 0) + 1
            self.state.set_desired({was: desired[was], role: desired[role]})
            with self._lock:
                self._desired = desired
                w.state, w.flip_to, w.flip_started = "flipping", role, time.monotonic()
                self._publish()
        self._send_drain(w)
        return True

    def shutdown(self) -> None:
        """Stop reconciling and kill every worker."""
        self._stop.set()
        self._thread.join(timeout=10)
        with self._lock:
            workers = list(self._workers.values())
            self._workers.clear()
            self._publish()
        for w in workers:
            self._kill(w, "shutdown")

    # ---- one round ---------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.reconcile()
            except Exception:  # a bug or an unexpected Ray error: log it, the next round starts afresh
                log.exception("reconcile round failed")

    def reconcile(self) -> None:
        """One round (see the module docstring). Rounds never overlap."""
        with self._round_lock:
            desired, state_ok = self._read_desired()
            with self._lock:
                workers = list(self._workers.values())
                epoch = self._epoch
            seen = probe(workers, self._lock, self.probe_s)
            self._end_flips(workers, seen)
            now = time.monotonic()
            health = [self._health(w, seen.get(w.worker_id, Seen()), now) for w in workers]
            plan = decide(health, desired, self.limits)
            removed, drains, turns, resize = self._apply(plan, epoch)
            by_id = {w.worker_id: w for w in workers}
            for wid in plan.promote:
                self._failures.came_up(by_id[wid].role)
            for w, reason in removed:
                if reason == "failed to start":
                    reason = f"{reason}: {self._failures.failed(w.role, seen[w.worker_id].error, now).reason}"
                self._kill(w, reason)
            for w in drains:
                self._send_drain(w)
            for w in turns:
                w.flip_ref = w.handle.flip.remote(self.configs[w.flip_to])
            if resize and not self._stop.is_set():
                for role in plan.start:
                    if self._failures.may_start(role, now):  # backing off after failed starts
                        self._start(role)
            s = self._status
            self._status = dataclasses.replace(
                s, rounds=s.rounds + 1, state_ok=state_ok, desired=None if desired is None else dict(desired),
                start_failures=self._failures.snapshot(),
            )  # fmt: skip

    def _read_desired(self) -> tuple[dict[str, int] | None, bool]:
        """The desired sizes and whether Redis answered. An outage keeps the last ones read;
        an empty answer after sizes were known means Redis lost them: they are written back."""
        try:
            desired = self.state.desired()
            if not desired and self._desired:
                for role, n in self._desired.items():
                    self.state.set_desired(role, n)
                self._emit("desired_restored", **{role: str(n) for role, n in self._desired.items()})
                return self._desired, True
        except StateUnavailable:
            return self._desired, False
        self._desired = desired
        return desired, True

    def _health(self, w: WorkerRecord, seen: Seen, now: float) -> WorkerHealth:
        silent = None if w.last_seen is None else now - w.last_seen
        return WorkerHealth(w.worker_id, w.role, w.state, now - w.started, silent, seen.dead, seen.idle, w.flip_to)

    def _apply(self, plan: RoundPlan, epoch: int) -> tuple[list[tuple[WorkerRecord, str]], list[WorkerRecord],
                                                          list[WorkerRecord], bool]:  # fmt: skip
        """Apply the plan to the table under the lock and publish it; returns the records to
        kill (with why), those to drain (flips included), those to turn now, and whether the
        pool sizes may change this round."""
        now = time.monotonic()
        with self._lock:
            for wid in plan.promote:
                w = self._workers.get(wid)
                if w is not None and w.state == "starting":
                    w.state = "up"
            removed = [(w, r.reason) for r in plan.remove if (w := self._workers.pop(r.worker_id, None)) is not None]
            resize = epoch == self._epoch  # a drain() since the plan was made: resize next round
            drains: list[WorkerRecord] = []
            for wid in plan.drain if resize else ():
                w = self._workers.get(wid)
                if w is not None and w.state != "draining":
                    w.state = "draining"
                    drains.append(w)
            for wid, role in plan.flip if resize else ():
                w = self._workers.get(wid)
                if w is not None and w.state == "up":
                    w.state, w.flip_to, w.flip_started = "flipping", role, now
                    drains.append(w)
            turns = [w for wid in plan.turn if (w := self._workers.get(wid)) is not None and w.flip_ref is None]
            self._publish()
        return removed, drains, turns, resize

    def _end_flips(self, workers: list[WorkerRecord], seen: dict[str, Seen]) -> None:
        """Flips the workers answered: up in their new role, or (refused) drained away."""
        for w in workers:
            s = seen.get(w.worker_id)
            if s is None or (s.flipped_s is None and not s.flip_error):
                continue
            was, to = w.role, w.flip_to
            with self._lock:
                if s.flipped_s is not None:
                    w.role, w.state, w.flip_to, w.drained, w.drain_ref = to, "up", "", False, None
                else:
                    w.state, w.flip_to = "draining", ""  # drained and idle: the next round removes it
                self._publish()
            if s.flipped_s is not None:
                total = time.monotonic() - w.flip_started
                self._emit("worker_flipped", worker_id=w.worker_id, role=to, was=was,
                           switch_s=f"{s.flipped_s:.3f}", total_s=f"{total:.3f}")  # fmt: skip
            else:
                self._emit("flip_failed", worker_id=w.worker_id, role=was, to=to, reason=s.flip_error)

    def _publish(self) -> None:
        """Under the lock: swap in a fresh table for the lock-free readers."""
        self._table = WorkerTable(tuple(w.entry() for w in self._workers.values()))

    # ---- actions: no lock held ---------------------------------------------------------------

    def _start(self, role: str) -> None:
        worker_id = new_worker_id(role, next(self._ids))
        handle = start_worker(
            role,
            worker_id,
            self.model_path,
            self.configs[role],
            self.state_url,
            self.namespace,
            self.transport,
            self.kv_tls,
            self.worker_env,
        )
        with self._lock:
            self._workers[worker_id] = WorkerRecord(worker_id, role, handle)
            self._publish()

    def _send_drain(self, w: WorkerRecord) -> None:
        with self._lock:
            to = w.flip_to
        ref = w.handle.drain.remote(to)  # the worker keeps `to`: a restarted manager finishes the flip
        with self._lock:
            w.drain_ref = ref
        if to:
            self._emit("worker_flipping", worker_id=w.worker_id, role=w.role, to=to)
        else:
            self._emit("worker_draining", worker_id=w.worker_id, role=w.role)

    def _kill(self, w: WorkerRecord, why: str) -> None:
        with contextlib.suppress(Exception):
            ray.kill(w.handle)
        # the event before the entry goes: whoever sees the worker gone from the registry finds why
        self._emit("worker_down", worker_id=w.worker_id, role=w.role, reason=why)
        with contextlib.suppress(StateUnavailable):  # its entry expires with its heartbeats anyway
            self.state.deregister_worker(w.worker_id)

    def _emit(self, kind: str, **fields: str) -> None:
        """Best effort: the event log is for people, and Redis may be away."""
        with contextlib.suppress(StateUnavailable):
            self.state.emit(kind, **fields)
