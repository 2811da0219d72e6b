"""The admin API against a fake Backend: refusing to scale away every pool that can serve,
answering a state store (Redis) outage with a clear 503, and showing each worker's preemptions."""

from __future__ import annotations

from typing import Any

import pytest
import redis.exceptions
from fastapi.testclient import TestClient

from cluster.state import StateUnavailable
from engine.tokenizer import Tokenizer
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client, worker


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(smollm_tokenizer)


def admin(backend: FakeBackend, **settings: Any) -> TestClient:
    c = client(backend, admin_token="s3cret", **settings)
    c.headers["Authorization"] = "Bearer s3cret"
    return c


def refused(r: Any, param: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["code"] == "would_stop_serving" and err["param"] == param and '"force": true' in err["message"]


def test_scaling_away_every_pool_that_can_serve_needs_force(backend: FakeBackend) -> None:
    c = admin(backend)
    refused(c.post("/admin/pools/decode", json={"replicas": 0}), "replicas")
    refused(c.post("/admin/rebalance", json={"prefill": 2, "decode": 0}), "decode")
    refused(c.post("/admin/rebalance", json={"prefill": 0, "decode": 0}), "prefill")
    assert backend.desired == {"prefill": 1, "decode": 1}  # nothing changed
    assert c.post("/admin/pools/colocated", json={"replicas": 1}).status_code == 200
    assert c.post("/admin/rebalance", json={"prefill": 0, "decode": 0}).status_code == 200  # colocated serves
    refused(c.post("/admin/pools/colocated", json={"replicas": 0}), "replicas")
    r = c.post("/admin/pools/colocated", json={"replicas": 0, "force": True})
    assert r.status_code == 200 and r.json() == {"role": "colocated", "replicas": 0}
    assert backend.desired == {"prefill": 0, "decode": 0, "colocated": 0}
    assert c.post("/admin/pools/prefill", json={"replicas": 1}).status_code == 200  # on the way back up
    assert c.post("/admin/rebalance", json={"prefill": 1, "decode": 2, "force": False}).json() == {
        "prefill": 1,
        "decode": 2,
    }
    assert c.post("/admin/rebalance", json={"prefill": 1, "decode": 0, "force": "yes"}).status_code == 400


def test_a_role_flip_is_checked_then_handed_to_the_cluster(backend: FakeBackend) -> None:
    backend.workers.append(worker("c0", "colocated"))
    c = admin(backend)
    refused(c.post("/admin/workers/p0/role", json={"role": "decode"}), "role")  # the only prefill worker
    assert backend.desired == {"prefill": 1, "decode": 1}
    bad = c.post("/admin/workers/p0/role", json={"role": "colocated"})
    assert bad.status_code == 400 and bad.json()["error"]["code"] == "bad_role"
    assert c.post("/admin/workers/nope/role", json={"role": "decode"}).status_code == 404
    r = c.post("/admin/workers/c0/role", json={"role": "decode"})
    assert r.status_code == 409 and r.json()["error"]["code"] == "cannot_flip"
    same = c.post("/admin/workers/d0/role", json={"role": "decode"})
    assert same.json() == {"worker_id": "d0", "role": "decode", "state": "up"}, "already that role: nothing to do"
    backend.workers.append(worker("p1", "prefill"))
    backend.desired["prefill"] = 2
    r = c.post("/admin/workers/p1/role", json={"role": "decode"})
    assert r.status_code == 200 and r.json() == {"worker_id": "p1", "role": "decode", "state": "flipping"}
    assert backend.desired == {"prefill": 1, "decode": 2}
    r = c.post("/admin/workers/p0/role", json={"role": "decode", "force": True})
    assert r.status_code == 200 and backend.desired == {"prefill": 0, "decode": 3}


OUTAGES = [
    StateUnavailable("redis at 10.0.0.5:6379 did not answer in 0.5 s"),
    redis.exceptions.ConnectionError("Error 111 connecting to 10.0.0.5:6379. Connection refused."),
    redis.exceptions.TimeoutError("Timeout reading from socket"),
]


@pytest.mark.parametrize("outage", OUTAGES, ids=lambda e: type(e).__name__)
def test_state_store_outage_answers_503_with_retry_after(backend: FakeBackend, outage: Exception) -> None:
    c = admin(backend, retry_after_s=5)
    backend.control_error = outage
    calls = [
        c.get("/admin/pools"),
        c.post("/admin/pools/decode", json={"replicas": 2}),
        c.post("/admin/workers/d0/drain"),
        c.post("/admin/rebalance", json={"prefill": 2, "decode": 2, "force": True}),
        c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 2}),
    ]
    for r in calls:
        assert r.status_code == 503 and r.headers["retry-after"] == "5" and r.headers["x-request-id"], r.text
        err = r.json()["error"]
        assert err["code"] == "state_unavailable" and err["type"] == "service_unavailable"
        assert err["message"].startswith("cluster state store unavailable") and "6379" not in err["message"]
    assert backend.desired == {"prefill": 1, "decode": 1}
    assert c.get("/health").status_code == 200
    backend.control_error = None
    assert c.get("/admin/pools").json()["up"] == {"prefill": 1, "decode": 1, "colocated": 0}


def test_other_cluster_failures_in_admin_calls_are_503_without_internals(backend: FakeBackend) -> None:
    c = admin(backend)
    backend.control_error = RuntimeError("ray.exceptions.GetTimeoutError: Traceback (most recent call last): ...")
    r = c.post("/admin/workers/d0/drain")
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert err["code"] == "cluster_error" and "ray" not in err["message"] and "Traceback" not in err["message"]


def test_pools_show_each_workers_preemptions(backend: FakeBackend) -> None:
    """KV pressure (a full cache sends requests back to be recomputed), as the console shows it."""
    backend.workers[1]["num_preemptions"] = 3
    workers = {w["worker_id"]: w for w in admin(backend).get("/admin/pools").json()["workers"]}
    assert workers["d0"]["num_preemptions"] == 3 and workers["p0"]["num_preemptions"] == 0
