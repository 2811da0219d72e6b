"""A burst of mixed, valid requests through a real router, some of whose clients leave early:
what an API gateway in front of Tandem sends on a busy minute. Each request that is read to
its end is checked (2xx, no error event, the stream ends with [DONE], the choices it asked for)."""

from __future__ import annotations

import asyncio
import json
import random
from dataclasses import dataclass, field
from typing import Any

import httpx

GUIDES: list[dict[str, Any]] = [
    {"response_format": {"type": "json_object"}},
    {"guided_choice": ["yes", "no"]},
    {"guided_regex": "[0-9]{2,5}"},
]


@dataclass
class Burst:
    sent: int = 0
    left: int = 0  # clients that hung up early
    failures: list[str] = field(default_factory=list)


def _request(rng: random.Random, model: str, i: int) -> tuple[str, dict[str, Any]]:
    body: dict[str, Any] = {"model": model, "max_tokens": rng.choice([1, 8, 24]), "n": rng.choice([1, 1, 2, 3]),
                            "temperature": rng.choice([0, 0.8]), "seed": i, "stream": rng.random() < 0.6}  # fmt: skip
    if i % 2:
        body["messages"] = [{"role": "user", "content": rng.choice(["Hi", "Name a fruit.", "Is the sea blue?"])}]
        if rng.random() < 0.3:
            body |= {"logprobs": True, "top_logprobs": 2}
        path = "/v1/chat/completions"
    else:
        body["prompt"] = rng.choice(["Once upon a time", ["a b c", "d e f"], [1, 2, 3, 4]])
        if rng.random() < 0.3:
            body |= {"echo": True, "logprobs": 1}
        path = "/v1/completions"
    if i % 3 == 0:
        body |= GUIDES[(i // 3) % len(GUIDES)]  # each guide comes back: the worker's tree drafts whole answers
    if body["stream"] and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    return path, body


async def _one(client: httpx.AsyncClient, url: str, path: str, body: dict[str, Any], leave: int | None,
               out: Burst) -> None:  # fmt: skip
    what = f"{path} {json.dumps(body)[:200]}"
    if body["stream"]:
        async with client.stream("POST", url + path, json=body) as r:
            lines = []
            async for line in r.aiter_lines():
                lines.append(line)
                if leave is not None and len(lines) > leave:
                    out.left += 1
                    return
        text = "\n".join(lines)
        if r.status_code != 200 or '"error"' in text or "data: [DONE]" not in lines:
            out.failures.append(f"{what}: {r.status_code} {text[-300:]}")
        return
    if leave is not None:
        try:
            await asyncio.wait_for(client.post(url + path, json=body), 0.05 * (1 + leave))
        except TimeoutError:
            out.left += 1
        return
    r = await client.post(url + path, json=body)
    prompts = len(body["prompt"]) if isinstance(body.get("prompt"), list) and isinstance(body["prompt"][0], str) else 1
    if r.status_code != 200 or len(r.json()["choices"]) != body["n"] * prompts:
        out.failures.append(f"{what}: {r.status_code} {r.text[:300]}")


async def burst(url: str, model: str, requests: int, concurrency: int, seed: int) -> Burst:
    """`requests` requests, `concurrency` at a time; a quarter of the clients leave early."""
    rng = random.Random(seed)
    plan = [(*_request(rng, model, i), rng.choice([0, 2, 5]) if rng.random() < 0.25 else None) for i in range(requests)]
    out = Burst(sent=requests)
    gate = asyncio.Semaphore(concurrency)

    async def guarded(path: str, body: dict[str, Any], leave: int | None) -> None:
        async with gate:
            try:
                await _one(client, url, path, body, leave, out)
            except httpx.HTTPError as e:
                out.failures.append(f"{path}: {e!r}")

    async with httpx.AsyncClient(timeout=120) as client:
        await asyncio.gather(*(guarded(*p) for p in plan))
    return out
