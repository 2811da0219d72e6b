"""5xx answers carry one short safe line from router.errors.client_message, whole or streamed;
the exception itself, traceback and all, goes to the server log."""

from __future__ import annotations

from collections.abc import Generator, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pytest
import ray.exceptions
from fastapi import HTTPException
from fastapi.testclient import TestClient

from cluster.cluster import NoWorkerError
from cluster.outputs import StreamOutput
from cluster.request_run import EngineFailedError, WorkerDiedError
from cluster.routing import Route
from cluster.state import StateUnavailable
from engine.errors import InvalidRequestError, PromptTooLongError
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.app import create_app
from router.errors import (
    INTERNAL,
    MAX_MESSAGE,
    NO_WORKER,
    STATE_DOWN,
    WORKERS_FAILED,
    APIError,
    as_api_error,
    client_message,
)
from router.settings import RouterSettings
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client, events

RAY_DUMP = (
    "\x1b[36mray::PrefillWorker.prefill()\x1b[39m (pid=4242, ip=10.0.0.7)\n"
    "Traceback (most recent call last):\n"
    '  File "/work/main/cluster/request_run.py", line 88, in run\n'
    "    first = stream.get(10)\n"
    "ray.exceptions.GetTimeoutError: Get timed out: some object(s) not ready."
)
TIMEOUT = "the workers did not answer in time; retry later"
WORKER_LOST = "a worker stopped or stopped answering while serving this request; retry later"
ENGINE_FAILED = "the engine failed on this request; the server log has the details under this response's x-request-id"
REQUEST = {"model": "fake-model", "messages": HELLO, "max_tokens": 6}


def ray_task_error(cause: Exception) -> Exception:
    """What a Ray task that raised `cause` raises in its caller: RayTaskError(Cause), a multi-line dump."""
    try:
        raise cause
    except Exception as e:
        dump = RAY_DUMP.split("\n", 1)[1]
        error = ray.exceptions.RayTaskError("prefill", dump, e, proctitle="ray::Worker.prefill")  # type: ignore[no-untyped-call]
        wrapped: Exception = error.as_instanceof_cause()  # type: ignore[no-untyped-call]
        return wrapped


def assert_safe(message: str) -> None:
    assert message and "\n" not in message and len(message) <= MAX_MESSAGE
    assert not any(leak in message for leak in ("Traceback", "ray::", "File ", "Error", "\x1b", "pid=")), message


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (RuntimeError(RAY_DUMP), WORKERS_FAILED),
        (ray_task_error(ray.exceptions.GetTimeoutError("Get timed out")), TIMEOUT),
        (ray.exceptions.GetTimeoutError(RAY_DUMP), TIMEOUT),
        (ray_task_error(RuntimeError("boom")), WORKERS_FAILED),
        (ray.exceptions.ActorDiedError(), WORKER_LOST),
        (WorkerDiedError("the request failed before its first token: worker d0 did not answer for 5.0 s"), WORKER_LOST),
        (StateUnavailable(f"redis://10.0.0.7:6379 refused\n{RAY_DUMP}"), STATE_DOWN),
        (NoWorkerError("no prefill + decode pair is up"), "no prefill + decode pair is up"),  # written for clients
        (NoWorkerError(f"no pair is up\n{RAY_DUMP}"), NO_WORKER),
        (ray_task_error(NoWorkerError("no decode worker has room")), "no decode worker has room"),
        (APIError(503, "first line\nsecond line"), "first line"),
        (HTTPException(502, RAY_DUMP), WORKERS_FAILED),
    ],
)
def test_client_message_is_one_safe_line(exc: Exception, message: str) -> None:
    assert client_message(exc) == message
    assert_safe(client_message(exc))


def test_client_message_caps_length_and_keeps_the_callers_default() -> None:
    long = client_message(NoWorkerError("no worker " * 100))
    assert len(long) == MAX_MESSAGE and long.endswith("...")
    assert client_message(KeyError("x"), INTERNAL) == INTERNAL
    assert client_message(NoWorkerError("\x1b[31mno worker\x1b[39m")) == NO_WORKER
    assert APIError(502, RAY_DUMP).message == INTERNAL and APIError(400, "a\nb").message == "a\nb"  # 5xx only


def test_a_workers_refusal_is_answered_with_its_own_text() -> None:
    """A request a worker refuses (a regex the grammar compiler rejects, a prompt over its
    context) comes back as RayTaskError(Cause): the answer is the cause's message, not Ray's dump."""
    why = "the regex guide cannot be used: the parenthesis is not closed"
    refused = as_api_error(ray_task_error(InvalidRequestError(why, "response_format")))
    assert (refused.status, refused.message, refused.param) == (400, why, "response_format")
    too_long = as_api_error(ray_task_error(PromptTooLongError("the prompt is 9000 tokens", "prompt")))
    assert (too_long.status, too_long.message, too_long.param) == (413, "the prompt is 9000 tokens", "prompt")
    assert as_api_error(InvalidRequestError("bad", "n")).message == "bad"


