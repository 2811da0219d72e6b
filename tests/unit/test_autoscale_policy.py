"""planner.autoscale.decide as a pure function: steps toward the plan, bounds, cooldown, and
hysteresis on the way down."""

from __future__ import annotations

from dataclasses import replace

import pytest

from planner.autoscale import Bounds, Memory, Window, decide

GOOD = Window(60, 120, 1.0, 1.0)
SLOW_DECODE = Window(60, 120, 0.98, 0.6)
PD = {"prefill": 1, "decode": 1, "colocated": 0}
BOUNDS = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 4, "decode": 4}, max_step=1, cooldown_s=60)


def test_steps_toward_the_plan_by_at_most_max_step() -> None:
    d, mem = decide(0, PD, {"prefill": 1, "decode": 4}, GOOD, BOUNDS, Memory())
    assert d.changed and d.sizes == {"prefill": 1, "decode": 2, "colocated": 0}
    assert mem.last_change_s == 0
    assert any("decode: 1 -> 2" in r for r in d.reasons)
    wide = Bounds(max={"decode": 8}, max_step=4)
    assert decide(0, PD, {"prefill": 1, "decode": 8}, GOOD, wide, Memory())[0].sizes["decode"] == 5


def test_bounds_clamp_the_plan() -> None:
    d, _ = decide(0, {"prefill": 4, "decode": 4, "colocated": 0}, {"prefill": 9, "decode": 9}, GOOD, BOUNDS, Memory())
    assert not d.changed and d.sizes == {"prefill": 4, "decode": 4, "colocated": 0}
    with pytest.raises(ValueError):
        Bounds(min={"decode": 3}, max={"decode": 2})
    with pytest.raises(ValueError):
        Bounds(max_step=0)


def test_cooldown_holds_a_change() -> None:
    _, mem = decide(0, PD, {"prefill": 1, "decode": 3}, GOOD, BOUNDS, Memory())
    after = {"prefill": 1, "decode": 2, "colocated": 0}
    d, mem2 = decide(30, after, {"prefill": 1, "decode": 3}, GOOD, BOUNDS, mem)
    assert not d.changed and d.held and d.sizes == after
    assert any("cooldown: 30 s left" in r for r in d.reasons)
    assert mem2.last_change_s == 0
    d, _ = decide(61, after, {"prefill": 1, "decode": 3}, GOOD, BOUNDS, mem2)
    assert d.changed and d.sizes["decode"] == 3


def test_down_only_after_several_lower_windows() -> None:
    big = {"prefill": 2, "decode": 3, "colocated": 0}
    plan = {"prefill": 2, "decode": 1}
    mem = Memory()
    for n in (1, 2):
        d, mem = decide(1000 + n, big, plan, GOOD, BOUNDS, mem)
        assert not d.changed
        assert any(f"planned 1 for {n} of 3 windows" in r for r in d.reasons)
    d, mem = decide(1003, big, plan, GOOD, BOUNDS, mem)
    assert d.changed and d.sizes["decode"] == 2
    assert mem.lower_in_a_row["decode"] == 0  # the count starts again after a step
    # a window that plans no lower resets the count
    d, mem = decide(2000, {**big, "decode": 2}, {"prefill": 2, "decode": 2}, GOOD, BOUNDS, mem)
    assert mem.lower_in_a_row["decode"] == 0


def test_never_down_while_attainment_is_missed() -> None:
    mem = Memory(lower_in_a_row={"decode": 5})
    slow_first = Window(60, 120, 0.5, 1.0)
    current = {"prefill": 1, "decode": 3, "colocated": 0}
    d, _ = decide(0, current, {"prefill": 1, "decode": 1}, slow_first, BOUNDS, mem)
    assert d.sizes == {"prefill": 2, "decode": 3, "colocated": 0}  # prefill +1 for TTFT; decode held
    assert any("decode: hold at 3, not 1: attainment is under target" in r for r in d.reasons)


def test_a_missed_slo_adds_to_its_pool_when_the_plan_asks_no_more() -> None:
    d, _ = decide(0, PD, PD, SLOW_DECODE, BOUNDS, Memory())
    assert d.changed and d.sizes == {"prefill": 1, "decode": 2, "colocated": 0}
    assert any("decode: +1, its SLO is missed" in r for r in d.reasons)
    slow_first = Window(60, 50, 0.5, 1.0)
    d, _ = decide(0, PD, None, slow_first, BOUNDS, Memory())  # no profile: attainment alone
    assert d.sizes["prefill"] == 2
    assert any("no profile" in r for r in d.reasons)
    colo = {"prefill": 0, "decode": 0, "colocated": 1}
    d, _ = decide(0, colo, None, slow_first, Bounds(max={"colocated": 2}), Memory())
    assert d.sizes["colocated"] == 2


def test_an_idle_window_changes_nothing_without_a_plan() -> None:
    d, _ = decide(0, PD, None, Window(60, 0, 1.0, 1.0), BOUNDS, Memory())
    assert not d.changed and not d.held
    assert not decide(0, PD, PD, GOOD, BOUNDS, Memory())[0].held  # the plan is what runs: nothing held


