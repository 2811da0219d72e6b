"""OpenAI's `n` (router/choices.py): n choices of one prompt, whole and streamed, against the
fake backend: their indices, seeds, usage, and every run closed and slot given back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any, cast

import pytest

from cluster.outputs import StreamOutput
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.choices import Choices, Prompt
from router.dispatch import Dispatcher, Run
from router.echo import Echo
from router.settings import RouterSettings
from router.trace import Trace
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client, events


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(smollm_tokenizer)


def all_closed(backend: FakeBackend, within_s: float = 2.0) -> bool:
    """Whether every backend stream started has closed (a run's close ends its stream on its thread)."""
    end = time.monotonic() + within_s
    while sorted(backend.closed) != sorted(backend.started) and time.monotonic() < end:
        time.sleep(0.005)
    return sorted(backend.closed) == sorted(backend.started)


def prompt_len(backend: FakeBackend) -> int:
    return len(backend.tokenizer.encode(backend.tokenizer.apply_chat_template(HELLO)))


def test_n_choices_whole_with_their_seeds_and_usage(backend: FakeBackend) -> None:
    c = client(backend)
    r = c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 4, "n": 3, "seed": 5})
    assert r.status_code == 200, r.text
    body = r.json()
    one = c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 4, "seed": 5}).json()
    assert [ch["index"] for ch in body["choices"]] == [0, 1, 2]
    assert all(ch == {**one["choices"][0], "index": i} for i, ch in enumerate(body["choices"]))
    assert body["usage"]["prompt_tokens"] == prompt_len(backend)  # the prompt once
    assert body["usage"]["completion_tokens"] == 12 and body["usage"]["total_tokens"] == prompt_len(backend) + 12
    # choice i samples from seed + i: choice 0 is the n = 1 answer
    seeds = [p.seed for p in backend.params]
    assert seeds[0] == 5 and sorted(seeds[1:3]) == [6, 7] and seeds[3] == 5  # choices 1 and 2 start together
    assert json.loads(r.headers["x-tandem-timing"])["attempts"] == 1
    assert all_closed(backend) and len(backend.started) == 4
    assert c.app.state.dispatcher.admission.running == 0  # type: ignore[attr-defined]
    rid = backend.started[0].split(".")[0]  # engine ids: <request id>.<attempt>
    assert {e.split(".")[0] for e in backend.started[:3]} == {rid, f"{rid}-1", f"{rid}-2"}


def test_unseeded_choices_stay_unseeded_and_a_huge_seed_wraps(backend: FakeBackend) -> None:
    c = client(backend)
    assert c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 1, "n": 2}).status_code == 200
    assert [p.seed for p in backend.params] == [None, None]
    top = 2**64 - 1  # the largest seed a request may send
    body = {"model": "fake-model", "messages": HELLO, "max_tokens": 1, "n": 3, "seed": top}
    assert c.post(CHAT, json=body).status_code == 200
    assert [p.seed for p in backend.params[2:3]] == [top] and sorted(p.seed or 0 for p in backend.params[3:]) == [0, 1]


def test_n_choices_streamed_each_with_its_index_role_and_finish(backend: FakeBackend) -> None:
    c = client(backend)
    req: dict[str, Any] = {"model": "fake-model", "messages": HELLO, "max_tokens": 5, "n": 2}
    whole = c.post(CHAT, json=req).json()
    r = c.post(CHAT, json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200
    chunks = events(r.text)
    for i in (0, 1):
        mine = [ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == i]
        assert mine[0]["delta"]["role"] == "assistant"
        assert "".join(ch["delta"].get("content", "") for ch in mine) == whole["choices"][i]["message"]["content"]
        assert [ch["finish_reason"] for ch in mine if ch["finish_reason"]] == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert chunks[-1]["tandem"]["timing"]["prefill_worker"] == "p0"
    plain = events(c.post(CHAT, json={**req, "stream": True}).text)  # each choice's timing on its last chunk
    assert sorted(ch["choices"][0]["index"] for ch in plain if "tandem" in ch) == [0, 1]
    completions = c.post("/v1/completions", json={"model": "fake-model", "prompt": "Once", "max_tokens": 3, "n": 2})
    assert [ch["index"] for ch in completions.json()["choices"]] == [0, 1]
    assert all_closed(backend)


@pytest.mark.parametrize("n", [0, 17, -1])
def test_n_out_of_range_is_a_400(backend: FakeBackend, n: int) -> None:
    r = client(backend).post(CHAT, json={"model": "fake-model", "messages": HELLO, "n": n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n"
    assert backend.started == []


def test_a_failing_choice_fails_the_response_and_frees_every_slot(backend: FakeBackend) -> None:
    backend.fail_before_first = {"p0", "d0"}  # every route fails, on every attempt
    c = client(backend)
    for stream in (False, True):
        body = {"model": "fake-model", "messages": HELLO, "max_tokens": 3, "n": 3, "stream": stream}
        r = c.post(CHAT, json=body)
        assert r.status_code == 503 and "error" in r.json(), r.text
        assert "Traceback" not in r.text
    assert all_closed(backend)
    assert c.app.state.dispatcher.admission.running == 0  # type: ignore[attr-defined]


class HeldRun:
    """A run whose stream never ends: only `close()` ends it."""

    def __init__(self) -> None:
        self.closed = 0

    async def outputs(self) -> AsyncIterator[StreamOutput]:
        await asyncio.Event().wait()
        yield cast(StreamOutput, None)

    def close(self) -> None:
        self.closed += 1


class LateStart:
    """The Dispatcher boundary Choices calls (start, finish, settings), with a start that, once
    its first choice is out, returns its run even when cancelled, as a start whose slot was
    granted as it was cancelled could (Python 3.11's `asyncio.wait_for`)."""

    settings = RouterSettings()

    def __init__(self) -> None:
        self.runs: list[HeldRun] = []
        self.finished: list[Trace] = []

    async def start(self, ids: Sequence[int], params: SamplingParams, trace: Trace, echo: Echo | None) -> Run:
        run = HeldRun()
        self.runs.append(run)
        if len(self.runs) > 1:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.Event().wait()
        return cast(Run, run)

    def finish(self, trace: Trace) -> None:
        self.finished.append(trace)


def test_a_choice_that_starts_after_the_response_ended_is_closed() -> None:
    """Every choice's run is closed once the response ends, a run its start returned after the
    end included (it would hold its admission slot and its pump for good)."""

    async def main() -> LateStart:
        d = LateStart()
        many = Choices(cast(Dispatcher, d), [Prompt([1, 2, 3], SamplingParams())], Trace("r", "chat", True), 3)
        await many.start()
        await asyncio.sleep(0.01)  # choices 1 and 2 are starting
        many.close()  # the client left: the pumps are cancelled, and their starts return all the same
        await asyncio.sleep(0.01)
        return d

    d = asyncio.run(main())
    assert [r.closed >= 1 for r in d.runs] == [True] * 3 and len(d.finished) == 3
