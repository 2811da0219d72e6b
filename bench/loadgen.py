"""An async load generator for any OpenAI-compatible endpoint: streamed chat / text completions.

Open loop (`rate`): requests arrive at Poisson or evenly spaced times whatever the server does.
Closed loop (`concurrency`): that many clients, each sending its next request when the last ends.
A conversation's turn waits for its previous turn in both (see bench.workloads).
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import httpx
from tqdm import tqdm

from bench.stats import RequestResult
from bench.workloads import WorkItem


@dataclass(frozen=True)
class Target:
    """Where and how to send: base URL (without /v1), model name, and request options."""

    url: str
    model: str
    api_key: str | None = None
    ignore_eos: bool = True  # a vLLM/Tandem extension: every answer runs to max_tokens
    timeout_s: float = 600.0  # per request, sending to the last byte

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def body(self, item: WorkItem) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "max_tokens": item.max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        if self.ignore_eos:
            body["ignore_eos"] = True
        if item.chat:
            body["messages"] = item.message_dicts()
        else:
            body["prompt"] = item.prompt
        return body


def base_url(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


async def first_model(url: str, api_key: str | None = None) -> str:
    """The first model `GET /v1/models` lists. Raises httpx.HTTPError, ValueError."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        resp = await client.get(f"{base_url(url)}/v1/models", headers=headers)
        resp.raise_for_status()
        data = resp.json().get("data") or []
        if not data:
            raise ValueError(f"{url}/v1/models lists no model; pass --model")
        return str(data[0]["id"])


async def send(client: httpx.AsyncClient, target: Target, item: WorkItem, t0: float) -> RequestResult:
    """One streamed request, timed. Never raises for a failed request: it comes back with ok False."""
    start = time.perf_counter()
    res = RequestResult(ok=False, start=start - t0, conv=item.conv, turn=item.turn, cls=item.cls)
    try:
        async with asyncio.timeout(target.timeout_s):
            await _stream(client, target, item, res, start)
    except TimeoutError:
        res.ok, res.error = False, f"no complete answer within {target.timeout_s:g} s"
    except (httpx.HTTPError, json.JSONDecodeError, KeyError, TypeError, ValueError) as e:
        res.ok, res.error = False, f"{type(e).__name__}: {e}"[:200]
    if not res.ok:
        res.e2e = time.perf_counter() - start
    return res


async def _stream(client: httpx.AsyncClient, target: Target, item: WorkItem, res: RequestResult, start: float) -> None:
    path = "/v1/chat/completions" if item.chat else "/v1/completions"
    first: float | None = None
    chunks = 0
    usage: dict[str, Any] | None = None
    async with client.stream(
        "POST", base_url(target.url) + path, json=target.body(item), headers=target.headers()
    ) as resp:
        if resp.status_code != 200:
            res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200].decode(errors='replace')}"
            return
        if header := resp.headers.get("x-tandem-timing"):
            res.timing = json.loads(header)
        async for line in resp.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            msg = json.loads(data)
            if "error" in msg:
                res.error = str(msg["error"].get("message", msg["error"]))[:200]
                return
            for choice in msg.get("choices") or []:
                text = (choice.get("delta") or {}).get("content") if item.chat else choice.get("text")
                if text:
                    first = first or time.perf_counter()
                    chunks += 1
                    res.text += text
            usage = msg.get("usage") or usage
            if isinstance(msg.get("tandem"), dict) and "timing" in msg["tandem"]:
                res.timing = msg["tandem"]["timing"]
    end = time.perf_counter()
    res.ok = True
    res.e2e = end - start
    res.ttft = (first or end) - start
    # Without usage, chunks stand in for tokens (exact when the server sends one token a chunk).
    res.output_tokens = int(usage["completion_tokens"]) if usage else chunks
    res.prompt_tokens = int(usage["prompt_tokens"]) if usage else 0


def arrivals(n: int, rate: float, kind: str, seed: int) -> list[float]:
    """Send times (seconds from the start) of `n` requests at `rate` per second."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    if kind == "constant":
        return [i / rate for i in range(n)]
    if kind != "poisson":
        raise ValueError(f"arrival must be poisson or constant, got {kind!r}")
    rng, t, out = random.Random(seed), 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


async def run_load(
    target: Target,
    items: Sequence[WorkItem],
    *,
    rate: float | None = None,
    concurrency: int | None = None,
    arrival: str = "poisson",
    seed: int = 0,
    duration_s: float | None = None,
    progress: bool = True,
    desc: str = "requests",
    transport: httpx.AsyncBaseTransport | None = None,
) -> tuple[list[RequestResult], float]:
    """Send `items` open-loop at `rate` or closed-loop at `concurrency` (exactly one of them);
    with `duration_s`, send no request after that many seconds. Returns the results in send
    order and the run's seconds (first send to last answer). `transport`: httpx's default
    (tests pass a mock)."""
    if (rate is None) == (concurrency is None):
        raise ValueError("give exactly one of rate and concurrency")
    done: dict[tuple[int, int], asyncio.Event] = {(i.conv, i.turn): asyncio.Event() for i in items if i.conv >= 0}
    results: list[RequestResult] = []
    answers: dict[tuple[int, int], str] = {}  # a conversation's next turn repeats the answers given
    bar = tqdm(total=len(items), desc=desc, file=sys.stderr, disable=not progress, leave=False)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    t0 = time.perf_counter()

    def late() -> bool:
        return duration_s is not None and time.perf_counter() - t0 >= duration_s

    timeout = httpx.Timeout(target.timeout_s, connect=10.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, transport=transport) as client:

        async def one(item: WorkItem) -> None:
            if item.turn > 0 and (prev := done.get((item.conv, item.turn - 1))) is not None:
                await prev.wait()
                item = item.answered([answers.get((item.conv, t), "") for t in range(item.turn)])
            try:
                if not late():
                    res = await send(client, target, item, t0)
                    results.append(res)
                    if item.conv >= 0:
                        answers[(item.conv, item.turn)] = res.text
                    bar.update(1)
            finally:
                if item.conv >= 0:
                    done[(item.conv, item.turn)].set()

        if rate is not None:
            tasks = []
            for item, at in zip(items, arrivals(len(items), rate, arrival, seed), strict=True):
                await asyncio.sleep(max(0.0, at - (time.perf_counter() - t0)))
                if late():
                    break
                tasks.append(asyncio.create_task(one(item)))
            await asyncio.gather(*tasks)
        else:
            queue = iter(items)

            async def client_loop() -> None:
                for item in queue:  # shared: each item goes to exactly one client
                    await one(item)

            assert concurrency is not None
            await asyncio.gather(*(client_loop() for _ in range(concurrency)))
    bar.close()
    results.sort(key=lambda r: r.start)
    duration = max((r.start + r.e2e for r in results), default=0.0) - min((r.start for r in results), default=0.0)
    return results, duration
