"""The client side of `tandem bench chaos`: streamed chat requests, each kept whole (text, usage,
the server's timing, when every token came), run from threads so faults can be injected meanwhile.

A stream is `completed` (it ended with [DONE] and no error), `errored` (an HTTP error or an error
event), or `hung` (neither within `deadline_s`: the one outcome a client must never see).
"""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx


@dataclass
class Stream:
    prompt: str
    text: str = ""
    error: str = ""
    hung: bool = False
    done: bool = False
    prompt_tokens: int = 0
    completion_tokens: int = 0
    timing: dict[str, Any] = field(default_factory=dict)
    start: float = 0.0
    token_times: list[float] = field(default_factory=list)
    end: float = 0.0

    @property
    def completed(self) -> bool:
        return self.done and not self.error and not self.hung

    @property
    def e2e(self) -> float:
        return self.end - self.start

    @property
    def tpot(self) -> float | None:
        t = self.token_times
        return (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None

    @property
    def decode_worker(self) -> str:
        return str(self.timing.get("decode_worker") or "")


class ChatClient:
    """Greedy streamed chat completions against `url` (the router's base URL)."""

    def __init__(
        self, url: str, model: str, max_tokens: int, deadline_s: float = 180.0, speculate: bool = True
    ) -> None:
        self.url = url
        self.model = model
        self.max_tokens = max_tokens
        self.deadline_s = deadline_s
        self.speculate = speculate  # False: the requests opt out of speculative decoding

    def without_speculation(self) -> ChatClient:
        return ChatClient(self.url, self.model, self.max_tokens, self.deadline_s, speculate=False)

    def body(self, prompt: str) -> dict[str, Any]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": self.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
            "stream": True,
            "stream_options": {"include_usage": True},
            **({} if self.speculate else {"speculate": False}),
        }

    def stream(self, prompt: str, into: Stream | None = None) -> Stream:
        """One request to its end, filling `into` (a new Stream by default) as tokens come, so
        other threads can watch it."""
        s = into or Stream(prompt)
        s.start = time.monotonic()
        end = s.start + self.deadline_s
        try:
            with (
                httpx.Client(timeout=httpx.Timeout(self.deadline_s, connect=10)) as http,
                http.stream("POST", f"{self.url}/v1/chat/completions", json=self.body(prompt)) as resp,
            ):
                self._consume(s, resp, end)
        except httpx.TimeoutException:
            s.hung = True
        except httpx.HTTPError as e:
            s.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            s.end = time.monotonic()
        if not s.done and not s.error and not s.hung:
            s.error = "the stream ended without [DONE]"
        return s

    def hang_up_later(self, prompt: str) -> Callable[[], None]:
        """Send a streamed request over a raw socket; the function returned hangs up (shutdown and
        close, what a client that goes away does), whether or not anything came back yet."""
        u = httpx.URL(self.url)
        body = json.dumps(self.body(prompt)).encode()
        head = (
            f"POST /v1/chat/completions HTTP/1.1\r\nHost: {u.host}:{u.port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        sock = socket.create_connection((str(u.host), int(u.port or 80)), timeout=10)
        sock.sendall(head + body)

        def hang_up() -> None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

        return hang_up

    def _consume(self, s: Stream, resp: httpx.Response, end: float) -> None:
        if resp.status_code != 200:
            s.error = f"HTTP {resp.status_code}: {resp.read()[:200].decode(errors='replace')}"
            return
        for line in resp.iter_lines():
            if time.monotonic() > end:
                s.hung = True
                return
            self._read(s, line)
            if s.done or s.error:
                return

    @staticmethod
    def _read(s: Stream, line: str) -> None:
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            s.done = True
            return
        msg = json.loads(data)
        if "error" in msg:
            s.error = str(msg["error"].get("message", msg["error"]))[:200]
            return
        for choice in msg.get("choices") or []:
            text = (choice.get("delta") or {}).get("content")
            if text:
                s.text += text
                s.token_times.append(time.monotonic())
        if msg.get("usage"):
            s.prompt_tokens = int(msg["usage"]["prompt_tokens"])
            s.completion_tokens = int(msg["usage"]["completion_tokens"])
        if isinstance(msg.get("tandem"), dict):
            s.timing = dict(msg["tandem"].get("timing") or {})


def run_streams(
    client: ChatClient, prompts: Sequence[str], during: Callable[[list[Stream]], None] | None = None
) -> list[Stream]:
    """Send every prompt at once, each on its own thread; `during(streams)` runs meanwhile (it
    sees the streams fill in). Returns when every stream has ended (or hung past its deadline)."""
    results: list[Stream] = [Stream(p) for p in prompts]

    def one(i: int) -> None:
        client.stream(prompts[i], into=results[i])

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in threads:
        t.start()
    if during is not None:
        during(results)
    for t in threads:
        t.join(client.deadline_s + 30)
    for i, t in enumerate(threads):
        if t.is_alive():
            results[i].hung = True
    return results
