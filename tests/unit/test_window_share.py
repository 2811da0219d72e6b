"""One autoscaler among several routers (router/window_share.py): windows cross as JSON on one
clock, merge by arrival, and only the lease holder decides, over every router's traffic. The
share is the declared boundary here (in memory); tests/integration/test_cluster_state.py runs
the Redis one."""

from __future__ import annotations

import math
from collections.abc import Callable

from fastapi.testclient import TestClient

from cluster.autoscale_store import LastChange
from engine.tokenizer import Tokenizer
from planner.autoscale import Bounds
from planner.slo import SLO
from router.autoscale_flags import AutoscaleConfig
from router.autoscaler import Autoscaler
from router.window import LoadWindow, Sample, Taken
from router.window_share import decode, encode, merged
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client


def test_a_window_crosses_as_json_on_the_readers_clock() -> None:
    t = Taken(30.0, 3, (Sample(100.0, 12, 4, 0.2, 0.01), Sample(101.5, 7, 1, math.inf, math.inf)))
    back = decode(encode(t, 5000.0), 4000.0)  # written where wall - monotonic was 5000, read at 4000
    assert back.seconds == 30.0 and back.requests == 3
    assert [s.arrival for s in back.samples] == [1100.0, 1101.5]
    assert back.samples[1].ttft_s == math.inf and back.samples[0] == Sample(1100.0, 12, 4, 0.2, 0.01)


def test_merged_sums_the_requests_and_orders_the_samples_over_this_routers_window() -> None:
    mine = Taken(30.0, 2, (Sample(1.0, 1, 1, 0.1, 0.1), Sample(5.0, 1, 1, 0.1, 0.1)))
    other = Taken(29.0, 3, (Sample(2.0, 2, 2, 0.2, 0.2),))  # it kept 1 of its 3 samples
    m = merged(mine, [other])
    assert m.seconds == 30.0 and m.requests == 5 and [s.arrival for s in m.samples] == [1.0, 2.0, 5.0]


class Shares:
    """Every router's WindowShare, in memory: one lease holder, a list of published windows."""

    def __init__(self) -> None:
        self.holder = ""
        self.windows: list[Taken] = []
        self.last_change: LastChange | None = None  # one clock for every router here

    def of(self, owner: str) -> Share:
        return Share(self, owner)


class Share:
    def __init__(self, shares: Shares, owner: str) -> None:
        self.shares, self.owner = shares, owner

    def lead(self) -> bool:
        self.shares.holder = self.shares.holder or self.owner
        return self.shares.holder == self.owner

    def publish(self, taken: Taken) -> None:
        self.shares.windows.append(taken)

    def collect(self) -> list[Taken]:
        got, self.shares.windows = self.shares.windows, []
        return got

    def changed(self, at: float, flipped_to: str | None) -> None:
        self.shares.last_change = LastChange(at, flipped_to, self.owner)

    def last_change(self) -> LastChange | None:
        last = self.shares.last_change
        return None if last is None or last.by == self.owner else last


MISSES_TPOT = SLO(ttft_s=5.0, tpot_s=0.005)  # the fake backend's tokens come 20 ms apart
BOUNDS = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 3, "decode": 3}, cooldown_s=60)


def router(
    backend: FakeBackend,
    share: Share,
    clock: Callable[[], float] = lambda: 1000.0,
    slo: SLO = MISSES_TPOT,
    bounds: Bounds = BOUNDS,
) -> tuple[TestClient, Autoscaler]:
    c = client(backend)
    window: LoadWindow = c.app.state.dispatcher.window  # type: ignore[attr-defined]
    config = AutoscaleConfig(slo, bounds, 1.0)
    return c, Autoscaler(backend, window, config, clock=clock, share=share)


