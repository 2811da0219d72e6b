"""The pool manager's decisions (cluster.pool_plan): who is promoted, removed, drained, started;
and how a restarted manager adopts the workers it finds (cluster.worker_actors.adopted)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from cluster.pool_plan import Limits, Removal, RoundPlan, WorkerHealth, decide
from cluster.worker_actors import adopted

LIMITS = Limits(start_timeout_s=180, unresponsive_s=30)


def up(wid: str, role: str = "decode", age_s: float = 100, silent_s: float = 0.5, **kw: bool) -> WorkerHealth:
    return WorkerHealth(wid, role, "up", age_s, silent_s, **kw)


def starting(wid: str, role: str = "decode", age_s: float = 5, silent_s: float | None = None) -> WorkerHealth:
    return WorkerHealth(wid, role, "starting", age_s, silent_s)


def draining(wid: str, role: str = "decode", silent_s: float | None = 0.5, **kw: bool) -> WorkerHealth:
    return WorkerHealth(wid, role, "draining", 100, silent_s, **kw)


def test_steady_pools_change_nothing() -> None:
    workers = [up("p0", "prefill"), up("d0"), up("d1")]
    assert decide(workers, {"prefill": 1, "decode": 2}, LIMITS) == RoundPlan()


def test_a_busy_worker_that_answers_slowly_is_never_removed() -> None:
    # 29 s without an answer is under the limit: nothing happens, however many rounds it takes
    assert decide([up("d0", silent_s=29.9)], {"decode": 1}, LIMITS) == RoundPlan()


def test_only_sustained_silence_or_death_removes_an_up_worker() -> None:
    plan = decide([up("d0", silent_s=30.5), up("d1", dead=True), up("d2")], {"decode": 3}, LIMITS)
    assert plan.remove == (Removal("d0", "unresponsive"), Removal("d1", "died"))
    assert plan.start == ("decode", "decode")  # replaced in the same round


def test_a_dead_worker_is_replaced_at_once_whatever_its_state() -> None:
    workers = [starting("d0", age_s=1, silent_s=None), draining("d1", dead=True)]
    plan = decide([*workers, up("p0", "prefill", dead=True)], {"decode": 1, "prefill": 1}, LIMITS)
    assert plan.remove == (Removal("d1", "died"), Removal("p0", "died"))
    assert plan.start == ("prefill",)  # d0 is still loading and counts for the decode pool


def test_a_drain_ends_only_on_an_idle_answer() -> None:
    never_answering = draining("d0", silent_s=10_000)
    busy = draining("d1", idle=False)
    done = draining("d2", idle=True)
    plan = decide([never_answering, busy, done, up("d3")], {"decode": 1}, LIMITS)
    assert plan.remove == (Removal("d2", "drained"),)
    assert plan.drain == () and plan.start == ()


def test_starting_workers_are_promoted_on_their_first_answer_or_removed_after_the_start_timeout() -> None:
    plan = decide([starting("d0", silent_s=0.1), starting("d1", age_s=181)], {"decode": 2}, LIMITS)
    assert plan.promote == ("d0",)
    assert plan.remove == (Removal("d1", "did not start"),)
    assert plan.start == ("decode",)
    assert decide([starting("d0", age_s=179)], {"decode": 1}, LIMITS) == RoundPlan()


def test_a_long_pool_drains_starting_workers_then_the_newest() -> None:
    workers = [up("d0", age_s=300), up("d1", age_s=50), starting("d2", age_s=2), up("d3", age_s=100)]
    assert decide(workers, {"decode": 2}, LIMITS).drain == ("d2", "d1")
    assert decide(workers, {"decode": 0}, LIMITS).drain == ("d2", "d1", "d3", "d0")


def test_roles_missing_from_desired_are_drained_and_draining_workers_do_not_count() -> None:
    plan = decide([up("c0", "colocated"), draining("d0"), up("d1")], {"decode": 2}, LIMITS)
    assert plan.drain == ("c0",)
    assert plan.start == ("decode",)


def test_unknown_sizes_change_no_pool_but_health_still_counts() -> None:
    plan = decide([up("d0"), up("d1", dead=True), starting("d2", silent_s=0.2)], None, LIMITS)
    assert plan == RoundPlan(promote=("d2",), remove=(Removal("d1", "died"),))


@pytest.mark.parametrize("bad", [dict(start_timeout_s=0), dict(unresponsive_s=-1)])
def test_limits_are_validated(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Limits(**bad)


def flipping(
    wid: str, role: str, to: str, idle: bool = False, silent_s: float = 0.5, dead: bool = False
) -> WorkerHealth:
    return WorkerHealth(wid, role, "flipping", 100, silent_s, dead=dead, idle=idle, flip_to=to)


def test_a_long_pool_flips_an_up_worker_to_the_short_one_instead_of_a_drain_and_a_start() -> None:
    workers = [up("p0", "prefill", age_s=50), up("p1", "prefill", age_s=10), up("d0")]
    plan = decide(workers, {"prefill": 1, "decode": 2}, LIMITS)
    assert plan.flip == (("p1", "decode"),)  # the newest, as a drain would pick
    assert plan.drain == () and plan.start == ()
    two = decide([*workers, up("p2", "prefill", age_s=5)], {"prefill": 1, "decode": 2}, LIMITS)
    assert two.flip == (("p2", "decode"),) and two.drain == ("p1",), "one flip covers the one short worker"


def test_only_an_up_prefill_or_decode_worker_flips() -> None:
    plan = decide([starting("p0", "prefill"), up("p1", "prefill"), up("d0")], {"prefill": 1, "decode": 2}, LIMITS)
    assert plan.drain == ("p0",) and plan.start == ("decode",), "a loading worker is dropped, not flipped"
    plan = decide([up("c0", "colocated"), up("d0")], {"colocated": 0, "decode": 2}, LIMITS)
    assert plan.flip == () and plan.drain == ("c0",) and plan.start == ("decode",)


def test_a_flipping_worker_counts_in_its_new_pool_is_never_removed_and_turns_once_idle() -> None:
    busy = flipping("p0", "prefill", "decode", silent_s=10_000)
    plan = decide([busy, up("d0"), up("p1", "prefill")], {"prefill": 1, "decode": 2}, LIMITS)
    assert plan == RoundPlan(), "nothing starts for the pool it is flipping to, nothing drains it"
    done = flipping("p0", "prefill", "decode", idle=True)
    assert decide([done, up("d0"), up("p1", "prefill")], {"prefill": 1, "decode": 2}, LIMITS).turn == ("p0",)
    dead = flipping("p0", "prefill", "decode", dead=True)
    plan = decide([dead, up("d0"), up("p1", "prefill")], {"prefill": 1, "decode": 2}, LIMITS)
    assert plan.remove == (Removal("p0", "died"),) and plan.start == ("decode",)
    plan = decide([busy, up("d0"), up("d1", age_s=10), up("p1", "prefill")], {"prefill": 1, "decode": 2}, LIMITS)
    assert plan.drain == ("d1",), "a long pool drains an up worker, never the flip under way"


def test_a_restarted_manager_adopts_each_worker_as_it_answers() -> None:
    """cluster.worker_actors.adopted: the worker's own word on its role (a flipped worker's id
    keeps its first role's initial) and on draining; no answer: starting, in the role its id names."""
    flipped = adopted("p3-123", "h", {"role": "decode", "draining": False, "pid": 9})
    assert (flipped.worker_id, flipped.role, flipped.state, flipped.handle) == ("p3-123", "decode", "up", "h")
    assert adopted("d0-5", "h", {"role": "decode", "draining": True}).state == "draining"
    assert adopted("d0-5", "h", {"role": "decode", "draining": True, "flip_to": ""}).state == "draining"
    turning = adopted("d0-5", "h", {"role": "decode", "draining": True, "flip_to": "prefill"})
    assert (turning.role, turning.state, turning.flip_to) == ("decode", "flipping", "prefill"), "the flip goes on"
    done = adopted("d0-5", "h", {"role": "prefill", "draining": False, "flip_to": ""})
    assert (done.role, done.state, done.flip_to) == ("prefill", "up", "")
    silent = adopted("c1-7", "h", {})
    assert (silent.role, silent.state) == ("colocated", "starting")
    assert decide([starting("c1-7", "colocated", silent_s=0.2)], {"colocated": 1}, LIMITS).promote == ("c1-7",)


def test_the_pool_manager_imports_no_engine() -> None:
    """It starts the workers' actors from their classes alone: the engine and torch load in the
    workers (its imports took 2.1 s with them, 0.4 s without, on the start's critical path)."""
    code = "import cluster.pool_manager, sys; assert not {'torch', 'engine.engine'} & set(sys.modules), sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])
