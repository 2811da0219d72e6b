"""One round of the pool manager, decided from plain values: no Ray, no Redis, no clock.

    per worker   WorkerHealth(state, age_s, silent_s, dead, idle, flip_to)   what the probes saw
    per pool     desired[role]                                               None: never read from Redis
    ->           RoundPlan(promote, remove, drain, start, flip, turn)

A worker is removed (its actor killed) only when it is gone or frozen, never because it is busy:
its pings run on their own lane (cluster/actors.py), so a healthy worker answers however many
streams it runs.

    dead                              a call failed with an actor error: it is gone   remove now
                                      ("failed to start" if it never answered: cluster/start_failures.py)
    starting, never answered, age_s > start_timeout_s                                  remove
    up, silent_s > unresponsive_s     no ping answered for that long: frozen           remove
    draining                          only once idle() says True (or it is dead);
                                      silence or a slow idle() never kills a drain
    flipping                          never removed but dead; once idle, turned in place

A flip (cluster/actors.py PDActor.flip) is a drain that ends in a role switch instead of a
kill: the weights stay loaded. When the prefill pool is long and the decode pool short (or the
reverse), an up worker of the long one flips rather than one draining and another starting.
A flipping worker counts in the pool it is flipping to.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from engine.roles import FLIPPABLE, ROLES

State = Literal["starting", "up", "draining", "flipping"]


@dataclass(frozen=True)
class Limits:
    start_timeout_s: float = 180.0  # model load and first ping, however slow the node
    unresponsive_s: float = 30.0  # sustained silence on the health lane before a kill

    def __post_init__(self) -> None:
        if not (self.start_timeout_s > 0 and self.unresponsive_s > 0):
            raise ValueError(f"limits must be > 0, got {self}")


@dataclass(frozen=True)
class WorkerHealth:
    """What the last probes said about one worker."""

    worker_id: str
    role: str
    state: State
    age_s: float  # since its actor was started
    silent_s: float | None  # since its last answered ping; None: it never answered one
    dead: bool = False  # a ping, idle() or drain() failed with an actor error
    idle: bool = False  # draining or flipping, and idle() answered True
    flip_to: str = ""  # flipping: the role it turns into


@dataclass(frozen=True)
class Removal:
    worker_id: str
    reason: str  # died | failed to start | did not start | unresponsive | drained


@dataclass(frozen=True)
class RoundPlan:
    promote: tuple[str, ...] = ()  # starting -> up: answered its first ping
    remove: tuple[Removal, ...] = ()
    drain: tuple[str, ...] = ()
    start: tuple[str, ...] = ()  # one role per worker to start
    flip: tuple[tuple[str, str], ...] = ()  # (worker id, role): up workers to drain and turn
    turn: tuple[str, ...] = ()  # flipping workers now idle: switch their role


def removal(w: WorkerHealth, limits: Limits) -> Removal | None:
    """Why `w` must go now, or None: see the table in the module docstring."""
    if w.dead:
        return Removal(w.worker_id, "died" if w.silent_s is not None else "failed to start")
    if w.state == "draining":
        return Removal(w.worker_id, "drained") if w.idle else None
    if w.state == "flipping":
        return None
    if w.silent_s is None:
        return Removal(w.worker_id, "did not start") if w.age_s > limits.start_timeout_s else None
    if w.state == "up" and w.silent_s > limits.unresponsive_s:
        return Removal(w.worker_id, "unresponsive")
    return None


def decide(workers: Sequence[WorkerHealth], desired: Mapping[str, int] | None, limits: Limits) -> RoundPlan:
    """Removals first, then each pool brought to its desired size among the workers left.

    A pool that is short starts workers; one that is long drains the workers that were
    starting, then the newest, except that a prefill or decode worker that is up flips to the
    other of the two where that one is short. `desired=None` (sizes never known) changes no
    pool size."""
    removals = tuple(r for r in (removal(w, limits) for w in workers) if r is not None)
    gone = {r.worker_id for r in removals}
    left = [w for w in workers if w.worker_id not in gone]
    promote = tuple(w.worker_id for w in left if w.state == "starting" and w.silent_s is not None)
    turn = tuple(w.worker_id for w in left if w.state == "flipping" and w.idle)
    if desired is None:
        return RoundPlan(promote=promote, remove=removals, turn=turn)
    drain: list[WorkerHealth] = []
    start: list[str] = []
    for role in sorted(ROLES):
        want = desired.get(role, 0)
        active = [w for w in left if (w.flip_to or w.role) == role and w.state != "draining"]
        start += [role] * (want - len(active))
        if len(active) > want:
            answered = set(promote)
            stays = [w for w in active if w.state != "flipping"]  # a flip in progress is not undone
            victims = sorted(stays, key=lambda w: (w.state == "up" or w.worker_id in answered, w.age_s))
            drain += victims[: len(active) - want]
    flip: list[tuple[str, str]] = []
    for w in [w for w in drain if w.state == "up" and w.role in FLIPPABLE]:
        if (to := next((r for r in start if r in FLIPPABLE and r != w.role), None)) is not None:
            start.remove(to)
            drain.remove(w)
            flip.append((w.worker_id, to))
    return RoundPlan(promote, removals, tuple(w.worker_id for w in drain), tuple(start), tuple(flip), turn)
