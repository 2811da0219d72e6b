"""`tandem bench router --null-only`: the router over the null backend against a bare ASGI app,
a few requests each, no cluster. The figures are checked for presence and sign, never for speed."""

from __future__ import annotations

import json
import math
import signal
from collections.abc import Iterator

import pytest

from bench.router_overhead import main

LATENCIES = ("router_null_backend_ms", "router_null_backend_stream_ms", "bare_asgi_ms", "bare_asgi_stream_ms")
DIFFERENCES = ("router_own_ms", "router_own_stream_ms")  # router p50 - bare p50: noise may tip either way


@pytest.fixture(autouse=True)
def keep_sigterm() -> Iterator[None]:
    """main() makes SIGTERM unwind like Ctrl-C; give pytest its own handler back."""
    previous = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, previous)


def test_null_backend_figures_in_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--null-only", "--null-rounds", "5", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    for key in LATENCIES:
        assert isinstance(res[key], float) and res[key] > 0, key
        assert res[key.removesuffix("_ms") + "_p90_ms"] >= res[key]
    for key in DIFFERENCES:
        assert isinstance(res[key], float) and math.isfinite(res[key]), key
    assert not any(k.startswith(("direct_", "pd_")) for k in res)  # no cluster was started


def test_null_backend_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--null-only", "--null-rounds", "3"]) == 0
    out = capsys.readouterr().out
    assert "router over a null backend: 3 requests a path" in out
    assert "router, stream=true, read to the end" in out and "bare ASGI, whole" in out
    assert out.count("x the bare app; target <= 1 ms") == 2
