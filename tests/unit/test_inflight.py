"""The router's in-flight ledger: exact counts after every operation, integrity checked each time."""

from __future__ import annotations

import pytest

from cluster.inflight import DEFAULT_PREFILL_S_PER_TOKEN, RECENT_S, InflightLedger, WorkerLoad


def test_begin_prefilled_end_counts_exactly() -> None:
    led = InflightLedger()
    led.begin("a", "d1", "p1", blocks=5, prefill_tokens=70)
    led.check_integrity()
    led.begin("b", "d1", None, blocks=2, prefill_tokens=99)  # whole on d1 (local, colocated): it prefills there
    led.check_integrity()
    assert led.load("d1") == WorkerLoad(streams=2, blocks=7, prefill_tokens=99)
    assert led.load("p1").prefill_tokens == 70
    led.prefilled("b")  # its first token: out of d1's queue, no time to learn from
    led.check_integrity()
    assert led.load("d1") == WorkerLoad(streams=2, blocks=7)
    with pytest.raises(ValueError):
        led.begin("a", "d2", "p1", 1, 1)
    led.prefilled("a", uncached_tokens=70, seconds=0.7)
    led.check_integrity()
    assert led.load("p1").prefill_tokens == 0
    assert led.load("p1").prefill_s_per_token == pytest.approx(0.8 * DEFAULT_PREFILL_S_PER_TOKEN + 0.2 * 0.01)
    # an unmeasured worker is assumed to cost the measured average
    assert led.load("p9").prefill_s_per_token == led.load("p1").prefill_s_per_token
    led.prefilled("a", 70, 0.7)  # twice: no double count
    led.end("a")
    led.end("a")
    led.end("never")
    led.check_integrity()
    assert led.load("d1") == WorkerLoad(streams=1, blocks=2, prefill_s_per_token=led.load("d1").prefill_s_per_token)
    led.end("b")
    led.check_integrity()
    assert len(led) == 0


def test_end_before_prefill_takes_the_queued_tokens_back() -> None:
    led = InflightLedger()
    led.begin("a", "d1", "p1", 3, 50)
    led.end("a")
    led.check_integrity()
    assert led.load("p1").prefill_tokens == 0 and led.load("d1").streams == 0


def test_reconcile_forgets_workers_that_left() -> None:
    led = InflightLedger()
    led.begin("a", "d1", "p1", 3, 50)
    led.begin("b", "d2", "p1", 3, 50)
    led.begin("c", "d2", "p2", 3, 50)
    assert sorted(led.reconcile({"d2", "p1", "p2"})) == ["a"]
    led.check_integrity()
    assert sorted(led.reconcile({"d2", "p1"})) == ["c"]
    led.check_integrity()
    assert led.load("d2").streams == 1 and led.load("p1").prefill_tokens == 50


def test_a_hold_counts_until_begin_takes_it_over_or_it_lapses() -> None:
    now = [0.0]
    led = InflightLedger(clock=lambda: now[0])
    led.hold("d1", "p1", 4, 30)
    led.hold("d1", "p1", 4, 30)
    led.check_integrity()
    assert led.load("d1").streams == 2 and led.load("p1").prefill_tokens == 60 and led.num_holds == 2
    led.begin("a", "d1", "p1", 5, 31)  # takes one hold over: counted once, with its own figures
    led.check_integrity()
    assert led.load("d1") == WorkerLoad(streams=2, blocks=9, prefill_tokens=0)
    assert led.load("p1").prefill_tokens == 61 and led.num_holds == 1
    led.begin("b", "d2", "p1", 5, 31)  # other workers: the remaining hold stays
    assert led.num_holds == 1
    now[0] = 5.0  # HOLD_S later the unused hold lapses
    assert led.load("d1").streams == 1 and led.num_holds == 0
    led.check_integrity()
    led.end("a")
    led.end("b")
    led.check_integrity()
    assert led.load("d1").streams == led.load("d2").streams == led.load("p1").prefill_tokens == 0


def test_a_burst_routed_before_any_start_still_splits_evenly() -> None:
    from cluster.routing import plan_route
    from cluster.worker_view import WorkerView

    led = InflightLedger()
    routes = []
    for _ in range(32):  # every request is routed before the first one starts
        loads = led.loads(["d1", "d2", "p1"])
        views = [WorkerView(d, "decode", free_blocks=100, num_blocks=100, load=loads[d]) for d in ("d1", "d2")]
        route = plan_route([*views, WorkerView("p1", "prefill", load=loads["p1"])], {}, 40, 24, 16)
        assert route is not None
        led.hold(route.decode, route.prefill, 4, 40)
        routes.append(route)
    for i, r in enumerate(routes):
        led.begin(f"r{i}", r.decode, r.prefill, 4, 40)
    led.check_integrity()
    assert led.load("d1").streams == led.load("d2").streams == 16 and led.num_holds == 0


def test_longest_prefill_is_a_sliding_window_maximum() -> None:
    """`longest_prefill_s` is the longest prefill a worker ran in the last RECENT_S: what a step
    there may stall the streams it decodes for (the spill route's guard)."""
    now = [0.0]
    led = InflightLedger(clock=lambda: now[0])
    for i, (at, seconds) in enumerate(((0.0, 0.2), (10.0, 5.0), (20.0, 0.3), (30.0, 0.1))):
        now[0] = at
        led.begin(f"r{i}", "d1", "p1", 1, 100)
        led.prefilled(f"r{i}", 100, seconds)
        led.end(f"r{i}")
        led.check_integrity()
    assert led.load("p1").longest_prefill_s == 5.0
    assert led.load("d1").longest_prefill_s == 0.0
    now[0] = 10.0 + RECENT_S  # the 5 s prefill leaves the window; the 0.3 s one is the longest left
    assert led.load("p1").longest_prefill_s == 0.3
    now[0] = 30.0 + RECENT_S
    assert led.load("p1").longest_prefill_s == 0.0
    led.reconcile({"d1"})
    assert led.load("p1").longest_prefill_s == 0.0