def test_the_reasons_say_why_there_is_no_plan() -> None:
    d, _ = decide(0, PD, None, SLOW_DECODE, BOUNDS, Memory(), unplanned="no size the planner can reach meets it")
    assert "no size the planner can reach meets it: attainment alone decides" in d.reasons
    assert d.changed and d.sizes["decode"] == 2


def test_on_fixed_hardware_a_pool_grows_by_taking_a_worker_from_the_other() -> None:
    fixed = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 2, "decode": 2}, max_pd=3, cooldown_s=60)
    two_p = {"prefill": 2, "decode": 1, "colocated": 0}
    d, _ = decide(0, two_p, None, SLOW_DECODE, fixed, Memory())
    assert d.changed and d.sizes == {"prefill": 1, "decode": 2, "colocated": 0}, "one prefill worker flips"
    assert any("a worker flips to decode" in r for r in d.reasons)
    slow_both = Window(60, 120, 0.5, 0.5)
    d, _ = decide(0, two_p, None, slow_both, fixed, Memory())
    assert not d.changed and d.held, "a pool whose own SLO is missed gives nothing"
    assert any("decode: held at 1" in r for r in d.reasons)
    assert not any(r.startswith("decode: 1 -> 2") for r in d.reasons), "no step line for the growth held back"
    one_p = {"prefill": 1, "decode": 2, "colocated": 0}
    slow_first = Window(60, 120, 0.5, 1.0)
    d, _ = decide(0, one_p, None, slow_first, fixed, Memory())
    assert d.sizes == {"prefill": 2, "decode": 1, "colocated": 0}, "and back, with no down_after wait"
    d, _ = decide(0, {"prefill": 1, "decode": 1, "colocated": 0}, None, SLOW_DECODE, fixed, Memory())
    assert d.sizes["decode"] == 2, "under the limit a pool simply grows"
    d, _ = decide(0, one_p, None, SLOW_DECODE, fixed, Memory())
    assert not d.changed, "decode is at its max"
    d, _ = decide(0, two_p, {"prefill": 1, "decode": 2}, GOOD, fixed, Memory())
    assert d.sizes == {"prefill": 1, "decode": 2, "colocated": 0}, "a plan that trades a worker does so at once"


def test_a_flipped_worker_flips_back_only_after_down_after_windows_in_a_row() -> None:
    fixed = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 2, "decode": 2}, max_pd=3, cooldown_s=10,
                   down_after=3)  # fmt: skip
    slow_first = Window(5, 8, 0.75, 1.0)  # two late first tokens of 8
    d, mem = decide(0, {"prefill": 2, "decode": 1, "colocated": 0}, None, SLOW_DECODE, fixed, Memory())
    assert d.sizes == {"prefill": 1, "decode": 2, "colocated": 0} and mem.flipped_to == "decode"
    sizes = d.sizes
    for t, back in ((15, 1), (20, 2)):  # past the cooldown: only the flip-back rule holds it
        d, mem = decide(t, sizes, None, slow_first, fixed, mem)
        assert not d.changed and mem.back_in_a_row == back, t
        assert any(f"prefill: held at 1: a worker flipped to decode at the last change; back after 3 windows in a "
                   f"row ask ({back} so far)" in r for r in d.reasons)  # fmt: skip
    d, mem = decide(25, sizes, None, GOOD, fixed, mem)
    assert not d.changed and mem.back_in_a_row == 0, "a window that asks nothing starts the count again"
    for t in (30, 35):
        d, mem = decide(t, sizes, None, slow_first, fixed, mem)
        assert not d.changed
    d, mem = decide(40, sizes, None, slow_first, fixed, mem)
    assert d.sizes == {"prefill": 2, "decode": 1, "colocated": 0}, "the third window in a row flips it back"
    assert mem.flipped_to == "prefill" and mem.back_in_a_row == 0 and mem.last_change_s == 40
    d, mem = decide(45, d.sizes, None, SLOW_DECODE, fixed, mem)
    assert not d.changed and mem.back_in_a_row == 1, "and the same holds the other way"


def test_one_late_request_of_a_small_window_is_not_a_missed_slo() -> None:
    fixed = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 2, "decode": 2}, max_pd=3, cooldown_s=10)
    two_p = {"prefill": 2, "decode": 1, "colocated": 0}
    d, mem = decide(0, two_p, None, Window(5, 5, 1.0, 0.8), fixed, Memory())  # one late request of 5: 80%
    assert not d.changed and d.sizes == two_p and mem == Memory(None, {r: 0 for r in two_p}), d.reasons
    assert "TPOT: 1 of 5 requests missed it, fewer than the 2 that count" in d.reasons
    d, _ = decide(0, two_p, None, Window(5, 5, 1.0, 0.6), fixed, Memory())  # two of 5
    assert d.sizes == {"prefill": 1, "decode": 2, "colocated": 0}, d.reasons
    d, _ = decide(0, two_p, None, Window(5, 5, 1.0, 0.8), replace(fixed, min_misses=1), Memory())
    assert d.sizes == {"prefill": 1, "decode": 2, "colocated": 0}, "min_misses=1: any miss under target counts"
    with pytest.raises(ValueError):
        Bounds(min_misses=0)
