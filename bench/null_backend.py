"""The two servers `tandem bench router` times the router's own work with, no cluster under either.

NullBackend   a router Backend with one colocated worker that answers every request at once with
              COMPLETION's tokens, one StreamOutput a token: no Ray, no sleeps, no state. The real
              router app served over it does all of its per-request work and waits on nothing.
BareApp       the floor under the router: a raw ASGI app that reads a request's body and answers
              with the bytes the router answered the same request with. Served by the same uvicorn,
              it costs the HTTP server, the loopback and the client; the router's own work is what
              the router takes beyond it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from starlette.types import Receive, Scope, Send

from cluster.outputs import Placement, StreamOutput
from cluster.routing import Route
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.backend import ModelInfo

COMPLETION = " Red, orange, yellow."
WORKER = "null-0"


class NullBackend:
    """A Backend over one always-idle colocated worker (see the module docstring)."""

    def __init__(self, tokenizer: Tokenizer, name: str = "null", max_model_len: int = 2048) -> None:
        self.model = ModelInfo(name, tokenizer, max_model_len, 0)
        ids = tokenizer.encode(COMPLETION)
        self._tokens = [(t, tokenizer.decode([t])) for t in ids]

    def route(self, prompt_ids: Sequence[int], params: SamplingParams, exclude: frozenset[str]) -> Route:
        return Route(WORKER)

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        route: Route,
        traceparent: str | None = None,
    ) -> Iterator[StreamOutput]:
        """COMPLETION's tokens, or its first `params.max_tokens`; the first output with a Placement."""
        n = min(params.max_tokens, len(self._tokens))
        reason = "length" if n == params.max_tokens else "stop"
        for i, (tok, text) in enumerate(self._tokens[:n]):
            last = i + 1 == n
            placement = Placement(WORKER, WORKER) if i == 0 else None
            yield StreamOutput(
                (tok,), text, last, reason if last else None, len(prompt_ids), i + 1, placement=placement
            )  # fmt: skip

    def status(self) -> dict[str, Any]:
        worker = {"worker_id": WORKER, "role": "colocated", "state": "up", "node": "local", "running": 0,
                  "waiting": 0, "free_blocks": 1, "num_blocks": 1, "kv_usage": 0.0, "draining": False}  # fmt: skip
        return {"desired": {"colocated": 1}, "workers": [worker]}

    def scale(self, sizes: Mapping[str, int]) -> None:
        raise RuntimeError("the null backend has one fixed worker: it cannot scale")

    def drain(self, worker_id: str) -> bool:
        return False

    def flip(self, worker_id: str, role: str) -> bool:
        return False

    def ready(self) -> bool:
        return True

    def serving_workers(self) -> int:
        return 1

    def emit(self, kind: str, **fields: Any) -> None:
        pass  # no cluster, no events

    def events(self, since: str = "0-0", count: int = 100) -> list[tuple[str, dict[str, str]]]:
        return []


class BareApp:
    """A raw ASGI app: any POST gets `whole` as a JSON body, or, when its JSON body says
    `"stream": true`, `events` as SSE, one body message an event as the router sends them."""

    def __init__(self, whole: bytes, events: Sequence[bytes]) -> None:
        self.whole = whole
        self.events = list(events)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        body = b""
        more = True
        while more:
            message = await receive()
            body += message.get("body", b"")
            more = message.get("more_body", False)
        if json.loads(body or b"{}").get("stream"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8")]})  # fmt: skip
            for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b""})
            return
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(self.whole)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": self.whole})
