"""The autoscaler's policy: from the router's last window and the planner's sizes to the pool
sizes to set now, with the reasons. Plain values in and out: no clock, no Ray, no Redis.

    planned    the sizes the planner finds meeting the SLOs for the window's traffic (or None:
               no profile to plan with, or no size within its reach meets them, so only the
               window's attainment speaks; `unplanned` says which)
    step       each pool moves toward its planned size by at most `max_step` a decision,
               within [min, max] of its role
    up         at once, when the plan asks for more, or when attainment is under target and
               the plan asks for no change: one more of the pool whose SLO is missed (TTFT:
               prefill, or colocated; TPOT: decode, or colocated)
    down       only after `down_after` windows in a row all planned lower, and never while
               attainment is under target (hysteresis: a dip in traffic does not shed workers)
    cooldown   no change within `cooldown_s` of the last one (a new worker needs time to load
               and to show in the window)
    evidence   an SLO counts as missed only where at least `min_misses` of the window's requests
               missed it: in a window of fewer than 10 requests, one late request is under 90%
               by itself (a load step on a 2-core machine flipped a worker on one late request
               of 5, and the flip made the next windows worse)
    trade      with `max_pd` (fixed hardware: prefill + decode at most that many), a pool
               grows by taking a worker from the other, whose SLO must be met and which must
               stay within its min; the pool manager then flips that worker in place. The
               giving pool does not wait out `down_after`: capacity moves, none is shed. But
               a worker flips back to the pool it just left only after `down_after` windows
               in a row ask for it: windows of a few requests miss one SLO and then the other
               by chance (one late request of 8 is 88%), and each flip costs a drain (a load
               step on a 2-core machine flipped one worker three times in 20 s).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from engine.roles import ROLES


@dataclass(frozen=True)
class Bounds:
    min: Mapping[str, int] = field(default_factory=dict)  # per role; default 0
    max: Mapping[str, int] = field(default_factory=dict)  # per role; default: no limit
    max_step: int = 1
    cooldown_s: float = 60.0
    down_after: int = 3  # windows in a row that plan lower before a pool shrinks
    target: float = 0.9  # attainment the SLOs ask for
    max_pd: int | None = None  # prefill + decode workers at most (None: no limit)
    min_misses: int = 2  # requests of a window that must miss an SLO for it to count as missed

    def __post_init__(self) -> None:
        if (self.max_step < 1 or self.cooldown_s < 0 or self.down_after < 1 or not 0 < self.target <= 1
                or self.min_misses < 1):  # fmt: skip
            raise ValueError(f"bad autoscaler bounds: {self}")
        for role, lo in self.min.items():
            if lo < 0 or lo > self.max.get(role, lo):
                raise ValueError(f"bounds for {role}: need 0 <= min <= max, got {lo}..{self.max.get(role)}")

    def clamp(self, role: str, n: int) -> int:
        return max(self.min.get(role, 0), min(n, self.max.get(role, n)))


@dataclass(frozen=True)
class Host:
    """The one machine every worker runs on (`tandem serve` without --join): its cores, each
    worker's threads, and whether idle workers lend theirs (engine/core_ledger.py)."""

    cores: int
    threads: int
    lend: bool = True

    def __post_init__(self) -> None:
        if self.cores < 1 or self.threads < 1:
            raise ValueError(f"a host needs cores and threads >= 1, got {self.cores} and {self.threads}")

    @property
    def room(self) -> int:
        """The workers it runs without oversubscribing its cores: more share the same cores."""
        return max(1, self.cores // self.threads)


def fit_bounds(bounds: Bounds, host: Host) -> tuple[Bounds, tuple[str, ...]]:
    """The bounds as `host`'s cores hold them, where every worker runs on it: prefill + decode at
    most `host.room` workers (as `pd=N` says for fixed hardware) unless the operator gave `pd=N`,
    and colocated at most `host.room`; more workers would only share the same cores. Never
    below the bounds' own minimums. Returns the bounds and what changed, in words."""
    said = []
    lo, hi = bounds.min, dict(bounds.max)
    max_pd = bounds.max_pd
    pd_most = hi.get("prefill", host.room + 1) + hi.get("decode", host.room + 1)  # a missing max: no limit
    if max_pd is None and ("prefill" in hi or "decode" in hi) and pd_most > host.room:
        max_pd = max(host.room, lo.get("prefill", 0) + lo.get("decode", 0), 2)
        said.append(f"prefill + decode at most {max_pd} (pd={max_pd}; give pd=N to set another)")
    if "colocated" in hi and hi["colocated"] > host.room:
        hi["colocated"] = max(host.room, lo.get("colocated", 0))
        said.append(f"colocated at most {hi['colocated']}")
    return replace(bounds, max=hi, max_pd=max_pd), tuple(said)


@dataclass(frozen=True)
class Window:
    """What the router saw over the last interval."""

    seconds: float
    requests: int
    ttft_attainment: float  # share of requests within the TTFT SLO (1.0 with no requests)
    tpot_attainment: float
    queue_depth: int = 0
    kv_usage: float = 0.0


@dataclass(frozen=True)
class Memory:
    """What the policy carries from one decision to the next."""

    last_change_s: float | None = None
    lower_in_a_row: Mapping[str, int] = field(default_factory=dict)
    flipped_to: str | None = None  # the pool a worker flipped to at the last change
    back_in_a_row: int = 0  # windows in a row that asked to flip a worker back out of it


@dataclass(frozen=True)
class Decision:
    sizes: Mapping[str, int]
    reasons: tuple[str, ...]
    changed: bool
    held: bool = False  # a change was wanted and not made (a hold, a held growth, the cooldown)


def decide(
    now_s: float,
    current: Mapping[str, int],
    planned: Mapping[str, int] | None,
    window: Window,
    bounds: Bounds,
    memory: Memory,
    unplanned: str = "no profile to plan with",
) -> tuple[Decision, Memory]:
    """The sizes to set now (see the module docstring), and the memory for the next call.
    `unplanned`: why `planned` is None, for the reasons."""
    missing = any(_missed(a, window, bounds) for a in (window.ttft_attainment, window.tpot_attainment))
    want = dict(planned) if planned is not None else dict(current)
    reasons = [_window_reason(window, bounds)]
    if planned is None:
        reasons.append(f"{unplanned}: attainment alone decides")
    for slo, a in (("TTFT", window.ttft_attainment), ("TPOT", window.tpot_attainment)):
        if a < bounds.target and not _missed(a, window, bounds):
            reasons.append(f"{slo}: {(1 - a) * window.requests:.0f} of {window.requests} requests missed it, "
                           f"fewer than the {bounds.min_misses} that count")  # fmt: skip
    if missing and all(want.get(r, 0) <= current.get(r, 0) for r in ROLES):
        for role in _short_roles(current, window, bounds):
            want[role] = current.get(role, 0) + 1
            reasons.append(f"{role}: +1, its SLO is missed and the plan asks no more")
    lower: dict[str, int] = {
        r: memory.lower_in_a_row.get(r, 0) + 1 if want.get(r, 0) < current.get(r, 0) else 0 for r in ROLES
    }
    sizes, held = dict(current), False
    for role in ROLES:
        have, goal = current.get(role, 0), bounds.clamp(role, want.get(role, 0))
        if goal == have:
            continue
        if goal < have and missing:
            reasons.append(f"{role}: hold at {have}, not {goal}: attainment is under target")
            held = True
            continue
        if goal < have and lower[role] < bounds.down_after:
            reasons.append(f"{role}: hold at {have}, planned {goal} for {lower[role]} of {bounds.down_after} windows")
            held = True
            continue
        step = max(-bounds.max_step, min(bounds.max_step, goal - have))
        sizes[role] = have + step
        reasons.append(f"{role}: {have} -> {have + step} (planned {want.get(role, 0)}, bounds "
                       f"{bounds.min.get(role, 0)}..{bounds.max.get(role, '-')})")  # fmt: skip
    back = 0
    if bounds.max_pd is not None:
        sizes.setdefault("prefill", 0)
        sizes.setdefault("decode", 0)
        short = _short_roles(current, window, bounds) if missing else []
        back, traded_held = _trade(sizes, current, short, bounds, memory, reasons)
        held = held or traded_held
    changed = sizes != dict(current)
    if changed and memory.last_change_s is not None and now_s - memory.last_change_s < bounds.cooldown_s:
        wait = bounds.cooldown_s - (now_s - memory.last_change_s)
        return Decision(dict(current), (*reasons, f"cooldown: {wait:.0f} s left, no change"), False, True), replace(
            memory, lower_in_a_row=lower, back_in_a_row=back
        )
    if changed:
        lower = {r: 0 if sizes[r] != current.get(r, 0) else lower[r] for r in ROLES}
        memory = Memory(now_s, lower, _flipped_to(sizes, current))
    else:
        memory = replace(memory, lower_in_a_row=lower, back_in_a_row=back)
    return Decision(sizes, tuple(reasons), changed, held), memory


def _trade(sizes: dict[str, int], current: Mapping[str, int], short: list[str], bounds: Bounds, memory: Memory,
           reasons: list[str]) -> tuple[int, bool]:  # fmt: skip
    """Keep prefill + decode within `bounds.max_pd` where a pool grows: the other gives a worker
    (one flips) if its SLO is met and it stays within its min, and, if a worker flipped to it at
    the last change, once `down_after` windows in a row asked; else the growth is held. Returns
    the windows in a row that asked to flip one back (0 if this one did not), and whether a
    growth was held."""
    assert bounds.max_pd is not None
    back, held = 0, False
    for grow, give in (("decode", "prefill"), ("prefill", "decode")):
        while (
            sizes.get(grow, 0) > current.get(grow, 0)
            and sizes.get("prefill", 0) + sizes.get("decode", 0) > bounds.max_pd
        ):
            can_give = (
                give not in short
                and sizes.get(give, 0) > bounds.min.get(give, 0)
                and sizes.get(give, 0) >= current.get(give, 0)
            )
            if can_give and give == memory.flipped_to:
                back = memory.back_in_a_row + 1
            if can_give and (give != memory.flipped_to or back >= bounds.down_after):
                sizes[give] -= 1
                reasons.append(f"{give}: {sizes[give] + 1} -> {sizes[give]}, a worker flips to {grow} "
                               f"(prefill + decode at most {bounds.max_pd})")  # fmt: skip
            elif can_give:
                sizes[grow] -= 1
                held = True
                reasons.append(f"{grow}: held at {sizes[grow]}: a worker flipped to {give} at the last change; "
                               f"back after {bounds.down_after} windows in a row ask ({back} so far)")  # fmt: skip
            else:
                sizes[grow] -= 1
                held = True
                reasons.append(f"{grow}: held at {sizes[grow]}, prefill + decode at most {bounds.max_pd} and "
                               f"{give} cannot give one")  # fmt: skip
    for role in ("prefill", "decode"):  # a growth held all the way back: its step line would read as made
        if sizes.get(role, 0) == current.get(role, 0):
            step = f"{role}: {current.get(role, 0)} -> "
            reasons[:] = [r for r in reasons if not r.startswith(step)]
    return back, held


def _flipped_to(sizes: Mapping[str, int], current: Mapping[str, int]) -> str | None:
    """The pool a worker moves to between `current` and `sizes` (one grows as the other shrinks)."""
    for to, away in (("decode", "prefill"), ("prefill", "decode")):
        if sizes.get(to, 0) > current.get(to, 0) and sizes.get(away, 0) < current.get(away, 0):
            return to
    return None


def _short_roles(current: Mapping[str, int], window: Window, bounds: Bounds) -> list[str]:
    """The pools whose SLO the window misses: TTFT -> prefill, TPOT -> decode; colocated for either."""
    if current.get("colocated", 0) and not current.get("prefill", 0):
        return ["colocated"]
    short = []
    if _missed(window.ttft_attainment, window, bounds):
        short.append("prefill")
    if _missed(window.tpot_attainment, window, bounds):
        short.append("decode")
    return short


def _missed(attainment: float, window: Window, bounds: Bounds) -> bool:
    """Under target, by at least `bounds.min_misses` requests of the window."""
    return attainment < bounds.target and (1.0 - attainment) * window.requests >= bounds.min_misses - 1e-9


def _window_reason(w: Window, bounds: Bounds) -> str:
    return (f"window {w.seconds:.0f} s: {w.requests} requests ({w.requests / max(w.seconds, 1e-9):.2f}/s), "
            f"TTFT attainment {w.ttft_attainment:.0%}, TPOT {w.tpot_attainment:.0%} (target {bounds.target:.0%}), "
            f"queue {w.queue_depth}, KV {w.kv_usage:.0%}")  # fmt: skip