@dataclass
class FailingBackend(FakeBackend):
    """A FakeBackend whose token streams raise `failure` after `fail_after` outputs."""

    failure: Exception | None = None
    fail_after: int = 0

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        route: Route,
        traceparent: str | None = None,
    ) -> Iterator[StreamOutput]:
        outputs = super().generate(prompt_ids, params, request_id, route, traceparent)
        try:
            for i, out in enumerate(outputs):
                if i == self.fail_after and self.failure is not None:
                    raise self.failure
                yield out
        finally:
            if isinstance(outputs, Generator):
                outputs.close()


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FailingBackend:
    return FailingBackend(smollm_tokenizer, failure=ray_task_error(ray.exceptions.GetTimeoutError(RAY_DUMP)))


def openai_error(body: Any, code: str | None) -> str:
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == code, err
    message: str = err["message"]
    assert_safe(message)
    return message


def test_a_ray_dump_before_the_first_token_is_a_503_with_one_line(
    backend: FailingBackend, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level("ERROR", logger="tandem.router"):
        r = client(backend, retry_after_s=2).post(CHAT, json=REQUEST, headers={"x-request-id": "dump-1"})
    assert r.status_code == 503 and r.headers["retry-after"] == "2"
    assert openai_error(r.json(), "worker_error") == TIMEOUT
    logged = [rec.exc_info for rec in caplog.records if "dump-1" in rec.getMessage() and rec.exc_info]
    assert logged and logged[0] and logged[0][1] is backend.failure  # the log has it whole, under the request id


def test_a_lost_worker_is_logged_in_one_line_and_a_bug_with_its_traceback(
    backend: FailingBackend, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker that died or froze under a request is an event of the cluster, not of the router's
    code: its text names the worker and how, and the router's stack would add 25 lines to each."""
    backend.failure = WorkerDiedError("the request failed before its first token: worker p7 died (ActorDiedError)")
    with caplog.at_level("ERROR", logger="tandem.router"):
        r = client(backend).post(CHAT, json=REQUEST, headers={"x-request-id": "lost-1"})
        backend.failure = RuntimeError("a bug")
        client(backend).post(CHAT, json=REQUEST, headers={"x-request-id": "bug-1"})
    assert r.status_code == 503 and openai_error(r.json(), "worker_error") == WORKER_LOST
    (lost,) = [rec for rec in caplog.records if "lost-1" in rec.getMessage()]
    assert lost.exc_info is None and "WorkerDiedError: the request failed" in lost.getMessage()
    assert "worker p7 died (ActorDiedError)" in lost.getMessage()
    (bug,) = [rec for rec in caplog.records if "bug-1" in rec.getMessage()]
    assert bug.exc_info and bug.exc_info[1] is backend.failure


def test_a_failure_mid_stream_ends_with_the_same_safe_message(backend: FailingBackend) -> None:
    backend.fail_after = 3
    chunks = events(client(backend).post(CHAT, json={**REQUEST, "stream": True}).text)
    texts = [c["choices"][0]["delta"].get("content") for c in chunks[:-1]]
    assert len([t for t in texts if t]) == 3  # the tokens before the failure were delivered
    assert openai_error(chunks[-1], "worker_error") == TIMEOUT
    backend.failure = RuntimeError(RAY_DUMP)
    chunks = events(client(backend).post("/v1/completions", json={**REQUEST, "prompt": "hi", "stream": True}).text)
    assert openai_error(chunks[-1], "worker_error") == WORKERS_FAILED
    assert backend.closed == backend.started


def test_an_engine_that_failed_on_the_request_is_a_500_that_says_so(backend: FailingBackend) -> None:
    """Not "a worker stopped" (it did not) nor a Retry-After: a bug the request sets off fails it again."""
    backend.failure = EngineFailedError(f"the request failed before its first token: worker d1: {RAY_DUMP}", "d1")
    r = client(backend).post(CHAT, json=REQUEST)
    assert r.status_code == 500 and "retry-after" not in r.headers
    assert openai_error(r.json(), "engine_error") == ENGINE_FAILED
    backend.fail_after = 2
    chunks = events(client(backend).post(CHAT, json={**REQUEST, "stream": True}).text)
    assert openai_error(chunks[-1], "engine_error") == ENGINE_FAILED


def test_a_no_worker_error_with_a_dump_is_a_503_without_it(backend: FailingBackend) -> None:
    backend.control_error = NoWorkerError(f"no worker pair is up\n{RAY_DUMP}")
    r = client(backend).post(CHAT, json=REQUEST)
    assert r.status_code == 503 and openai_error(r.json(), "no_worker") == NO_WORKER
    backend.control_error = ray_task_error(NoWorkerError("no decode worker has room"))
    r = client(backend).post(CHAT, json=REQUEST)
    assert openai_error(r.json(), "no_worker") == "no decode worker has room"


def test_a_5xx_http_exception_keeps_its_text_out(backend: FailingBackend) -> None:
    app = create_app(backend, RouterSettings())

    @app.get("/boom")
    async def boom() -> None:
        raise HTTPException(500, RAY_DUMP)

    r = TestClient(app).get("/boom")
    assert r.status_code == 500 and openai_error(r.json(), None) == INTERNAL
