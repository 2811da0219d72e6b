"""The operator console in a real browser (Playwright driving Debian's headless Chromium, nothing
downloaded) on a live 1P+1D cluster: it lists the workers with no console errors, scales and
drains and flips a worker's role from the page with the admin token, updates its charts and waterfall under load, and
without the token is read-only while the admin API refuses."""

from __future__ import annotations

import shutil
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from playwright.sync_api import Browser, Page, expect, sync_playwright

from bench.harness import uvicorn_thread
from cluster.cluster import Cluster, ClusterConfig
from engine.config import EngineConfig
from planner.autoscale import Bounds
from planner.slo import SLO
from router.app import create_app
from router.autoscale_flags import AutoscaleConfig
from router.autoscaler import Autoscaler
from router.backend import ClusterBackend
from router.settings import RouterSettings
from tests.integration.waits import until

TOKEN = "console-itest-token"
ADMIN = {"Authorization": f"Bearer {TOKEN}"}
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SHOT = Path(__file__).resolve().parents[2] / "out" / "console.png"


@dataclass(frozen=True)
class Served:
    url: str
    app: FastAPI
    backend: ClusterBackend


@pytest.fixture(scope="module")
def served() -> Iterator[Served]:
    cluster = Cluster.connect(
        ClusterConfig(namespace="console-itest", engine=EngineConfig(dtype="fp32", num_blocks=128, num_threads=1))
    )
    try:
        cluster.wait_ready(240)
        backend = ClusterBackend(cluster)
        app = create_app(backend, RouterSettings(admin_token=TOKEN))
        with uvicorn_thread(app) as base:
            yield Served(base, app, backend)
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def url(served: Served) -> str:
    return served.url


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    assert CHROMIUM, "the browser tests need Debian's chromium (make setup installs it)"
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=["--no-sandbox"])
        yield b
        b.close()


ERRORS: dict[int, list[str]] = {}  # a page's console errors, by id(page)


@pytest.fixture
def page(browser: Browser, url: str) -> Iterator[Page]:
    context = browser.new_context(viewport={"width": 1400, "height": 1100})
    pg = context.new_page()
    errors = ERRORS.setdefault(id(pg), [])
    pg.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    pg.on("pageerror", lambda e: errors.append(str(e)))
    pg.goto(f"{url}/console")
    for role in ("prefill", "decode"):
        expect(pg.locator(f'#workers tbody tr[data-role="{role}"]').first).to_be_attached(timeout=30_000)
    yield pg
    assert errors == [], errors
    context.close()


def rows(page: Page, role: str, state: str = "up") -> int:
    return page.locator(f'#workers tbody tr[data-role="{role}"][data-state="{state}"]').count()


def test_lists_the_workers_and_is_read_only_without_the_token(page: Page, url: str) -> None:
    assert rows(page, "prefill") == 1 and rows(page, "decode") == 1
    expect(page.locator("#mode")).to_have_text("read-only")
    for button in ("#scale", "#rebalance"):
        expect(page.locator(button)).to_be_disabled()
    expect(page.locator("button.drain").first).to_be_disabled()
    expect(page.locator("button.flip").first).to_be_disabled()
    status = page.evaluate(
        """async () => (await fetch('/admin/pools/decode', {method: 'POST',
             headers: {'Content-Type': 'application/json'}, body: JSON.stringify({replicas: 3})})).status"""
    )
    assert status == 401
    errors = ERRORS[id(page)]
    assert errors == ["Failed to load resource: the server responded with a status of 401 (Unauthorized)"]
    errors.clear()  # that one was asked for
    assert httpx.get(f"{url}/admin/pools").status_code == 401


