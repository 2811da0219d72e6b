"""The router app against a fake Backend (tests.unit.fake_backend): the OpenAI surface, the
bad-input battery, auth, request ids, metrics and the request log."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from engine.tokenizer import Tokenizer
from router.app import create_app
from router.settings import RouterSettings
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client, events, sample, worker


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(smollm_tokenizer)


def test_chat_whole_answer_has_exact_usage_timing_and_request_id(backend: FakeBackend) -> None:
    c = client(backend)
    r = c.post(
        CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 5}, headers={"x-request-id": "abc-1"}
    )
    assert r.status_code == 200, r.text
    body = r.json()
    prompt = backend.tokenizer.encode(backend.tokenizer.apply_chat_template(HELLO))
    assert body["usage"] == {
        "prompt_tokens": len(prompt),
        "completion_tokens": 5,
        "total_tokens": len(prompt) + 5,
        "prompt_tokens_details": {"cached_tokens": 0},
    }
    assert body["choices"][0]["message"] == {
        "role": "assistant",
        "content": backend.tokenizer.decode(backend.text_ids[:5]),
    }
    assert body["choices"][0]["finish_reason"] == "length" and body["object"] == "chat.completion"
    assert r.headers["x-request-id"] == "abc-1" and body["id"] == "chatcmpl-abc-1"
    timing = json.loads(r.headers["x-tandem-timing"])
    assert timing["prefill_worker"] == "p0" and timing["decode_worker"] == "d0" and timing["attempts"] == 1
    assert timing["spec_draft_tokens"] == timing["spec_accepted_tokens"] == 0  # this backend never speculates
    assert {"queue_s", "route_s", "prefill_s", "transfer_s", "first_decode_s", "decode_s", "ttft_s", "e2e_s"} <= set(
        timing
    )
    assert backend.closed == backend.started  # the stream was closed: KV freed on the workers
    assert len(c.get("/health").headers["x-request-id"]) == 32  # generated when the client sends none


def test_chat_stream_matches_whole_and_ends_with_timing_and_usage(backend: FakeBackend) -> None:
    c = client(backend)
    req = {"model": "fake-model", "messages": HELLO, "max_tokens": 7}
    whole = c.post(CHAT, json=req).json()
    r = c.post(CHAT, json={**req, "stream": True, "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = events(r.text)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    text = "".join(ch["choices"][0]["delta"].get("content", "") for ch in chunks if ch["choices"])
    assert text == whole["choices"][0]["message"]["content"]
    assert [ch["choices"][0]["finish_reason"] for ch in chunks if ch["choices"]][-1] == "length"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    assert chunks[-1]["tandem"]["timing"]["prefill_worker"] == "p0"
    plain = events(c.post(CHAT, json={**req, "stream": True}).text)
    assert plain[-1]["choices"][0]["finish_reason"] == "length" and "timing" in plain[-1]["tandem"]


def test_completions_whole_stream_token_ids_and_logprobs(backend: FakeBackend) -> None:
    c = client(backend)
    req = {"model": "fake-model", "prompt": "Once upon a time", "max_tokens": 4, "logprobs": 2}
    body = c.post("/v1/completions", json=req).json()
    assert body["object"] == "text_completion" and body["usage"]["completion_tokens"] == 4
    lp = body["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and lp["token_logprobs"] == [-0.25] * 4 and len(lp["top_logprobs"][0]) == 1
    assert "".join(lp["tokens"]) == body["choices"][0]["text"]
    chunks = events(c.post("/v1/completions", json={**req, "stream": True}).text)
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == body["choices"][0]["text"]
    ids = backend.tokenizer.encode("Once upon a time")
    by_ids = c.post("/v1/completions", json={**req, "prompt": ids}).json()
    assert by_ids["usage"]["prompt_tokens"] == len(ids) == body["usage"]["prompt_tokens"]
    chat = c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 2, "logprobs": True,
                              "top_logprobs": 3}).json()  # fmt: skip
    content = chat["choices"][0]["logprobs"]["content"]
    assert len(content) == 2 and len(content[0]["top_logprobs"]) == 3 and content[0]["bytes"]


def test_models_health_ready(backend: FakeBackend) -> None:
    c = client(backend)
    assert c.get("/v1/models").json()["data"][0]["id"] == "fake-model"
    assert c.get("/v1/models/fake-model").json() == c.get("/v1/models").json()["data"][0]
    missing = c.get("/v1/models/org/other")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"
    assert c.get("/health").json() == {"status": "ok"}
    assert c.get("/ready").status_code == 200
    backend.workers = [worker("p0", "prefill")]
    assert c.get("/ready").status_code == 503


TOO_MANY_BIASES = {str(t): 1 for t in range(1025)}  # engine.sampling_params.MAX_LOGIT_BIAS + 1
BAD: list[tuple[str, Any, int, str | None]] = [
    (CHAT, b'{"model": "fake-model", "messages": [', 400, None),
    (CHAT, b"", 400, None),
    (CHAT, {"model": 5, "messages": HELLO}, 400, "model"),
    (CHAT, {"model": "fake-model"}, 400, "messages"),
    (CHAT, {"model": "fake-model", "messages": "hi"}, 400, "messages"),
    (CHAT, {"model": "fake-model", "messages": []}, 400, "messages"),
    (CHAT, {"model": "fake-model", "messages": [{"role": "wizard", "content": "x"}]}, 400, "messages[0].role"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "max_tokens": "ten"}, 400, "max_tokens"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "max_tokens": -1}, 400, "max_tokens"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "max_tokens": 0}, 400, "max_tokens"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "max_tokens": 10**9}, 400, "max_tokens"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "max_completion_tokens": 10**6}, 400, "max_tokens"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "temperature": 3}, 400, "temperature"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "temperature": -0.5}, 400, "temperature"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "temperature": "hot"}, 400, "temperature"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "top_p": 0}, 400, "top_p"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "top_p": 1.5}, 400, "top_p"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "min_p": 1.5}, 400, "min_p"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "min_p": -0.1}, 400, "min_p"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "n": 17}, 400, "n"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "stream": "yes"}, 400, "stream"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "top_logprobs": 50, "logprobs": True}, 400, "top_logprobs"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "presence_penalty": 2.5}, 400, "presence_penalty"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "frequency_penalty": -3}, 400, "frequency_penalty"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "repetition_penalty": 0}, 400, "repetition_penalty"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "logit_bias": {"99999999": 1}}, 400, "logit_bias"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "logit_bias": {"5": 101}}, 400, "logit_bias"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "logit_bias": TOO_MANY_BIASES}, 400, "logit_bias"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "max_tokens": 4, "min_tokens": 5}, 400, "min_tokens"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "min_tokens": -1}, 400, "min_tokens"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "logit_bias": {"5": "up"}}, 400, "logit_bias.5"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "stop": [""]}, 400, "stop"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "stop": ["x"] * 17}, 400, "stop"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "stop": "x" * 257}, 400, "stop"),
    (CHAT, {"model": "fake-model", "messages": HELLO, "priority": 1.5}, 400, "priority"),
    (CHAT, b'{"model": "fake-model", "messages": [{"role": "user", "content": "a\\ud800"}]}', 400, "messages"),
    (CHAT, b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
    ("/v1/completions", b'{"model": "fake-model", "prompt": "\\udfff"}', 400, "prompt"),
    (CHAT, {"model": "gpt-9", "messages": HELLO}, 404, "model"),
    (CHAT, {"model": "fake-model", "messages": [{"role": "user", "content": "word " * 600}]}, 413, "messages"),
    ("/v1/completions", {"model": "fake-model", "prompt": "x " * 600}, 413, "prompt"),
    ("/v1/completions", {"model": "fake-model", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "fake-model", "prompt": [10**7]}, 400, "prompt"),
    ("/v1/completions", {"model": "fake-model", "prompt": ["a"] * 17, "n": 4}, 400, "prompt"),
    ("/v1/completions", {"model": "fake-model", "prompt": [[1, 2], []]}, 400, "prompt"),
    ("/v1/completions", {"model": "fake-model", "prompt": ["a", "x " * 600]}, 413, "prompt"),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "fake-model", "prompt": "hi", "echo": True, "logprobs": 21}, 400, "logprobs"),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input_gets_an_openai_error(
    backend: FakeBackend, path: str, body: Any, status: int, param: str | None
) -> None:
    c = client(backend)
    kwargs: dict[str, Any] = {"content": body} if isinstance(body, bytes) else {"json": body}
    r = c.post(path, headers={"content-type": "application/json"}, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param
    assert r.headers["x-request-id"]
    assert backend.started == []  # nothing reached the workers
    assert c.get("/ready").status_code == 200


def test_api_keys(backend: FakeBackend) -> None:
    c = client(backend, api_keys=("k1", "k2"))
    req = {"model": "fake-model", "messages": HELLO, "max_tokens": 1}
    assert c.post(CHAT, json=req).status_code == 401
    r = c.post(CHAT, json=req, headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert c.post(CHAT, json=req, headers={"Authorization": "Bearer k2"}).status_code == 200
    assert c.get("/v1/models", headers={"Authorization": "Bearer k1"}).status_code == 200
    assert c.get("/health").status_code == 200 and c.get("/metrics").status_code == 200


def test_admin_auth_and_operations(backend: FakeBackend) -> None:
    assert client(backend).get("/admin/pools").status_code == 403  # no token: disabled
    app = create_app(backend, RouterSettings(allow_loopback_admin=True))
    assert TestClient(app, client=("127.0.0.1", 5000)).get("/admin/pools").status_code == 200
    assert TestClient(app, client=("10.0.0.7", 5000)).get("/admin/pools").status_code == 403
    c = client(backend, admin_token="s3cret")
    assert c.get("/admin/pools").status_code == 401
    assert c.get("/admin/pools", headers={"Authorization": "Bearer wrong"}).status_code == 401
    c.headers["Authorization"] = "Bearer s3cret"
    pools = c.get("/admin/pools").json()
    assert pools["up"] == {"prefill": 1, "decode": 1, "colocated": 0}
    assert {w["worker_id"] for w in pools["workers"]} == {"p0", "d0"} and "kv_usage" in pools["workers"][0]
    assert c.post("/admin/pools/decode", json={"replicas": 2}).json() == {"role": "decode", "replicas": 2}
    assert backend.desired["decode"] == 2
    assert c.post("/admin/pools/decode", json={"replicas": -1}).status_code == 400
    assert c.post("/admin/pools/decode", json={"replicas": 1000}).status_code == 400
    assert c.post("/admin/pools/gpu", json={"replicas": 1}).status_code == 404
    assert c.post("/admin/rebalance", json={"prefill": 3, "decode": 1}).status_code == 200
    assert backend.desired == {"prefill": 3, "decode": 1}
    assert c.post("/admin/workers/d0/drain").json()["state"] == "draining"
    assert c.post("/admin/workers/zz/drain").status_code == 404


def test_metrics_move_with_traffic(backend: FakeBackend) -> None:
    c = client(backend)
    before = c.get("/metrics").text
    assert sample(before, "tandem:generation_tokens_total") == 0
    c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 4})
    c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 3, "stream": True})
    c.post(CHAT, json={"model": "nope", "messages": HELLO})
    after = c.get("/metrics").text
    assert sample(after, "tandem:generation_tokens_total") == 7
    assert sample(after, "tandem:time_to_first_token_seconds_count") == 2
    assert sample(after, "tandem:inter_token_latency_seconds_count") == 5
    assert sample(after, "tandem:e2e_request_latency_seconds_count") == 2
    assert sample(after, "tandem:kv_transfer_bytes_sum") == 2 * 4096
    assert sample(after, "tandem:request_success_total", {"finished_reason": "length"}) == 2
    assert sample(after, "tandem:request_rejected_total", {"status": "404"}) == 1
    assert sample(after, "tandem:kv_cache_usage_perc", {"worker": "d0"}) == 0.0


def test_penalties_logit_bias_and_min_p_reach_the_backend_and_null_is_unset(backend: FakeBackend) -> None:
    c = client(backend)
    body = {"model": "fake-model", "messages": HELLO, "max_tokens": 2, "presence_penalty": 0.5, "frequency_penalty": -1,
            "repetition_penalty": 1.2, "logit_bias": {"42": -100, "7": 2.5}, "min_tokens": 2,
            "min_p": 0.05}  # fmt: skip
    assert c.post(CHAT, json=body).status_code == 200
    assert c.post("/v1/completions", json={"model": "fake-model", "prompt": "Hi", "max_tokens": 2}).status_code == 200
    nulls = {"temperature": None, "top_p": None, "presence_penalty": None, "logit_bias": None, "n": None, "stop": None}
    for extra in ({}, nulls):
        assert (
            c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 2, **extra}).status_code == 200
        )
    assert c.post(CHAT, json={"model": 5, "messages": HELLO}).json()["error"]["param"] == "model"
    got, plain, left_out, null = backend.params
    assert null == left_out, "null is the default"
    assert (got.presence_penalty, got.frequency_penalty, got.repetition_penalty) == (0.5, -1.0, 1.2)
    assert got.logit_bias == ((42, -100.0), (7, 2.5)) and got.min_tokens == 2
    assert (got.min_p, plain.min_p) == (0.05, 0.0)
    assert got.penalized and not plain.penalized


def test_speculation_opt_out_reaches_the_backend_and_worker_counters_are_exported(backend: FakeBackend) -> None:
    spec = {"spec_decode_num_drafts": 3, "spec_decode_num_draft_tokens": 9, "spec_decode_num_accepted_tokens": 6}
    backend.workers[1].update(spec, spec_decode_num_accepted_tokens_per_pos=[3, 2, 1], num_preemptions=4)
    c = client(backend)
    c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 2, "speculate": False})
    c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 2})
    assert [p.speculate for p in backend.params] == [False, True]
    text = c.get("/metrics").text
    assert sample(text, "tandem:spec_decode_num_draft_tokens", {"worker": "d0"}) == 9
    assert sample(text, "tandem:spec_decode_num_accepted_tokens", {"worker": "d0"}) == 6
    assert sample(text, "tandem:spec_decode_num_accepted_tokens_per_pos", {"worker": "d0", "position": "1"}) == 2
    assert sample(text, "tandem:num_preemptions", {"worker": "d0"}) == 4  # KV pressure, from the heartbeat


def test_one_json_log_line_per_request(backend: FakeBackend, caplog: pytest.LogCaptureFixture) -> None:
    c = client(backend)
    with caplog.at_level("INFO", logger="tandem.router.requests"):
        c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 2, "user": "u1"},
               headers={"x-request-id": "log-1"})  # fmt: skip
        c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "n": 17}, headers={"x-request-id": "log-2"})
    lines = [json.loads(r.message) for r in caplog.records if r.name == "tandem.router.requests"]
    assert [(x["request_id"], x["status"]) for x in lines] == [("log-1", 200), ("log-2", 400)]
    assert lines[0]["user"] == "u1" and lines[0]["completion_tokens"] == 2 and lines[0]["timing"]["prefill_worker"]


def test_a_chats_earlier_answers_reach_the_engine_as_decoded_spans(backend: FakeBackend) -> None:
    """Each assistant message's tokens, found in the templated prompt after the messages before
    it (a user quoting it does not count): the engine runs them as decode rows
    (SamplingParams.decoded), so a turn's answer does not depend on the cache."""
    answers = ["Paris is the capital of France.", "About 2.1 million people live there."]
    messages = [{"role": "user", "content": f"Say '{answers[0]}'"}, {"role": "assistant", "content": answers[0]},
                {"role": "user", "content": "How many live there?"}, {"role": "assistant", "content": answers[1]},
                {"role": "user", "content": "Thanks!"}]  # fmt: skip
    c = client(backend)
    assert c.post(CHAT, json={"model": "fake-model", "messages": messages, "max_tokens": 2}).status_code == 200
    tok = backend.tokenizer
    ids = tok.encode(tok.apply_chat_template(messages))
    spans = backend.params[-1].decoded
    assert not backend.params[-1].decoded_as_prompt  # run as decode rows
    assert [tok.decode(ids[a:b]) for a, b in spans] == answers
    assert spans[0][0] == len(tok.encode(tok.apply_chat_template(messages[:1])))  # where turn 1 answered, not the quote
    assert c.post(CHAT, json={"model": "fake-model", "messages": HELLO, "max_tokens": 2}).status_code == 200
    assert backend.params[-1].decoded == ()  # no earlier answer
    fast = client(backend, exact_history=False)  # tandem serve --fast-history: marked, to be prefilled
    assert fast.post(CHAT, json={"model": "fake-model", "messages": messages, "max_tokens": 2}).status_code == 200
    assert backend.params[-1].decoded == spans and backend.params[-1].decoded_as_prompt


