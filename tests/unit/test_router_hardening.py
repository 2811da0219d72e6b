"""Input hardening against a fake Backend: body size, priority range, chat template and tokenizer
failures, and 5xx answers that keep internals out of the client's sight."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import pytest
from pydantic import ValidationError
from tokenizers import NormalizedString, PreTokenizedString, pre_tokenizers
from tokenizers import Tokenizer as Backend
from tokenizers.models import WordLevel

from engine.outputs import TokenLogprob
from engine.tokenizer import Tokenizer
from router.app import create_app
from router.responses import NO_PROBABILITY, Shape
from router.settings import RouterSettings
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client, events

LEAKS = ("Error", "Exception", "Traceback", "not a token id", "died")


def assert_openai_error(r: Any, status: int, code: str | None = None) -> dict[str, Any]:
    assert r.status_code == status, r.text
    err: dict[str, Any] = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert r.headers["x-request-id"]
    if code is not None:
        assert err["code"] == code, err
    if status >= 500:
        assert not any(leak in err["message"] for leak in LEAKS), err["message"]
    return err


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(smollm_tokenizer)


@pytest.mark.parametrize(
    ("body", "param", "says"),
    [
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages[0].content[0].type", "'text'"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "valid string (and 1 more)"),
        ({"messages": HELLO, "stop": 5}, "stop", "valid string (and 1 more)"),
        ({"messages": [{"role": "function", "content": "x"}]}, "messages[0].role", "'tool'"),
        ({"messages": HELLO, "logit_bias": {"5": "x"}}, "logit_bias.5", "valid number"),
        ({"messages": [{"role": "user", "content": None}]}, "messages[0]", "messages[0]: content is required"),
    ],
)  # fmt: skip
def test_a_validation_error_names_the_field_the_client_wrote(
    backend: FakeBackend, body: dict[str, Any], param: str, says: str
) -> None:
    """The error pydantic got deepest into the value with, without its tags for union members."""
    err = assert_openai_error(client(backend).post(CHAT, json={"model": "fake-model", **body}), 400, "invalid_value")
    assert err["param"] == param and err["message"].startswith(f"{param}: ") and says in err["message"], err
    assert "Value error" not in err["message"], err  # pydantic's tag for a validator's own error


def asgi_post(app: Any, headers: list[tuple[bytes, bytes]], chunks: Iterator[bytes]) -> tuple[list[Any], int]:
    """POST /v1/chat/completions over raw ASGI, the body pulled chunk by chunk; (messages sent, chunks read)."""
    sent: list[Any] = []
    read = 0

    async def receive() -> dict[str, Any]:
        nonlocal read
        read += 1
        return {"type": "http.request", "body": next(chunks), "more_body": True}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {
        "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
        "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
        "server": ("127.0.0.1", 8000), "headers": [(b"content-type", b"application/json"), *headers],
    }  # fmt: skip
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    return sent, read


def test_body_over_the_limit_is_a_413_before_it_is_read(backend: FakeBackend) -> None:
    settings = RouterSettings(max_body_bytes=4096)
    app = create_app(backend, settings)

    def endless() -> Iterator[bytes]:
        while True:
            yield b" " * 1024

    sent, read = asgi_post(app, [(b"content-length", b"1000000000")], endless())
    assert sent[0]["status"] == 413 and read == 0  # refused on Content-Length alone
    assert dict(sent[0]["headers"])[b"x-request-id"]
    assert json.loads(sent[1]["body"])["error"]["code"] == "request_too_large"
    sent, read = asgi_post(app, [], endless())  # chunked: no Content-Length
    assert sent[0]["status"] == 413 and read == 5  # stopped at the first chunk past 4096 bytes
    c = client(backend, max_body_bytes=4096)
    big = {"model": "fake-model", "messages": [{"role": "user", "content": "x" * 5000}]}
    err = assert_openai_error(c.post(CHAT, json=big), 413, "request_too_large")
    assert "4096 bytes" in err["message"] and err["type"] == "invalid_request_error"
    chunked = c.post(CHAT, content=iter([json.dumps(big).encode()]), headers={"content-type": "application/json"})
    assert_openai_error(chunked, 413, "request_too_large")
    assert backend.started == []
    ok = {"model": "fake-model", "messages": HELLO, "max_tokens": 2, "ignored": "x" * 3500}
    assert len(json.dumps(ok)) < 4096 and c.post(CHAT, json=ok).status_code == 200


def test_priority_is_clamped_into_the_configured_range(backend: FakeBackend, caplog: pytest.LogCaptureFixture) -> None:
    c = client(backend, min_priority=0, max_priority=10)
    with caplog.at_level("INFO", logger="tandem.router.requests"):
        for priority in (-(10**9), 3, 10**30):
            req = {"model": "fake-model", "messages": HELLO, "max_tokens": 1, "priority": priority}
            assert c.post(CHAT, json=req).status_code == 200
    lines = [json.loads(r.message) for r in caplog.records if r.name == "tandem.router.requests"]
    assert [x["priority"] for x in lines] == [0, 3, 10]
    with pytest.raises(ValidationError):
        RouterSettings(min_priority=5, max_priority=1)


def failing_pre_tokenizer() -> pre_tokenizers.PreTokenizer:
    class Boom:
        def pre_tokenize(self, pretok: PreTokenizedString) -> None:
            def split(i: int, s: NormalizedString) -> list[NormalizedString]:
                if "boom" in str(s):
                    raise ValueError("boom inside the tokenizer")
                return [s]

            pretok.split(split)

    return pre_tokenizers.PreTokenizer.custom(Boom())


def tiny_tokenizer(chat_template: str) -> Tokenizer:
    words = {w: i for i, w in enumerate(["<unk>", "</s>", "hi", "boom", "again"])}
    backend = Backend(WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([failing_pre_tokenizer(), pre_tokenizers.Whitespace()])
    return Tokenizer(
        backend, eos_token_id=1, bos_token_id=None, stop_token_ids=frozenset(), special_token_ids=frozenset(),
        chat_template=chat_template,
    )  # fmt: skip


@pytest.mark.parametrize(
    "template,says",
    [
        ("{{ messages[0].content + 1 }}", "could not render"),  # a TypeError in the template's code
        ("{{ nothing_here() }}", "rejected these messages"),  # jinja2.UndefinedError
        ("{% if %}", "rejected these messages"),  # jinja2.TemplateSyntaxError, found on first use
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate"),
        ("{% for m in messages %}{{ m.content }}{% endfor %}", "tokenizer could not encode"),  # "boom"
    ],
)
def test_chat_template_and_tokenizer_failures_are_400(template: str, says: str) -> None:
    backend = FakeBackend(tiny_tokenizer(template), workers=[])
    c = client(backend)
    r = c.post(CHAT, json={"model": "fake-model", "messages": [{"role": "user", "content": "hi boom"}]})
    err = assert_openai_error(r, 400)
    assert err["param"] == "messages" and says in err["message"], err
    r = c.post("/v1/completions", json={"model": "fake-model", "prompt": "boom again"})
    assert assert_openai_error(r, 400)["param"] == "prompt"
    assert backend.started == [] and c.get("/health").status_code == 200


def test_worker_failures_answer_503_without_internals(backend: FakeBackend, caplog: pytest.LogCaptureFixture) -> None:
    backend.fail_before_first = {"p0", "d0"}  # with p0 alone gone, d0 would serve it whole (local)
    c = client(backend, retry_after_s=3)
    req = {"model": "fake-model", "messages": HELLO, "max_tokens": 2}
    with caplog.at_level("ERROR", logger="tandem.router"):
        r = c.post(CHAT, json=req, headers={"x-request-id": "boom-1"})
    err = assert_openai_error(r, 503, "worker_error")
    assert err["type"] == "service_unavailable" and r.headers["retry-after"] == "3"
    logged = [rec for rec in caplog.records if "boom-1" in rec.getMessage()]
    # the detail is in the log, under the request id: which worker, and how (one line: router/errors.py)
    assert logged and "WorkerDiedError: ['p0'] died" in logged[0].getMessage()
    backend.fail_before_first = set()
    backend.malformed = True
    chunks = events(c.post(CHAT, json={**req, "stream": True}).text)
    message = chunks[-1]["error"]["message"]
    assert chunks[-1]["error"]["code"] == "worker_error" and not any(leak in message for leak in LEAKS)


def test_unhandled_error_is_a_500_that_carries_the_request_id(
    backend: FakeBackend, caplog: pytest.LogCaptureFixture
) -> None:
    backend.malformed = True  # the router cannot shape the answer: an error no handler expects
    c = client(backend)
    with caplog.at_level("ERROR", logger="tandem.router"):
        r = c.post(
            CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 2}, headers={"x-request-id": "u-1"}
        )
    err = assert_openai_error(r, 500, "internal_error")
    assert r.headers["x-request-id"] == "u-1" and err["type"] == "server_error"
    assert any("u-1" in rec.getMessage() and rec.exc_info for rec in caplog.records)
    assert backend.closed == backend.started  # the stream was still closed
    backend.malformed = False
    assert c.get("/health").status_code == 200
    assert c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 2}).status_code == 200


def test_logprobs_of_no_probability_are_finite_json(backend: FakeBackend) -> None:
    shape = Shape("completion", "cmpl-1", "fake-model", backend.tokenizer)
    tok = backend.text_ids[0]
    lp = shape.logprobs([TokenLogprob(tok, float("-inf"), ((tok, float("nan")),))])
    assert lp is not None and lp["token_logprobs"] == [NO_PROBABILITY]
    assert list(lp["top_logprobs"][0].values()) == [NO_PROBABILITY]
    json.dumps(lp, allow_nan=False)
