"""A Backend for the router's unit tests: scripted workers and token streams, no Ray.

It routes with the real pure policy (cluster.routing.plan_route) over its worker dicts and
streams a fixed text, one token per output, recording what was opened and closed.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from cluster.cluster import NoWorkerError, WorkerDiedError
from cluster.outputs import Placement, StreamOutput
from cluster.routing import Route, plan_route
from cluster.worker_view import WorkerView
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.app import create_app
from router.backend import ModelInfo, ready_from, serving_from
from router.settings import RouterSettings

TEXT = " The quick brown fox jumps over the lazy dog, again and again, until the day is done."


def worker(worker_id: str, role: str, **info: Any) -> dict[str, Any]:
    base = {"worker_id": worker_id, "role": role, "state": "up", "node": "n1", "free_blocks": 64, "num_blocks": 64}
    return {**base, "running": 0, "waiting": 0, "kv_usage": 0.0, "num_preemptions": 0, "draining": False, **info}


@dataclass
class FakeBackend:
    tokenizer: Tokenizer
    max_model_len: int = 512
    workers: list[dict[str, Any]] = field(default_factory=lambda: [worker("p0", "prefill"), worker("d0", "decode")])
    desired: dict[str, int] = field(default_factory=lambda: {"prefill": 1, "decode": 1})
    fail_before_first: set[str] = field(default_factory=set)  # worker ids whose requests die at once
    gate: threading.Event | None = None  # when set up, every stream waits on it before its first token
    token_delay_s: float = 0.0
    control_error: Exception | None = None  # raised by every control-plane call: route, status, scale, drain
    malformed: bool = False  # outputs carry logprob entries the router cannot read (a backend bug)
    answer: str | None = None  # when set, every stream is this text, then "stop" (TEXT over and over if not)
    started: list[str] = field(default_factory=list)
    traceparents: list[str | None] = field(default_factory=list)  # what each generate() was handed
    closed: list[str] = field(default_factory=list)
    routes: list[Route] = field(default_factory=list)
    params: list[SamplingParams] = field(default_factory=list)  # each generate's, in order
    prompts: list[list[int]] = field(default_factory=list)  # ... and its prompt's ids
    event_log: list[tuple[str, dict[str, str]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.model = ModelInfo("fake-model", self.tokenizer, self.max_model_len, 1700000000)
        self.text_ids = self.tokenizer.encode(TEXT if self.answer is None else self.answer)

    def _control(self) -> None:
        if self.control_error is not None:
            raise self.control_error

    def route(self, prompt_ids: Sequence[int], params: SamplingParams, exclude: frozenset[str]) -> Route:
        self._control()
        views = [WorkerView.of(w["worker_id"], w) for w in self.workers if w["state"] == "up"]
        route = plan_route(views, {}, len(prompt_ids), params.max_tokens, 16, exclude=exclude)
        if route is None:
            raise NoWorkerError("no worker pair is up")
        self.routes.append(route)
        return route

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        route: Route,
        traceparent: str | None = None,
    ) -> Iterator[StreamOutput]:
        self.started.append(request_id)
        self.params.append(params)
        self.prompts.append(list(prompt_ids))
        self.traceparents.append(traceparent)
        try:
            if self.gate is not None:
                self.gate.wait(10)
            if route.workers & self.fail_before_first:
                dead = sorted(route.workers & self.fail_before_first)
                raise WorkerDiedError(f"{dead} died", dead[0])  # as the cluster names the worker it saw fail
            count = params.max_tokens if self.answer is None else min(params.max_tokens, len(self.text_ids))
            for i in range(count):
                time.sleep(self.token_delay_s)
                tok = self.text_ids[i % len(self.text_ids)]
                last = i + 1 == count
                logprobs = (
                    () if params.logprobs is None else (TokenLogprob(tok, -0.25, ((tok, -0.25),) * params.logprobs),)
                )
                if self.malformed:
                    logprobs = (TokenLogprob("not a token id", 0.0, ()),)  # type: ignore[arg-type]
                placement, scored = None, ()
                if i == 0 and params.prompt_logprobs is not None:  # -1.5 each, its rank 1; top N: it, then t + k
                    n, vocab = params.prompt_logprobs, self.tokenizer.vocab_size
                    scored = tuple(
                        TokenLogprob(t, -1.5, tuple(((t + k) % vocab, -1.5 - k) for k in range(n)), rank=1)
                        for t in prompt_ids[1:]
                    )
                if i == 0:
                    placement = Placement(
                        str(route.prefill or route.decode), route.decode, 0, 0.001, 0.01, 0.002, 4096, 0.002
                    )
                yield StreamOutput(
                    (tok,), self.tokenizer.decode([tok]), last, self._finish(i + 1) if last else None,
                    len(prompt_ids), i + 1,
                    logprobs, prompt_logprobs=scored, placement=placement,
                )  # fmt: skip
        finally:
            self.closed.append(request_id)

    def _finish(self, tokens: int) -> str:
        return "stop" if self.answer is not None and tokens == len(self.text_ids) else "length"

    def status(self) -> dict[str, Any]:
        self._control()
        return {"desired": dict(self.desired), "workers": [dict(w) for w in self.workers]}

    def scale(self, sizes: Mapping[str, int]) -> None:
        self._control()
        self.desired.update(sizes)

    def drain(self, worker_id: str) -> bool:
        self._control()
        for w in self.workers:
            if w["worker_id"] == worker_id:
                w["state"] = "draining"
                return True
        return False

    def flip(self, worker_id: str, role: str) -> bool:
        self._control()
        for w in self.workers:
            if w["worker_id"] == worker_id and w["state"] == "up":
                self.desired[w["role"]] -= 1
                self.desired[role] = self.desired.get(role, 0) + 1
                w["state"], w["role"] = "flipping", role
                return True
        return False

    def ready(self) -> bool:
        return ready_from(self.workers)

    def serving_workers(self) -> int:
        return serving_from(self.workers)

    def emit(self, kind: str, **fields: Any) -> None:
        entry = {"kind": kind, **{k: v if isinstance(v, str) else json.dumps(v) for k, v in fields.items()}}
        self.event_log.append((f"{len(self.event_log) + 1}-0", entry))

    def events(self, since: str = "0-0", count: int = 100) -> list[tuple[str, dict[str, str]]]:
        if not since:
            return self.event_log[-count:]
        after = int(since.split("-")[0])
        return [e for e in self.event_log if int(e[0].split("-")[0]) > after][:count]


CHAT = "/v1/chat/completions"
HELLO = [{"role": "user", "content": "Say hello."}]


def client(backend: FakeBackend, **settings: Any) -> TestClient:
    return TestClient(create_app(backend, RouterSettings(**settings)))


def events(text: str) -> list[Any]:
    """The JSON payloads of an SSE body, which must end with `data: [DONE]`."""
    lines = [line.removeprefix("data: ") for line in text.split("\n\n") if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def sample(metrics_text: str, name: str, labels: dict[str, str] | None = None) -> float:
    for family in text_string_to_metric_families(metrics_text):
        for s in family.samples:
            if s.name == name and (labels is None or all(s.labels.get(k) == v for k, v in labels.items())):
                return float(s.value)
    raise KeyError(name)