def test_one_router_decides_over_every_routers_window(smollm_tokenizer: Tokenizer) -> None:
    backend = FakeBackend(smollm_tokenizer, token_delay_s=0.02)  # the cluster both routers serve
    shares = Shares()
    first, leader = router(backend, shares.of("a"))
    second, follower = router(backend, shares.of("b"))
    assert leader.tick() is not None  # it takes the lease (an empty window: nothing to do)
    for c, n in ((first, 2), (second, 4)):
        for _ in range(n):
            assert c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 4}).status_code == 200
    assert follower.tick() is None and len(shares.windows) == 1  # standing by: its window is published
    assert backend.desired == {"prefill": 1, "decode": 1}
    d = leader.tick()
    assert d is not None and d.changed and backend.desired == {"prefill": 1, "decode": 2}
    assert any("6 requests" in r for r in d.reasons), d.reasons  # its 2 and the other's 4
    assert shares.windows == []


def test_a_router_that_takes_the_lead_over_keeps_the_cooldown(smollm_tokenizer: Tokenizer) -> None:
    """The deciding router scales up, then dies (its lease lapses); the one that takes the lead
    sees the same load, but the cooldown of the change the other made still holds it."""
    backend = FakeBackend(smollm_tokenizer, token_delay_s=0.02)
    shares, now = Shares(), [1000.0]
    first, leader = router(backend, shares.of("a"), lambda: now[0])
    second, successor = router(backend, shares.of("b"), lambda: now[0])
    body = {"model": "fake-model", "messages": HELLO, "max_tokens": 4}
    for _ in range(4):
        assert first.post(CHAT, json=body).status_code == 200
    d = leader.tick()
    assert d is not None and d.changed and backend.desired == {"prefill": 1, "decode": 2}
    shares.holder = ""  # its lease lapsed
    now[0] += 10
    for _ in range(4):
        assert second.post(CHAT, json=body).status_code == 200
    d = successor.tick()
    assert d is not None and not d.changed and backend.desired == {"prefill": 1, "decode": 2}
    assert any("cooldown: 50 s left" in r for r in d.reasons), d.reasons
    now[0] += 60
    for _ in range(4):
        assert second.post(CHAT, json=body).status_code == 200
    d = successor.tick()
    assert d is not None and d.changed and backend.desired == {"prefill": 1, "decode": 3}


def test_a_router_that_takes_the_lead_over_does_not_flip_a_worker_straight_back(smollm_tokenizer: Tokenizer) -> None:
    """On fixed hardware (pd=3) the deciding router flips a worker prefill -> decode, then dies.
    Its successor's windows now miss TTFT: it holds the flip back until 3 windows in a row ask,
    as the router that flipped it would have, instead of flipping it back at once."""
    backend = FakeBackend(smollm_tokenizer, token_delay_s=0.02, desired={"prefill": 2, "decode": 1})
    bounds = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 2, "decode": 2}, cooldown_s=0, max_pd=3)
    shares = Shares()
    first, leader = router(backend, shares.of("a"), bounds=bounds)
    # the successor's SLO misses TTFT and meets TPOT: it stands in for traffic turned prefill-heavy
    second, successor = router(backend, shares.of("b"), slo=SLO(ttft_s=0.005, tpot_s=5.0), bounds=bounds)
    body = {"model": "fake-model", "messages": HELLO, "max_tokens": 4}
    for _ in range(4):
        assert first.post(CHAT, json=body).status_code == 200
    d = leader.tick()
    assert d is not None and d.changed and backend.desired == {"prefill": 1, "decode": 2}
    assert shares.last_change == LastChange(1000.0, "decode", "a")
    shares.holder = ""  # its lease lapsed
    for n in (1, 2):
        for _ in range(4):
            assert second.post(CHAT, json=body).status_code == 200
        d = successor.tick()
        assert d is not None and not d.changed and backend.desired == {"prefill": 1, "decode": 2}
        assert any(f"back after 3 windows in a row ask ({n} so far)" in r for r in d.reasons), d.reasons
    for _ in range(4):
        assert second.post(CHAT, json=body).status_code == 200
    d = successor.tick()
    assert d is not None and d.changed and backend.desired == {"prefill": 2, "decode": 1}, d.reasons
    assert shares.last_change == LastChange(1000.0, "prefill", "b")
