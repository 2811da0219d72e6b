"""deploy/grafana/tandem.json and deploy/prometheus/prometheus.yml: every metric the dashboard
queries is one the router exports, and the scrape config points at the router."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from engine.tokenizer import Tokenizer
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SPEC_ONLY = "tandem:spec_decode_"  # exported only by workers that speculate (`--speculative`)


def dashboard_metrics() -> set[str]:
    """Every tandem:* series name in the dashboard's queries."""
    dash = json.loads((DEPLOY / "grafana" / "tandem.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    assert exprs and all(p["targets"] for p in dash["panels"])
    return {m for e in exprs for m in re.findall(r"tandem:[A-Za-z0-9_:]+", e)}


def exported(metrics_text: str) -> set[str]:
    return {s.name for f in text_string_to_metric_families(metrics_text) for s in f.samples}


def test_every_dashboard_metric_is_exported_by_the_router(smollm_tokenizer: Tokenizer) -> None:
    backend = FakeBackend(smollm_tokenizer)
    spec: dict[str, Any] = {"spec_decode_num_drafts": 2, "spec_decode_num_draft_tokens": 6}
    backend.workers[1].update(spec, spec_decode_num_accepted_tokens=4, spec_decode_num_accepted_tokens_per_pos=[2, 2])
    c = client(backend)
    assert c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 3}).status_code == 200
    assert c.post(CHAT, json={"model": "nope", "messages": HELLO}).status_code == 404
    wanted = dashboard_metrics()
    assert len(wanted) >= 15 and any(m.startswith(SPEC_ONLY) for m in wanted)
    assert not wanted - exported(c.get("/metrics").text)


@pytest.mark.parametrize("panel_unit", ["s", "percentunit"])
def test_the_dashboard_is_importable_grafana_json(panel_unit: str) -> None:
    dash = json.loads((DEPLOY / "grafana" / "tandem.json").read_text())
    assert dash["uid"] and dash["schemaVersion"] >= 30
    assert {v["name"] for v in dash["templating"]["list"]} == {"datasource"}
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    assert any(p["fieldConfig"]["defaults"]["unit"] == panel_unit for p in dash["panels"])
    for p in dash["panels"]:
        assert p["datasource"]["uid"] == "${datasource}" and {"h", "w", "x", "y"} <= set(p["gridPos"])


def test_prometheus_scrapes_the_router_and_ray() -> None:
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in cfg["scrape_configs"]}
    assert jobs["tandem-router"]["metrics_path"] == "/metrics"
    assert jobs["tandem-router"]["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    assert jobs["ray"]["file_sd_configs"][0]["files"] == ["/tmp/ray/prom_metrics_service_discovery.json"]