def test_scale_and_drain_from_the_page(page: Page) -> None:
    page.fill("#token", TOKEN)
    page.click("#use-token")
    expect(page.locator("#mode")).to_have_text("admin")
    page.select_option("#scale-role", "decode")
    page.fill("#scale-n", "2")
    page.click("#scale")
    expect(page.locator("#message")).to_contain_text("done")
    until(lambda: rows(page, "decode") == 2, 180, "a second decode worker on the page")
    second = page.locator('#workers tbody tr[data-role="decode"]').nth(1)
    worker = second.get_attribute("data-worker")
    second.locator("button.drain").click()
    expect(page.locator("#message")).to_contain_text("drain: done")
    row = f'#workers tbody tr[data-worker="{worker}"]'

    def drained() -> bool:  # draining on the page, or already gone (an idle worker drains at once)
        return page.locator(f'{row}:not([data-state="up"])').count() == 1 or page.locator(row).count() == 0

    until(drained, 60, "the drain on the page")
    expect(page.locator('#events li[data-kind="worker_draining"]')).to_have_count(1, timeout=30_000)


def test_a_role_flip_from_the_page(page: Page) -> None:
    page.fill("#token", TOKEN)
    page.click("#use-token")
    until(lambda: rows(page, "decode") == 2, 180, "two decode workers up")
    row = page.locator('#workers tbody tr[data-role="decode"][data-state="up"]').first
    worker = row.get_attribute("data-worker")
    row.locator("button.flip").click()
    expect(page.locator("#message")).to_contain_text("role: done")
    until(lambda: page.locator(f'#workers tbody tr[data-worker="{worker}"][data-role="prefill"][data-state="up"]')
          .count() == 1, 120, "the flipped worker up as prefill on the page")  # fmt: skip
    expect(page.locator('#events li[data-kind="worker_flipped"]')).to_have_count(1, timeout=30_000)


def test_charts_and_waterfall_follow_the_load(page: Page, url: str) -> None:
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    before = page.locator("#waterfall .row").count()

    def load() -> None:
        for i in range(6):
            body = {"model": model, "prompt": f"Count to {i + 3}:", "max_tokens": 8, "temperature": 0}
            httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()

    sender = threading.Thread(target=load)
    sender.start()
    until(lambda: page.locator("#waterfall .row").count() >= before + 3, 60, "the waterfall to grow")
    sender.join(60)
    for chart in ("#chart-ttft", "#chart-tpot", "#chart-tps"):
        until(lambda c=chart: int(page.locator(c).get_attribute("data-points") or 0) > 0, 30, f"{chart} to draw")
    row = page.locator("#waterfall .row").first
    assert "→" in row.inner_text()  # prefill worker -> decode worker
    expect(page.locator("#load-now")).to_contain_text("tokens/s")
    SHOT.parent.mkdir(exist_ok=True)
    page.screenshot(path=str(SHOT), full_page=True)


def test_the_autoscaler_scales_the_live_cluster_and_the_page_shows_why(page: Page, served: Served) -> None:
    """The autoscaler on the real cluster: an SLO no request meets (1 ms a token) adds a decode
    worker; the decision and its reasons reach Redis's event stream, /admin/events and the page."""
    url, window = served.url, served.app.state.dispatcher.window
    desired = served.backend.status()["desired"]
    bounds = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 1, "decode": desired["decode"] + 1})
    scaler = Autoscaler(served.backend, window, AutoscaleConfig(SLO(ttft_s=30.0, tpot_s=0.001), bounds, 1.0))
    window.take()  # start the window now
    model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
    for i in range(3):
        body = {"model": model, "prompt": f"Say {i}:", "max_tokens": 6, "temperature": 0}
        httpx.post(f"{url}/v1/completions", json=body, timeout=60).raise_for_status()
    decision = scaler.tick()
    assert decision.changed and decision.sizes["decode"] == desired["decode"] + 1
    assert served.backend.status()["desired"]["decode"] == desired["decode"] + 1
    events = httpx.get(f"{url}/admin/events", params={"since": "", "count": 5}, headers=ADMIN).json()["events"]
    (event,) = [e for e in events if e["kind"] == "autoscale"]
    assert "decode: +1, its SLO is missed" in event["reasons"] and "3 requests" in event["reasons"]
    expect(page.locator('#events li[data-kind="autoscale"]')).to_have_count(1, timeout=30_000)
    until(lambda: rows(page, "decode") == desired["decode"] + 1, 180, "the autoscaler's decode worker on the page")
