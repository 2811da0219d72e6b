"""/v1/completions against the fake backend, whose workers score each prompt token -1.5 (the
token itself its top 1): `echo` (router/echo.py), the prompt in front of the text and of the
logprobs, the first token's null, `max_tokens: 0`, streams, n > 1, a prompt of token ids as
lm-evaluation-harness sends it; a list of prompts, answered as choices (router/choices.py); and
`response_format` (structured output, engine/grammar.py), for chat too."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import pytest

from engine.grammar import Guide
from engine.tokenizer import Tokenizer
from router.responses import OFF_LOOP_ENTRIES, off_loop_if_large
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client, events, worker

COMPLETIONS = "/v1/completions"
PROMPT = "The capital of France is"


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(smollm_tokenizer)


def post(backend: FakeBackend, **body: Any) -> dict[str, Any]:
    r = client(backend).post(COMPLETIONS, json={"model": "fake-model", "prompt": PROMPT, **body})
    assert r.status_code == 200, r.text
    out: dict[str, Any] = r.json()
    return out


def test_echo_puts_the_prompt_before_the_answer_and_its_logprobs(backend: FakeBackend) -> None:
    tok = backend.tokenizer
    ids = tok.encode(PROMPT)
    body = post(backend, max_tokens=3, echo=True, logprobs=1)
    (choice,) = body["choices"]
    answer = tok.decode(backend.text_ids[:3])
    assert choice["text"] == PROMPT + answer
    lp = choice["logprobs"]
    assert len(lp["tokens"]) == len(ids) + 3
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None, "nothing predicts the first token"
    assert lp["token_logprobs"][1 : len(ids)] == [-1.5] * (len(ids) - 1)
    assert lp["token_logprobs"][len(ids) :] == [-0.25] * 3
    assert lp["top_logprobs"][1] == {tok.decode([ids[1]], skip_special_tokens=False): -1.5}
    assert lp["text_offset"][0] == 0 and lp["text_offset"][len(ids)] == len(PROMPT)
    assert body["usage"]["prompt_tokens"] == len(ids) and body["usage"]["completion_tokens"] == 3
    assert backend.params[0].prompt_logprobs == 1


def test_echo_without_logprobs_asks_the_engine_for_none(backend: FakeBackend) -> None:
    body = post(backend, max_tokens=2, echo=True)
    assert body["choices"][0]["text"] == PROMPT + backend.tokenizer.decode(backend.text_ids[:2])
    assert body["choices"][0]["logprobs"] is None and backend.params[0].prompt_logprobs is None
    plain = post(backend, max_tokens=2, logprobs=1)  # logprobs without echo: the answer's only
    assert len(plain["choices"][0]["logprobs"]["tokens"]) == 2 and backend.params[1].prompt_logprobs is None


def test_max_tokens_zero_echoes_the_prompt_alone(backend: FakeBackend) -> None:
    ids = backend.tokenizer.encode(PROMPT)
    body = post(backend, max_tokens=0, echo=True, logprobs=0)
    (choice,) = body["choices"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids) and choice["logprobs"]["top_logprobs"][1] == {}
    assert body["usage"]["completion_tokens"] == 0 and backend.params[0].max_tokens == 1


def test_a_prompt_of_token_ids_as_lm_eval_sends_it(backend: FakeBackend) -> None:
    """lm-evaluation-harness's loglikelihood request: `prompt` a list of one list of ids."""
    ids = backend.tokenizer.encode(PROMPT)
    body = post(backend, prompt=[ids], max_tokens=1, echo=True, logprobs=1, temperature=0)
    lp = body["choices"][0]["logprobs"]
    assert body["choices"][0]["text"].startswith(backend.tokenizer.decode(ids, skip_special_tokens=False))
    assert len(lp["token_logprobs"]) == len(ids) + 1 and sum(lp["token_logprobs"][1:-1]) == -1.5 * (len(ids) - 1)


