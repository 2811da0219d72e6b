"""The autoscaler over the real router app on a fake backend: the window the router keeps, one
decision a tick, scaling through the backend, and the decision under /admin/events."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping

import pytest
from fastapi.testclient import TestClient

from engine.tokenizer import Tokenizer
from planner.autoscale import Bounds
from planner.profile import DecodePoint, EngineProfile, PrefillPoint
from planner.search import Handoff
from planner.slo import SLO
from planner.trace import Trace
from router.autoscale_flags import AutoscaleConfig, add_arguments, config_from_args, parse_bounds
from router.autoscaler import Autoscaler, Planner, profile_planner, window_trace
from router.window import LoadWindow
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client

TOKEN = "t0ken"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}


def send(c: TestClient, n: int, max_tokens: int = 4) -> None:
    for _ in range(n):
        r = c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": max_tokens})
        assert r.status_code == 200


def scaler(
    backend: FakeBackend, c: TestClient, slo: SLO, planner: Planner | None = None, now: list[float] | None = None
) -> Autoscaler:
    window: LoadWindow = c.app.state.dispatcher.window  # type: ignore[attr-defined]
    bounds = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 3, "decode": 3}, cooldown_s=60)
    clock = (lambda: now[0]) if now is not None else (lambda: 0.0)
    return Autoscaler(backend, window, AutoscaleConfig(slo, bounds, 1.0), planner, clock)


def test_a_missed_tpot_adds_a_decode_worker_and_says_why(smollm_tokenizer: Tokenizer) -> None:
    backend = FakeBackend(smollm_tokenizer, token_delay_s=0.02)
    c = client(backend, admin_token=TOKEN)
    send(c, 6)
    now = [1000.0]
    s = scaler(backend, c, SLO(ttft_s=5.0, tpot_s=0.005), now=now)  # 20 ms a token misses 5 ms
    d = s.tick()
    assert d.changed and backend.desired == {"prefill": 1, "decode": 2}
    events = c.get("/admin/events", headers=ADMIN).json()["events"]
    assert [e["kind"] for e in events] == ["autoscale"]
    reasons = events[0]["reasons"]
    assert "6 requests" in reasons and "TPOT 0%" in reasons and "decode: +1" in reasons
    # the next window misses again, but the change is cooling down: held, and said so
    send(c, 3)
    now[0] += 10
    assert not s.tick().changed and backend.desired["decode"] == 2
    last = c.get("/admin/events", headers=ADMIN, params={"since": events[0]["id"]}).json()["events"]
    assert len(last) == 1 and "cooldown" in last[0]["reasons"]


def test_an_idle_window_leaves_the_pools_and_logs_nothing(smollm_tokenizer: Tokenizer) -> None:
    backend = FakeBackend(smollm_tokenizer)
    c = client(backend, admin_token=TOKEN)
    d = scaler(backend, c, SLO(1.0, 1.0)).tick()
    assert not d.changed and backend.desired == {"prefill": 1, "decode": 1}
    assert c.get("/admin/events", headers=ADMIN).json()["events"] == []


def test_the_plan_drives_the_sizes(smollm_tokenizer: Tokenizer) -> None:
    backend = FakeBackend(smollm_tokenizer)
    c = client(backend, admin_token=TOKEN)
    send(c, 4)
    asked: list[dict[str, int]] = []

    def planner(trace: Trace, slo: SLO, current: Mapping[str, int]) -> dict[str, int]:
        asked.append(dict(current))
        return {"prefill": 3, "decode": 1, "colocated": 0}

    d = scaler(backend, c, SLO(10.0, 10.0), planner).tick()
    assert asked == [{"prefill": 1, "decode": 1, "colocated": 0}]
    assert d.changed and backend.desired == {"prefill": 2, "decode": 1}  # one step toward 3


def test_a_growth_the_bounds_hold_is_an_event_with_why_the_plan_is_empty(smollm_tokenizer: Tokenizer) -> None:
    """Fixed hardware (pd=2) at 1P+1D, a missed TPOT and a planner that finds no size: decode
    cannot grow (prefill is at its min), and the held decision still reaches /admin/events."""
    backend = FakeBackend(smollm_tokenizer, token_delay_s=0.02)
    c = client(backend, admin_token=TOKEN)
    send(c, 6)
    window: LoadWindow = c.app.state.dispatcher.window  # type: ignore[attr-defined]
    bounds = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 2, "decode": 2}, max_pd=2)
    s = Autoscaler(backend, window, AutoscaleConfig(SLO(5.0, 0.005), bounds, 1.0), lambda t, slo, cur: None)
    d = s.tick()
    assert not d.changed and d.held and backend.desired == {"prefill": 1, "decode": 1}
    (event,) = c.get("/admin/events", headers=ADMIN).json()["events"]
    assert "decode: held at 1" in event["reasons"] and "no size the planner can reach" in event["reasons"]


def test_profile_planner_sizes_from_the_simulator(smollm_tokenizer: Tokenizer) -> None:
    from planner.kinds import from_profile

    prefill = tuple(PrefillPoint(u, 0, 0.001 * u) for u in (64, 256, 1024))
    decode = tuple(DecodePoint(b, 100 * b, 0.01 + 0.002 * b) for b in (1, 4, 16))
    kind = from_profile(EngineProfile("toy", "measured", "m", "fp32", "fp32", prefill, decode), 0.0, 8)
    plan = profile_planner(kind, Handoff(0.0, 0.0), limit=8)
    window = LoadWindow()
    for i in range(40):  # 4 requests a second of 1,000-token prompts: ~4 prefill workers' worth
        window.record(i * 0.25, 1000, 4, 0.1, 0.01)
    trace = window_trace(window.take())
    assert trace is not None and len(trace) == 40
    sizes = plan(trace, SLO(2.0, 0.1), {"prefill": 1, "decode": 1, "colocated": 0})
    assert sizes is not None and sizes["prefill"] >= 4 and sizes["decode"] >= 1
    colo = plan(trace, SLO(2.0, 0.1), {"prefill": 0, "decode": 0, "colocated": 1})
    assert colo is not None and colo["colocated"] >= 4


def test_flags_are_checked() -> None:
    assert parse_bounds("prefill=1..4, decode=2..8") == ({"prefill": 1, "decode": 2}, {"prefill": 4, "decode": 8}, None)
    assert parse_bounds("prefill=1..2,decode=1..2,pd=3")[2] == 3
    for bad in ("prefill=4..1", "gpu=1..2", "prefill=1", ""):
        with pytest.raises(ValueError):
            parse_bounds(bad)
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    assert config_from_args(ap.parse_args([])) is None
    config = config_from_args(ap.parse_args(["--autoscale", "decode=1..4", "--slo", "ttft=1,tpot=50ms"]))
    assert config is not None and config.slo == SLO(1.0, 0.05) and config.bounds.max == {"decode": 4}
    with pytest.raises(ValueError):
        config_from_args(ap.parse_args(["--autoscale", "decode=1..4", "--autoscale-profile", "/nonexistent.json"]))


def test_events_endpoint_checks_its_arguments_and_the_token(smollm_tokenizer: Tokenizer) -> None:
    c = client(FakeBackend(smollm_tokenizer), admin_token=TOKEN)
    assert c.get("/admin/events").status_code in (401, 403)
    r = c.get("/admin/events", headers=ADMIN, params={"since": "drop table"})
    assert r.status_code == 400 and json.loads(r.text)["error"]["param"] == "since"
    assert c.get("/admin/events", headers=ADMIN, params={"count": 0}).status_code == 400
