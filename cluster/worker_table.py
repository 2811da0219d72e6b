"""The pool manager's records of its workers, the table it publishes, and one round's probes.

Per worker, each round: a ping (health lane), idle() once a drain or a flip was acknowledged,
and the answer of a flip sent earlier. A call still pending stays pending into the next round
rather than being sent again, so silence is measured from the last answer, however slow one
round was. No lock is held while the answers are awaited.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError

from cluster.pool_plan import State
from cluster.start_failures import death_reason


@dataclass(frozen=True)
class WorkerEntry:
    worker_id: str
    role: str
    state: State
    handle: Any


@dataclass(frozen=True)
class WorkerTable:
    """The workers as of the last change; replaced whole, never mutated."""

    entries: tuple[WorkerEntry, ...] = ()

    def handles(self) -> dict[str, Any]:
        return {e.worker_id: e.handle for e in self.entries if e.state == "up"}


@dataclass
class WorkerRecord:
    """A worker's record. `state`, `role`, `flip_to` and `drain_ref` change under the manager's
    lock; the probe fields (`ping_ref`, `idle_ref`, `flip_ref`, `last_seen`, `drained`) belong
    to the round thread alone."""

    worker_id: str
    role: str
    handle: Any
    state: State = "starting"
    started: float = field(default_factory=time.monotonic)
    drain_ref: Any = None
    ping_ref: Any = None
    idle_ref: Any = None
    last_seen: float | None = None
    drained: bool = False  # the worker acknowledged drain(): an idle() answer now means it
    flip_to: str = ""  # flipping: the role it turns into
    flip_ref: Any = None  # the flip() call, once it was idle
    flip_started: float = 0.0

    def entry(self) -> WorkerEntry:
        return WorkerEntry(self.worker_id, self.role, self.state, self.handle)


@dataclass
class Seen:
    dead: bool = False
    error: str = ""  # dead: what killed it (start_failures.death_reason)
    idle: bool = False
    flipped_s: float | None = None  # a flip answered: the seconds its switch took
    flip_error: str = ""  # a flip refused (the worker lives): why


def probe(workers: list[WorkerRecord], lock: threading.Lock, wait_s: float) -> dict[str, Seen]:
    """Ask every worker for a ping (drained and flipping ones for idle() too), collect what
    answers within `wait_s`, and what earlier drains and flips answered."""
    with lock:
        acks = {w.worker_id: w.drain_ref for w in workers if w.drain_ref is not None and not w.drained}
    for w in workers:
        if w.ping_ref is None:
            w.ping_ref = w.handle.ping.remote()
        if w.drained and w.idle_ref is None and w.flip_ref is None:
            w.idle_ref = w.handle.idle.remote()
    refs = [r for w in workers for r in (w.ping_ref, w.idle_ref, w.flip_ref) if r is not None] + list(acks.values())
    ready = set(ray.wait(refs, num_returns=len(refs), timeout=wait_s)[0]) if refs else set()
    seen: dict[str, Seen] = {}
    now = time.monotonic()
    for w in workers:
        s = seen[w.worker_id] = Seen()
        if w.ping_ref in ready:
            ok, _ = answer(w.ping_ref, s)
            w.ping_ref = None
            if ok:
                w.last_seen = now
        if w.idle_ref in ready:
            ok, idle = answer(w.idle_ref, s)
            w.idle_ref = None
            s.idle = ok and bool(idle)
        if acks.get(w.worker_id) in ready:
            w.drained, _ = answer(acks[w.worker_id], s)
        if w.flip_ref in ready:
            try:
                s.flipped_s = float(ray.get(w.flip_ref, timeout=0))
            except RayActorError as e:
                s.dead, s.error = True, death_reason(e)
            except Exception as e:  # refused, the worker alive: it is drained and idle, so it goes
                s.flip_error = f"{type(e).__name__}: {e}"
            w.flip_ref = None
    return seen


def answer(ref: Any, seen: Seen) -> tuple[bool, Any]:
    """(True, value) for an answer; an actor error marks the worker dead, except one that says
    it is only unreachable for now (that counts as silence)."""
    try:
        return True, ray.get(ref, timeout=0)
    except ActorUnavailableError:
        return False, None
    except Exception as e:
        seen.dead, seen.error = True, death_reason(e)
        return False, None