def test_the_stream_and_each_of_n_choices_echo_too(backend: FakeBackend) -> None:
    ids = backend.tokenizer.encode(PROMPT)
    whole = post(backend, max_tokens=4, echo=True, logprobs=1)["choices"][0]
    r = client(backend).post(COMPLETIONS, json={"model": "fake-model", "prompt": PROMPT, "max_tokens": 4,
                                                "echo": True, "logprobs": 1, "stream": True})  # fmt: skip
    chunks = [c for c in events(r.text) if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    assert chunks[0]["choices"][0]["text"].startswith(PROMPT), "the prompt comes first, with the first token"
    values = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert values == whole["logprobs"]["token_logprobs"]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == whole["logprobs"]["text_offset"]
    many = post(backend, max_tokens=2, echo=True, logprobs=1, n=2)
    assert [c["text"][: len(PROMPT)] for c in many["choices"]] == [PROMPT, PROMPT]
    assert all(len(c["logprobs"]["tokens"]) == len(ids) + 2 for c in many["choices"])


def test_a_list_of_prompts_is_answered_choice_by_choice(backend: FakeBackend) -> None:
    prompts = ["One", "Two three", "Four five six"]
    body = post(backend, prompt=prompts, max_tokens=2, echo=True, n=2, seed=7)
    texts = [c["text"] for c in body["choices"]]
    assert [c["index"] for c in body["choices"]] == list(range(6)), "prompt i's choice j: i * n + j"
    assert [t[: len(prompts[i // 2])] for i, t in enumerate(texts)] == [p for p in prompts for _ in range(2)]
    lengths = [len(backend.tokenizer.encode(p)) for p in prompts]
    assert body["usage"]["prompt_tokens"] == sum(lengths), "each prompt once"
    assert body["usage"]["completion_tokens"] == 12
    started = sorted(zip(backend.started, backend.params, strict=True))
    assert sorted(p.seed for _, p in started) == [7, 7, 7, 8, 8, 8], "choice j of each prompt: seed + j"
    assert backend.closed and sorted(backend.closed) == sorted(backend.started)


def test_a_list_of_prompts_streams_each_choice_with_its_index(backend: FakeBackend) -> None:
    ids = [backend.tokenizer.encode(p) for p in ("Hello", "Good morning to you")]
    r = client(backend).post(COMPLETIONS, json={"model": "fake-model", "prompt": ids, "max_tokens": 3, "stream": True,
                                                "stream_options": {"include_usage": True}})  # fmt: skip
    chunks = events(r.text)
    text = {i: "".join(c["choices"][0]["text"] for c in chunks if c["choices"] and c["choices"][0]["index"] == i)
            for i in (0, 1)}  # fmt: skip
    assert text[0] == text[1] == backend.tokenizer.decode(backend.text_ids[:3])
    assert chunks[-1]["usage"]["prompt_tokens"] == len(ids[0]) + len(ids[1])
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_response_format_becomes_the_engines_guide(backend: FakeBackend) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    c = client(backend)
    chat = {"model": "fake-model", "messages": [{"role": "user", "content": "Where?"}], "max_tokens": 2}
    named = {"type": "json_schema", "json_schema": {"name": "w", "schema": schema}}
    formats: list[Any] = [{"type": "json_object"}, named, {"type": "text"}, None]
    for fmt in formats:
        assert c.post("/v1/chat/completions", json={**chat, "response_format": fmt}).status_code == 200
    assert c.post(COMPLETIONS, json={"model": "fake-model", "prompt": "x", "max_tokens": 1,
                                     "response_format": {"type": "json_object"}}).status_code == 200  # fmt: skip
    guides = [p.guide for p in backend.params]
    assert guides[0] == Guide("json") and guides[1] == Guide("json_schema", json.dumps(schema))
    assert guides[2] is None and guides[3] is None and guides[4] == Guide("json")
    for bad in ({"type": "yaml"}, {"type": "json_schema"}, {"type": "json_schema", "json_schema": {"schema": 3}}):
        r = c.post("/v1/chat/completions", json={**chat, "response_format": bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == "response_format", r.text
    r = c.post("/v1/chat/completions", json={**chat, "response_format": {"type": "json_object"}, "min_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_tokens"
    assert len(backend.started) == 5, "nothing refused reached a worker"


def test_a_long_echo_is_shaped_off_the_event_loop_and_reads_the_same(smollm_tokenizer: Tokenizer) -> None:
    """Past OFF_LOOP_ENTRIES logprob entries a body is built on a thread (router/responses.py):
    the same body, whole or streamed."""
    threads: list[str] = []

    def build() -> int:
        threads.append(threading.current_thread().name)
        return 1

    assert asyncio.run(off_loop_if_large(OFF_LOOP_ENTRIES, build)) == 1
    assert asyncio.run(off_loop_if_large(OFF_LOOP_ENTRIES + 1, build)) == 1
    assert threads[0] == "MainThread" and threads[1] != "MainThread"
    roomy = {"free_blocks": 512, "num_blocks": 512}
    backend = FakeBackend(smollm_tokenizer, 4096, [worker("p0", "prefill", **roomy), worker("d0", "decode", **roomy)])
    ids = list(range(1000, 1000 + 1500))  # 1,500 prompt tokens: that many entries in the first chunk
    ask = {"model": "fake-model", "prompt": ids, "max_tokens": 3, "echo": True, "logprobs": 2}
    whole = client(backend).post(COMPLETIONS, json=ask).json()["choices"][0]
    assert len(whole["logprobs"]["tokens"]) == 1503 and whole["logprobs"]["token_logprobs"][1] == -1.5
    chunks = [c for c in events(client(backend).post(COMPLETIONS, json={**ask, "stream": True}).text) if c["choices"]]
    assert "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]
    streamed = [v for c in chunks for v in c["choices"][0]["logprobs"]["token_logprobs"]]
    assert streamed == whole["logprobs"]["token_logprobs"]


def test_vllms_guides_stop_token_ids_and_special_tokens(backend: FakeBackend) -> None:
    c = client(backend)
    ask = {"model": "fake-model", "prompt": "Is it?", "max_tokens": 2}
    schema = {"type": "object"}
    extras: list[dict[str, Any]] = [{"guided_json": schema}, {"guided_json": json.dumps(schema)}]
    extras += [{"guided_regex": "a+"}, {"guided_choice": ["yes", "no"]}]
    for extra in [*extras, {"stop_token_ids": [7, 9], "skip_special_tokens": False}]:
        assert c.post(COMPLETIONS, json={**ask, **extra}).status_code == 200, extra
    p = backend.params
    assert p[0].guide == p[1].guide == Guide("json_schema", json.dumps(schema))
    assert p[2].guide == Guide("regex", "a+") and p[3].guide == Guide("regex", "(yes)|(no)")
    assert p[4].stop_token_ids == (7, 9) and not p[4].skip_special_tokens and p[4].guide is None
    both = {"guided_regex": "a", "response_format": {"type": "json_object"}}
    for bad, param in ((both, "guided_regex"), ({"guided_choice": []}, "guided_choice"),
                       ({"stop_token_ids": [10**6]}, "stop_token_ids")):  # fmt: skip
        r = c.post(COMPLETIONS, json={**ask, **bad})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    assert len(backend.started) == 5


def test_tokenize_and_detokenize_as_the_prompt_is_served(backend: FakeBackend) -> None:
    tok = backend.tokenizer
    c = client(backend, api_keys=("k1",))
    auth = {"Authorization": "Bearer k1"}
    assert c.post("/tokenize", json={"model": "fake-model", "prompt": PROMPT}).status_code == 401
    r = c.post("/tokenize", json={"model": "fake-model", "prompt": PROMPT}, headers=auth).json()
    assert r == {"tokens": tok.encode(PROMPT), "count": len(tok.encode(PROMPT)), "max_model_len": 512}
    chat = [{"role": "user", "content": "Hello"}]
    r = c.post("/tokenize", json={"model": "fake-model", "messages": chat}, headers=auth).json()
    assert r["tokens"] == tok.encode(tok.apply_chat_template(chat)), "as /v1/chat/completions serves it"
    back = c.post("/detokenize", json={"model": "fake-model", "tokens": r["tokens"]}, headers=auth).json()
    assert back == {"prompt": tok.apply_chat_template(chat)}
    for path, body, status, param in (
        ("/tokenize", {"model": "fake-model"}, 400, "prompt"),
        ("/tokenize", {"model": "fake-model", "prompt": "a", "messages": chat}, 400, "prompt"),
        ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model"),
        ("/detokenize", {"model": "fake-model", "tokens": [-1]}, 400, "tokens"),
    ):
        r = c.post(path, json=body, headers=auth)
        assert r.status_code == status and r.json()["error"]["param"] == param, r.text
    long = c.post("/tokenize", json={"model": "fake-model", "prompt": "x " * 600}, headers=auth).json()
    assert long["count"] > long["max_model_len"], "counted, for the client to compare"
    assert backend.started == [], "no worker is asked"


def test_a_long_id_list_detokenizes_off_the_event_loop(backend: FakeBackend) -> None:
    ids = backend.tokenizer.encode(PROMPT) * 1000  # past the inline bound: decoded on a thread
    r = client(backend).post("/detokenize", json={"model": "fake-model", "tokens": ids})
    assert r.status_code == 200 and r.json()["prompt"] == PROMPT * 1000


def test_a_request_that_names_no_model_is_served_by_the_served_one(backend: FakeBackend) -> None:
    """vLLM and SGLang read a missing (or null) `model` as the model they serve; clients written
    against them omit it. A named model must still be the served one."""
    c = client(backend)
    chat = c.post(CHAT, json={"messages": HELLO, "max_tokens": 2}).json()
    assert chat["model"] == "fake-model" and chat["usage"]["completion_tokens"] == 2
    done = c.post("/v1/completions", json={"model": None, "prompt": PROMPT, "max_tokens": 2}).json()
    assert done["model"] == "fake-model" and done["choices"][0]["text"]
    ids = c.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert c.post("/detokenize", json={"tokens": ids}).json() == {"prompt": PROMPT}
    other = c.post(CHAT, json={"model": "other", "messages": HELLO})
    assert other.status_code == 404 and other.json()["error"]["code"] == "model_not_found"
