"""The routing policy: pure functions over a snapshot of workers (no Ray, no Redis)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from cluster.inflight import InflightLedger, WorkerLoad
from cluster.routing import Route, RoutingPolicy, plan_route
from cluster.worker_view import WorkerView, pick_colocated, pick_decode, pick_local, pick_prefill, prefill_eta
from router.serve_args import parse
from router.settings import RouterSettings


def w(
    worker_id: str, role: str, free: int = 100, running: int = 0, waiting: int = 0, load: WorkerLoad | None = None,
    **kw: bool,
) -> WorkerView:  # fmt: skip
    return WorkerView(
        worker_id, role, free_blocks=free, num_blocks=100, running=running, waiting=waiting,
        load=load or WorkerLoad(), **kw,
    )  # fmt: skip


def test_worker_view_of_heartbeat_info() -> None:
    v = WorkerView.of("d1", {"role": "decode", "free_blocks": 7, "num_blocks": 0, "running": 2, "draining": True})
    assert v == WorkerView("d1", "decode", free_blocks=7, num_blocks=1, running=2, waiting=0, draining=True)


def test_decode_by_streams_then_free_blocks_then_id() -> None:
    ws = [w("d1", "decode", free=50, running=1), w("d2", "decode", free=80, running=9), w("p1", "prefill", free=999)]
    assert pick_decode(ws, 10) == "d1"
    assert pick_decode(ws, 60) == "d2"  # only d2 has room
    assert pick_decode(ws, 81) is None
    assert pick_decode(ws, 10, exclude=frozenset({"d1"})) == "d2"
    tie = [w("d2", "decode", free=50, running=3), w("d1", "decode", free=50, running=3), w("d3", "decode", free=40)]
    assert pick_decode(tie, 1) == "d3"
    tie.pop()
    assert pick_decode(tie, 1) == "d1"


def test_decode_counts_what_the_router_sent_since_the_heartbeat() -> None:
    # the heartbeat says both are empty; the ledger knows d1 got 3 streams holding 60 blocks
    ws = [w("d1", "decode", load=WorkerLoad(streams=3, blocks=60)), w("d2", "decode", free=90)]
    assert pick_decode(ws, 10) == "d2"
    assert ws[0].free == 40 and ws[0].streams == 3
    assert pick_decode(ws, 10, exclude=frozenset({"d2"})) == "d1"
    assert pick_decode(ws, 41, exclude=frozenset({"d2"})) is None


def test_a_burst_splits_evenly_over_decode_workers() -> None:
    ledger = InflightLedger()
    ids = ["d1", "d2"]
    for i in range(32):  # no heartbeat arrives during the burst
        views = [w(d, "decode", load=ledger.load(d)) for d in ids] + [w("p1", "prefill", load=ledger.load("p1"))]
        route = plan_route(views, {}, 40, 24, 16, RoutingPolicy(local_below_tokens=0))  # P/D only
        assert route is not None and route.prefill == "p1"
        ledger.begin(f"r{i}", route.decode, route.prefill, 4, 40)
        ledger.check_integrity()
    assert ledger.load("d1").streams == ledger.load("d2").streams == 16
    assert ledger.load("p1").prefill_tokens == 32 * 40
    for i in range(32):
        ledger.prefilled(f"r{i}", 40, 0.04)
        ledger.end(f"r{i}")
        ledger.check_integrity()
    assert len(ledger) == 0 and ledger.load("d1") == WorkerLoad(
        prefill_s_per_token=ledger.load("d1").prefill_s_per_token
    )


def test_prefill_prefers_the_earliest_first_token() -> None:
    ws = [w("p1", "prefill", waiting=2), w("p2", "prefill"), w("p3", "prefill", running=1)]
    assert pick_prefill(ws, {}, 100, 16) == "p2"  # nothing queued or cached anywhere: the shortest heartbeat queue
    assert pick_prefill(ws, {"p1": 3, "p3": 2}, 100, 16) == "p1"
    assert pick_prefill(ws, {"p1": 3, "p3": 3}, 100, 16) == "p3"  # same prefix: the shorter queue
    assert pick_prefill(ws, {"p1": 3}, 100, 16, exclude=frozenset({"p1"})) == "p2"


def test_a_cache_hit_wins_while_it_saves_more_than_the_queue_costs() -> None:
    cost = 1e-3
    queued = [w("p1", "prefill", load=WorkerLoad(prefill_tokens=300, prefill_s_per_token=cost)), w("p2", "prefill")]
    # p1 holds 20 blocks (320 of 400 tokens): 300 queued + 80 uncached = 380 < 400 on p2
    assert prefill_eta(queued[0], 320, 400) == pytest.approx(0.38)
    assert pick_prefill(queued, {"p1": 20}, 400, 16) == "p1"
    more = [w("p1", "prefill", load=WorkerLoad(prefill_tokens=330, prefill_s_per_token=cost)), w("p2", "prefill")]
    assert pick_prefill(more, {"p1": 20}, 400, 16) == "p2"  # 410 > 400: no cliff, just the sum
    slow = [w("p1", "prefill", load=WorkerLoad(prefill_s_per_token=3e-3)), w("p2", "prefill")]
    assert pick_prefill(slow, {"p1": 10}, 400, 16) == "p2"  # 240 tokens at 3 ms > 400 at 1 ms


def test_shared_system_prompt_spreads_over_prefill_workers() -> None:
    """Every prompt shares a 20-block system prompt; once both workers hold it, a burst uses both."""
    ledger = InflightLedger()
    views = lambda: [w(p, "prefill", load=ledger.load(p)) for p in ("p1", "p2")]  # noqa: E731
    used = [pick_prefill(views(), {"p1": 20, "p2": 20}, 330, 16) for _ in range(1)]
    for i in range(16):
        p = pick_prefill(views(), {"p1": 20, "p2": 20}, 330, 16)
        assert p is not None
        ledger.begin(f"r{i}", "d1", p, 1, 330 - 320)
        used.append(p)
    assert used.count("p1") >= 7 and used.count("p2") >= 7
    ledger.check_integrity()


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


def test_a_next_turn_runs_local_on_the_decode_worker_that_holds_its_history() -> None:
    """340 prompt + 24 new tokens = 23 blocks of 16. d2 wrote the last answer: it holds 20 blocks
    (320 tokens), the prefill worker only the previous prompt (4 blocks)."""
    p1, d1 = w("p1", "prefill"), w("d1", "decode")
    ws = [p1, d1, w("d2", "decode", running=5)]
    held = {"p1": 4, "d2": 20}
    local = Route(decode="d2", cached_tokens=320, local=True)
    pd = Route(decode="d1", prefill="p1", cached_tokens=64)

    def plan(workers: list[WorkerView], prompt: int = 340, **kw: object) -> Route | None:
        return plan_route(workers, held, prompt, 24, 16, **kw)  # type: ignore[arg-type]

    assert plan(ws) == local  # 20 tokens left < 256, busier than d1 or not
    assert pick_local(ws, held, 340, 23, 16, 256) == ("d2", 320)
    assert plan(ws, prompt=600) == Route(decode="d1", prefill="p1", cached_tokens=64)  # 280 left: P/D
    assert plan(ws, policy=RoutingPolicy(local_below_tokens=20)) == pd
    assert plan(ws, policy=RoutingPolicy(local_below_tokens=0)) == pd  # off
    assert plan(ws, exclude=frozenset({"d2"})) == pd  # a retry after d2 failed
    # no room on d2 for 23 blocks, by its heartbeat or by what was reserved since: P/D on d1
    assert plan([p1, d1, w("d2", "decode", free=22)]) == pd
    assert plan([p1, d1, w("d2", "decode", load=WorkerLoad(streams=1, blocks=80))]) == pd
    assert plan([p1, d1, w("d2", "decode", draining=True)]) == pd
    # the prefill pool holds as much: nothing to save locally, the P/D split stands
    assert plan_route(ws, {"p1": 20, "d2": 20}, 340, 24, 16) == Route("d1", "p1", cached_tokens=320)
    # two holders: the longer prefix, then the fewer streams; no prefill pool at all is fine
    two = [w("d1", "decode", running=1), w("d2", "decode"), w("d3", "decode")]
    assert pick_local(two, {"d1": 21, "d2": 20, "d3": 20}, 340, 23, 16, 256) == ("d1", 336)
    assert plan_route(two, {"d2": 20, "d3": 20}, 340, 24, 16) == Route(decode="d2", cached_tokens=320, local=True)
    assert pick_local(two, {}, 340, 23, 16, 256) is None


def test_plan_route_falls_back_to_colocated_without_a_pair() -> None:
    colo = w("c1", "colocated", free=50)
    assert plan_route([w("d1", "decode"), colo], {}, 100, 10, 16) == Route(decode="c1")
    assert plan_route([w("p1", "prefill"), colo], {}, 100, 10, 16) == Route(decode="c1")
    off = RoutingPolicy(cross_pool=False)
    assert plan_route([w("p1", "prefill")], {}, 100, 10, 16, off) is None
    assert plan_route(PD, {}, 100, 10, 16, off, exclude=frozenset({"d1"})) is None


def test_with_one_pd_pool_gone_the_other_runs_requests_whole() -> None:
    """cross_pool: no live decode worker (dead, draining, or excluded after its failure, as when a
    dead decode worker's streams are replayed on 1P+1D): the prefill worker runs the request whole;
    no live prefill worker: a decode worker runs even a long prompt whole, on its longest prefix.
    Pools that are up but full are backpressure: no route."""
    p1, p2, d1 = w("p1", "prefill"), w("p2", "prefill", free=5), w("d1", "decode")
    whole = Route(decode="p1", local=True, fallback=True)
    assert plan_route([p1, p2], {"p1": 2}, 100, 10, 16) == replace(whole, cached_tokens=32)
    assert plan_route([p1, d1], {}, 100, 10, 16, exclude=frozenset({"d1"})) == whole
    assert plan_route([p1, w("d1", "decode", draining=True)], {}, 100, 10, 16) == whole
    assert plan_route([p2], {}, 100, 10, 16) is None  # 7 blocks, 5 free
    d2 = w("d2", "decode", running=2)
    assert plan_route([d1, d2], {"d2": 5}, 400, 24, 16) == Route("d2", cached_tokens=80, local=True, fallback=True)
    sick = w("p1", "prefill", healthy=False)
    assert plan_route([sick, d1], {}, 400, 24, 16) == Route("d1", local=True, fallback=True)
    assert plan_route([p1, w("d1", "decode", free=3)], {}, 100, 10, 16) is None  # d1 is up, only full
    assert plan_route([w("p1", "prefill", free=3), d1], {}, 100, 10, 16) == Route(decode="d1", prefill="p1")


def test_route_workers() -> None:
    assert Route(decode="d1", prefill="p1").workers == {"d1", "p1"}
    assert Route(decode="c1").workers == {"c1"}
    assert Route(decode="d1", local=True).workers == {"d1"}
    with pytest.raises(ValueError):
        Route(decode="d1", prefill="p1", local=True)


def test_policy_validation() -> None:
    with pytest.raises(ValueError):
        RoutingPolicy(colocate_below_tokens=-1)
    with pytest.raises(ValueError):
        RoutingPolicy(local_below_tokens=-1)


def test_a_short_prompt_runs_local_when_the_prefill_worker_is_busy() -> None:
    """A 40-token chat waits behind whatever the prefill worker has queued; from
    busy_prefill_tokens queued tokens on, it is prefilled on a decode worker instead."""
    d1, d2 = w("d1", "decode", running=3), w("d2", "decode")
    for queued, expected in ((0, Route("d2", "p1")), (1023, Route("d2", "p1")), (1024, Route("d2", local=True))):
        p1 = w("p1", "prefill", load=WorkerLoad(prefill_tokens=queued))
        assert plan_route([p1, d1, d2], {}, 40, 24, 16) == expected
    busy = w("p1", "prefill", load=WorkerLoad(prefill_tokens=4096))
    assert plan_route([busy, d1, d2], {}, 300, 24, 16) == Route("d2", "p1")  # too long to run local
    assert plan_route([busy, d1, d2], {}, 40, 24, 16, RoutingPolicy(local_below_tokens=0)) == Route("d2", "p1")
    # no prefill worker at all: a colocated worker first, else a short prompt runs local
    assert plan_route([d1, d2, w("c1", "colocated")], {}, 40, 24, 16) == Route("c1")
    assert plan_route([d1, d2], {}, 40, 24, 16) == Route("d2", local=True)
    assert plan_route([d1, d2], {}, 400, 24, 16, RoutingPolicy(cross_pool=False)) is None


def test_a_short_prompt_spills_to_an_idle_prefill_worker_when_decode_has_the_streams() -> None:
    """Decode-heavy traffic keeps one decode worker's core busy while the prefill worker's idles
    between short prefills: from `spill_streams` more streams on the decode worker, a short
    prompt runs whole on the prefill worker, unless that worker has prefills queued or ran a
    long one lately (its streams would stall behind the next)."""
    d1 = w("d1", "decode", running=3)
    idle = w("p1", "prefill")
    assert plan_route([idle, d1], {"p1": 2}, 40, 24, 16) == Route("d1", "p1", cached_tokens=32)  # off by default
    on = RoutingPolicy(spill_streams=2)
    assert plan_route([idle, d1], {"p1": 2}, 40, 24, 16, on) == Route("p1", cached_tokens=32, local=True)
    assert plan_route([idle, w("d1", "decode", running=1)], {}, 40, 24, 16, on) == Route("d1", "p1")  # margin not met
    spilled_to = w("p1", "prefill", load=WorkerLoad(streams=2))
    assert plan_route([spilled_to, d1], {}, 40, 24, 16, on) == Route("d1", "p1")  # 3 - 2 < 2: balanced enough
    queued = WorkerLoad(prefill_tokens=600, prefill_s_per_token=1e-3)  # 0.6 s of work queued
    assert plan_route([w("p1", "prefill", load=replace(queued, prefill_tokens=100)), d1], {}, 40, 24, 16, on).local
    for load in (queued, WorkerLoad(longest_prefill_s=4.9)):
        assert plan_route([w("p1", "prefill", load=load), d1], {}, 40, 24, 16, on) == Route("d1", "p1")
    assert plan_route([idle, d1], {}, 300, 24, 16, on) == Route("d1", "p1")  # not short (local_below_tokens)
    assert plan_route([w("p1", "prefill", free=2), d1], {}, 40, 24, 16, on) == Route("d1", "p1")  # no room on p1
    with pytest.raises(ValueError):
        RoutingPolicy(spill_streams=-1)


def test_a_prompt_overflows_to_a_decode_worker_while_the_prefill_worker_is_backlogged() -> None:
    """With overflow_below_tokens, a prompt under it runs whole on a decode worker while the
    prefill worker has busy_prefill_tokens queued and the decode worker's own queue gets it to
    its first token sooner; light load, a long prompt, or a decode worker as backlogged keep it
    disaggregated."""
    on = RoutingPolicy(overflow_below_tokens=1024)
    d1 = w("d1", "decode", running=2)

    def p1(queued: int) -> WorkerView:
        return w("p1", "prefill", load=WorkerLoad(prefill_tokens=queued, prefill_s_per_token=1e-3))

    assert plan_route([p1(4000), d1], {}, 600, 16, 16) == Route("d1", "p1")  # off by default
    assert plan_route([p1(1023), d1], {}, 600, 16, 16, on) == Route("d1", "p1")  # not backlogged
    assert plan_route([p1(1024), d1], {}, 600, 16, 16, on) == Route("d1", local=True)
    assert plan_route([p1(8000), d1], {}, 1024, 16, 16, on) == Route("d1", "p1")  # too long: the stall
    queued = WorkerLoad(streams=2, prefill_tokens=1024, prefill_s_per_token=1e-3)  # as much as p1 has
    assert plan_route([p1(1024), w("d1", "decode", load=queued)], {}, 600, 16, 16, on) == Route("d1", "p1")
    assert plan_route([p1(1024), w("d1", "decode", load=replace(queued, prefill_tokens=1023))], {}, 600, 16, 16,
                      on) == Route("d1", local=True)  # fmt: skip
    # the decode worker with the prompt's prefix, which it then need not prefill
    d2 = w("d2", "decode")
    assert plan_route([p1(1024), d1, d2], {"d1": 32}, 600, 16, 16, on) == Route("d1", cached_tokens=512, local=True)
    # a route that runs whole on a worker queues its prompt there until its first token
    led = InflightLedger()
    led.begin("a", "d1", None, 38, 600)
    led.check_integrity()
    assert led.load("d1").prefill_tokens == 600
    led.prefilled("a")
    led.check_integrity()
    assert led.load("d1").prefill_tokens == 0
    with pytest.raises(ValueError):
        RoutingPolicy(overflow_below_tokens=-1)
    assert RouterSettings(overflow_below_tokens=512).routing_policy.overflow_below_tokens == 512
    assert parse(["--overflow-below", "512"]).overflow_below == 512 and parse([]).overflow_below is None


def test_tandem_serve_can_turn_cross_pool_off() -> None:
    assert RouterSettings().routing_policy.cross_pool
    assert not RouterSettings(cross_pool=False).routing_policy.cross_pool
    assert parse(["--no-cross-pool"]).no_cross_pool and not parse([]).no_cross_pool


def test_tandem_serve_can_prefill_a_chats_history_fast() -> None:
    assert RouterSettings().exact_history and not RouterSettings(exact_history=False).exact_history
    assert parse(["--fast-history"]).fast_history and not parse([]).fast_history
