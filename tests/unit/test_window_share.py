"""One autoscaler among several routers (router/window_share.py): windows cross as JSON on one
clock, merge by arrival, and only the lease holder decides, over every router's traffic. The
share is the declared boundary here (in memory); tests/integration/test_cluster_state.py runs
the Redis one."""

from __future__ import annotations

import math
from collections.abc import Callable

from fastapi.testclient import TestClient

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
        self.last_change: float | None = None  # one clock for every router here

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

    def changed(self, at: float) -> None:
        self.shares.last_change = at

    def last_change(self) -> float | None:
        return self.shares.last_change


def router(
    backend: FakeBackend, share: Share, clock: Callable[[], float] = lambda: 1000.0
) -> tuple[TestClient, Autoscaler]:
    c = client(backend)
    window: LoadWindow = c.app.state.dispatcher.window  # type: ignore[attr-defined]
    bounds = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 3, "decode": 3}, cooldown_s=60)
    config = AutoscaleConfig(SLO(ttft_s=5.0, tpot_s=0.005), bounds, 1.0)
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
