"""The sweep's points below its planned rates, against a scripted server (httpx.MockTransport):
where the lowest rate misses the SLO target, it halves the rate until one meets it."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import httpx

from bench.loadgen import Target
from bench.stats import SLO
from bench.sweep import sweep
from bench.workloads import MIXES

TARGET = Target("http://bench.test/v1", "m")
SLOW_S = 0.05  # a token every SLOW_S: misses the SLO below
STOP = SLO(ttft_s=0.04, tpot_s=0.04)


def stream(delay: float) -> AsyncIterator[bytes]:
    async def gen() -> AsyncIterator[bytes]:
        for text in ("a", "b"):
            await asyncio.sleep(delay)
            yield f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': text}}]})}\n\n".encode()
        yield b"data: [DONE]\n\n"

    return gen()


def server(slow_requests: int) -> tuple[httpx.MockTransport, list[int]]:
    """The first `slow_requests` requests are slow, the rest answer at once."""
    seen = [0]

    async def handler(req: httpx.Request) -> httpx.Response:
        seen[0] += 1
        return httpx.Response(200, content=stream(SLOW_S if seen[0] <= slow_requests else 0.0))

    return httpx.MockTransport(handler), seen


def run(slow_requests: int) -> tuple[list[tuple[float, int, int]], int]:
    transport, seen = server(slow_requests)
    points = sweep(TARGET, MIXES["chat"], [40.0], STOP, 4, 1.0, 0, progress=False, transport=transport)
    return [(p.rate, p.index, len(p.results)) for p in points], seen[0]


def test_a_lowest_rate_that_misses_the_target_is_followed_by_one_at_half_the_rate() -> None:
    points, sent = run(slow_requests=4)  # the planned point misses; the first below meets it
    assert points == [(20.0, -1, 4), (40.0, 0, 4)] and sent == 8


def test_the_sweep_goes_down_at_most_the_floor_s_count_of_points() -> None:
    points, sent = run(slow_requests=1000)
    assert points == [(10.0, -2, 4), (20.0, -1, 4), (40.0, 0, 4)] and sent == 12


def test_a_lowest_rate_that_meets_the_target_adds_nothing() -> None:
    assert run(slow_requests=0) == ([(40.0, 0, 4)], 4)
