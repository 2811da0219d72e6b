"""The console's page and state call on the real router app over a fake backend (the browser
tests are tests/integration/test_console.py)."""

from __future__ import annotations

from engine.tokenizer import Tokenizer
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client


def test_page_and_static_files_are_served(smollm_tokenizer: Tokenizer) -> None:
    c = client(FakeBackend(smollm_tokenizer))
    r = c.get("/console", follow_redirects=True)
    assert r.status_code == 200 and "<title>Tandem console</title>" in r.text
    for name, kind in (("app.js", "javascript"), ("style.css", "css")):
        got = c.get(f"/console/{name}")
        assert got.status_code == 200 and kind in got.headers["content-type"]
    assert "http" not in c.get("/console/index.html").text.split("<body>")[0].replace("http-equiv", "")  # no CDN


def test_state_has_pools_load_events_and_requests(smollm_tokenizer: Tokenizer) -> None:
    backend = FakeBackend(smollm_tokenizer)
    c = client(backend, admin_token="t")
    assert c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 3}).status_code == 200
    backend.emit("scaled", role="decode", replicas=2, workers=["d0", "d1"])
    s = c.get("/console/api/state").json()  # no token needed: read-only
    assert [w["worker_id"] for w in s["pools"]["workers"]] == ["p0", "d0"]
    assert s["admin"] is True and s["load"]["requests"] == 1 and s["load"]["running"] == 0
    assert s["load"]["max_running"] == 64  # one decode worker up
    assert s["load"]["ttft_p50_s"] is not None and s["load"]["tokens_per_s"] > 0
    (req,) = s["requests"]
    assert req["status"] == 200 and req["completion_tokens"] == 3
    assert set(req["parts"]) == {"queue_s", "route_s", "prefill_s", "transfer_s", "first_decode_s", "decode_s"}
    assert req["prefill_worker"] == "p0" and req["decode_worker"] == "d0"
    (event,) = s["events"]
    assert event["kind"] == "scaled" and event["workers"] == ["d0", "d1"]


def test_state_is_a_503_when_the_cluster_is_away(smollm_tokenizer: Tokenizer) -> None:
    from cluster.state import StateUnavailable

    c = client(FakeBackend(smollm_tokenizer, control_error=StateUnavailable("redis down")))
    r = c.get("/console/api/state")
    assert r.status_code == 503 and "Traceback" not in r.text
