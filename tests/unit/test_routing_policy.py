"""The routing policy: pure functions over a snapshot of workers (no Ray, no Redis)."""

from __future__ import annotations

import pytest

from cluster.routing import (
    Route,
    RoutingPolicy,
    WorkerView,
    pick_colocated,
    pick_decode,
    pick_prefill,
    plan_route,
    retry_exclusions,
)


def w(worker_id: str, role: str, free: int = 100, running: int = 0, waiting: int = 0, **kw: bool) -> WorkerView:
    return WorkerView(worker_id, role, free_blocks=free, num_blocks=100, running=running, waiting=waiting, **kw)


def test_worker_view_of_heartbeat_info() -> None:
    v = WorkerView.of("d1", {"role": "decode", "free_blocks": 7, "num_blocks": 0, "running": 2, "draining": True})
    assert v == WorkerView("d1", "decode", free_blocks=7, num_blocks=1, running=2, waiting=0, draining=True)


def test_decode_by_free_blocks_then_batch_then_id() -> None:
    ws = [w("d1", "decode", free=50, running=1), w("d2", "decode", free=80, running=9), w("p1", "prefill", free=999)]
    assert pick_decode(ws, 10) == "d2"
    assert pick_decode(ws, 60) == "d2"
    assert pick_decode(ws, 81) is None
    assert pick_decode(ws, 10, exclude=frozenset({"d2"})) == "d1"
    tie = [w("d2", "decode", free=50, running=3), w("d1", "decode", free=50, running=3), w("d3", "decode", free=50)]
    assert pick_decode(tie, 1) == "d3"
    tie.pop()
    assert pick_decode(tie, 1) == "d1"


def test_decode_skips_unhealthy_and_draining() -> None:
    ws = [w("d1", "decode", free=99, draining=True), w("d2", "decode", free=98, healthy=False), w("d3", "decode", 5)]
    assert pick_decode(ws, 1) == "d3"
    assert pick_decode(ws[:2], 1) is None


def test_prefill_prefers_the_longest_cached_prefix() -> None:
    ws = [w("p1", "prefill", waiting=2), w("p2", "prefill"), w("p3", "prefill", running=1)]
    assert pick_prefill(ws, {}) == "p2"  # no cache anywhere: the shortest queue
    assert pick_prefill(ws, {"p1": 3, "p3": 2}) == "p1"
    assert pick_prefill(ws, {"p1": 3, "p3": 3}) == "p3"  # tie on the prefix: the shorter queue
    assert pick_prefill(ws, {"p1": 3}, exclude=frozenset({"p1"})) == "p2"


def test_prefill_overloaded_holder_loses_its_preference() -> None:
    ws = [w("p1", "prefill", waiting=8), w("p2", "prefill", waiting=1)]
    assert pick_prefill(ws, {"p1": 10}, overload_waiting=8) == "p2"
    assert pick_prefill(ws, {"p1": 10}, overload_waiting=9) == "p1"
    everyone_busy = [w("p1", "prefill", waiting=9), w("p2", "prefill", waiting=12)]
    assert pick_prefill(everyone_busy, {"p2": 4}, overload_waiting=8) == "p2"


def test_colocated_pool_is_picked_like_decode() -> None:
    ws = [w("c1", "colocated", free=10), w("c2", "colocated", free=40), w("d1", "decode", free=90)]
    assert pick_colocated(ws, 5) == "c2"
    assert pick_colocated(ws, 41) is None
    assert pick_colocated(ws, 5, exclude=frozenset({"c2"})) == "c1"


PD = [w("p1", "prefill"), w("p2", "prefill"), w("d1", "decode", free=20)]


def test_plan_route_decode_capacity_then_cached_prefill() -> None:
    # 100 prompt + 60 new tokens = 10 blocks of 16
    assert plan_route(PD, {"p2": 4}, 100, 60, 16) == Route(decode="d1", prefill="p2", cached_tokens=64)
    assert plan_route(PD, {}, 100, 220, 16) == Route(decode="d1", prefill="p1")  # 20 blocks, 20 free
    assert plan_route(PD, {}, 100, 221, 16) is None  # 21 blocks
    assert plan_route(PD, {"p1": 50}, 10, 1, 16).cached_tokens == 10  # type: ignore[union-attr]


def test_conditional_disaggregation_runs_short_uncached_prompts_colocated() -> None:
    ws = [w("p1", "prefill"), w("p2", "prefill"), w("d1", "decode"), w("c1", "colocated", free=50)]
    policy = RoutingPolicy(colocate_below_tokens=64)
    assert plan_route(ws, {}, 40, 10, 16, policy) == Route(decode="c1")  # short: no transfer
    assert plan_route(ws, {}, 400, 10, 16, policy) == Route(decode="d1", prefill="p1")  # long: P/D
    # long, but its first 368 tokens are cached on p2: the uncached 32 run colocated
    assert plan_route(ws, {"p2": 23}, 400, 10, 16, policy) == Route(decode="c1")
    assert plan_route(ws, {}, 40, 10, 16) == Route(decode="d1", prefill="p1")  # off by default
    assert plan_route(PD, {}, 40, 10, 16, policy) == Route(decode="d1", prefill="p1")  # no colocated worker up


def test_plan_route_falls_back_to_colocated_without_a_pair() -> None:
    colo = w("c1", "colocated", free=50)
    assert plan_route([w("d1", "decode"), colo], {}, 100, 10, 16) == Route(decode="c1")
    assert plan_route([w("p1", "prefill"), colo], {}, 100, 10, 16) == Route(decode="c1")
    assert plan_route([w("p1", "prefill")], {}, 100, 10, 16) is None
    assert plan_route(PD, {}, 100, 10, 16, exclude=frozenset({"d1"})) is None


def test_route_workers() -> None:
    assert Route(decode="d1", prefill="p1").workers == {"d1", "p1"}
    assert Route(decode="c1").workers == {"c1"}


def test_retry_exclusions_strictest_first() -> None:
    assert retry_exclusions([Route("d1", "p1")]) == [{"d1", "p1"}, {"p1"}, {"d1"}]
    assert retry_exclusions([Route("d1", "p1"), Route("d1", "p2")]) == [{"d1", "p1", "p2"}, {"p1", "p2"}, {"d1"}]
    assert retry_exclusions([Route("c1")]) == [{"c1"}]
    assert retry_exclusions([]) == []


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        RoutingPolicy(colocate_below_tokens=-1)
    with pytest.raises(ValueError):
        RoutingPolicy(overload_waiting=0)