def test_a_long_chats_answers_are_marked_without_rendering_its_history_again_for_each(
    backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """100 turns through SmolLM2's template, one answer quoted by a user: every answer marked, by
    one more render of the chat. Rendering the history before each answer cost O(turns^2), and
    reading the tokenizer's offsets for each token O(tokens^2): 15 s to tokenize a 200-turn chat."""
    answers = [f"Answer {t}: it rains in town {t}." for t in range(100)]
    messages = [{"role": "user", "content": f"Question {t}?"} for t in range(100)]
    messages = [m for q, a in zip(messages, answers, strict=True) for m in (q, {"role": "assistant", "content": a})]
    messages[-2] = {"role": "user", "content": f"You said '{answers[40]}'. Why?"}
    room = {"free_blocks": 1024, "num_blocks": 1024}
    long = FakeBackend(backend.tokenizer, 1 << 16, [worker("p0", "prefill", **room), worker("d0", "decode", **room)])
    tok = long.tokenizer
    renders: list[int] = []
    render = tok.apply_chat_template

    def counted(msgs: Any, add_generation_prompt: bool = True, variables: Any = None) -> str:
        renders.append(len(msgs))
        return render(msgs, add_generation_prompt, variables)

    monkeypatch.setattr(tok, "apply_chat_template", counted)
    c = client(long)
    assert c.post(CHAT, json={"model": "fake-model", "messages": messages, "max_tokens": 2}).status_code == 200
    ids = tok.encode(render(messages))
    assert [tok.decode(ids[a:b]) for a, b in long.params[-1].decoded] == answers
    assert renders == [len(messages)] * 2, "the chat, then the chat with placeholders (router/answer_marks.py)"


def test_a_prompt_far_past_the_context_is_refused_before_it_is_tokenized(
    backend: FakeBackend, monkeypatch: pytest.MonkeyPatch
) -> None:
    """More characters than the context's tokens could cover (81 a token, the longest): a 413 at
    once, where counting a 2 MB prompt's tokens took 0.7-1.4 s. Just past the context, the exact
    count, as before."""
    tok = backend.tokenizer
    encoded: list[int] = []
    encode = tok.encode
    monkeypatch.setattr(tok, "encode", lambda text: encoded.append(len(text)) or encode(text))
    c = client(backend)
    far = "word " * (81 * 512 // 5 + 1)  # 512: the fake backend's context
    r = c.post("/v1/completions", json={"model": "fake-model", "prompt": far, "max_tokens": 2})
    assert r.status_code == 413 and "at least 513 tokens" in r.json()["error"]["message"] and encoded == []
    r = c.post(CHAT, json={"model": "fake-model", "messages": [{"role": "user", "content": far}], "max_tokens": 2})
    assert r.status_code == 413 and r.json()["error"]["param"] == "messages" and encoded == []
    near = "word " * 600
    r = c.post("/v1/completions", json={"model": "fake-model", "prompt": near, "max_tokens": 2})
    assert r.status_code == 413 and "the prompt has 601 tokens" in r.json()["error"]["message"], r.json()
    assert encoded == [len(near)]
