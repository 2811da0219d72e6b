"""Workers that die before they answer their first ping, per role: why, how many in a row, and
when the pool manager may start the next one.

A worker whose engine cannot be built (a kernel this CPU lacks, a broken model file, a device
torch cannot see) dies in its actor's constructor, and its replacement dies the same way. Before
this, the pool manager started one every round (78 in 3 minutes, measured) while `tandem serve`
waited its 180 s for pools that could not come up and then printed a traceback. Now a role's
starts back off after failures in a row (BACKOFF_S), and the reason travels in ManagerStatus,
so that Cluster.wait_ready stops at once with it (GIVE_UP_AFTER failures, none of the role up).
A worker of the role coming up clears its count: a transient failure (a node short of memory
for a moment) costs one backoff, not the pool.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)  # before the next start after 1, 2, 3 ... failures in a row
GIVE_UP_AFTER = 2  # failures in a row, with none of the role up: wait_ready reports it
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?(\w+(?:Error|Exception)): (.+)$")
_RAY_WRAPPERS = {"RayActorError", "ActorDiedError", "RayTaskError"}


@dataclass(frozen=True)
class StartFailure:
    role: str
    count: int  # in a row, since a worker of the role last came up
    reason: str  # the last one's, e.g. "ValueError: prefill_attention 'int8' is not available ..."
    at: float  # when the last was seen (monotonic)

    def backoff_s(self) -> float:
        return BACKOFF_S[min(self.count, len(BACKOFF_S)) - 1]


class StartFailures:
    """The pool manager's count, read and written by its rounds only (they never overlap)."""

    def __init__(self) -> None:
        self._by_role: dict[str, StartFailure] = {}

    def failed(self, role: str, reason: str, now: float) -> StartFailure:
        last = self._by_role.get(role)
        why = reason or "it died before its first answer"
        self._by_role[role] = f = StartFailure(role, (last.count if last else 0) + 1, why, now)
        return f

    def came_up(self, role: str) -> None:
        self._by_role.pop(role, None)

    def may_start(self, role: str, now: float) -> bool:
        f = self._by_role.get(role)
        return f is None or now >= f.at + f.backoff_s()

    def snapshot(self) -> tuple[StartFailure, ...]:
        return tuple(self._by_role[r] for r in sorted(self._by_role))


def death_reason(error: BaseException) -> str:
    """What killed an actor, in one line: the innermost exception that Ray's error text carries
    (a constructor's ValueError, say), else the text's first line."""
    text = str(error)
    for line in reversed(text.splitlines()):
        m = _EXCEPTION_LINE.match(line.strip())
        if m and m.group(1) not in _RAY_WRAPPERS:
            return f"{m.group(1)}: {m.group(2)}"[:500]
    first = text.strip().splitlines()[0] if text.strip() else ""
    return f"{type(error).__name__}: {first}"[:500]


class WorkersCannotStart(RuntimeError):
    """A pool's workers keep dying before they answer: Cluster.wait_ready gives up at once."""

    def __init__(self, role: str, count: int, reason: str) -> None:
        tries = f" ({count} in a row)" if count else ""  # 0: refused before any start
        super().__init__(f"{role} workers fail to start{tries}: {reason}")
        self.role, self.count, self.reason = role, count, reason
