"""`tandem status`: histogram quantiles as Prometheus computes them, and frames drawn from a
router (the app with a fake backend, through its TestClient: an httpx.Client)."""

from __future__ import annotations

import io
import socket

import httpx
import pytest
from rich.console import Console

from cli.status import main, quantile
from engine.tokenizer import Tokenizer
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client

INF = float("inf")


def test_quantile_interpolates_within_the_bucket_like_histogram_quantile() -> None:
    b = [(0.1, 0.0), (0.5, 10.0), (1.0, 20.0), (INF, 20.0)]
    assert quantile(b, 0.5) == pytest.approx(0.5)
    assert quantile(b, 0.75) == pytest.approx(0.75)
    assert quantile(b, 0.25) == pytest.approx(0.3)
    assert quantile([(0.1, 0.0), (INF, 0.0)], 0.5) is None
    assert quantile([(0.1, 1.0), (INF, 4.0)], 0.9) == pytest.approx(0.1)  # past the last finite bound


def run(argv: list[str], http: httpx.Client) -> tuple[int, str]:
    out = io.StringIO()
    code = main(argv, http=http, console=Console(file=out, width=160, color_system=None))
    return code, out.getvalue()


def test_one_frame_shows_the_workers_and_the_latencies(
    smollm_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TANDEM_ADMIN_TOKEN", "t0ken")
    c = client(FakeBackend(smollm_tokenizer), admin_token="t0ken")
    for _ in range(3):
        assert c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 4}).status_code == 200
    code, text = run(["--once", "--url", str(c.base_url)], c)
    assert code == 0
    assert "p0" in text and "d0" in text and "prefill" in text and "decode" in text
    ttft = next(line for line in text.splitlines() if "TTFT" in line)
    assert "-" not in ttft.split("TTFT (s)")[1]  # three observations: every quantile has a value


def test_without_the_token_the_frame_says_so_and_still_shows_the_load(
    smollm_tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("TANDEM_ADMIN_TOKEN", raising=False)
    c = client(FakeBackend(smollm_tokenizer), admin_token="t0ken")
    code, text = run(["--once", "--url", str(c.base_url)], c)
    assert code == 0 and "answered 401" in text and "TPOT" in text


def test_an_unreachable_router_is_one_line_and_exit_1(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens once closed
    code, _ = run(["--once", "--url", f"http://127.0.0.1:{port}"], httpx.Client())
    assert code == 1
    assert capsys.readouterr().err.startswith("tandem status: cannot read")
