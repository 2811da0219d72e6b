"""vLLM's `prompt_logprobs` (router/responses.py) against the fake backend, whose workers score
each prompt token -1.5 at rank 1, its top N the token itself and then the next ids at -2.5, -3.5:
a completion's choices carry their prompt's, a chat's response its own; the first token null;
each token's own entry, then the top N; with n > 1 one engine request scores a prompt; beside
`echo`; the refusals in vLLM's words."""

from __future__ import annotations

from typing import Any

import pytest

from engine.tokenizer import Tokenizer
from tests.unit.fake_backend import CHAT, FakeBackend, client

PROMPT = "The capital of France is"


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(smollm_tokenizer)


def post(backend: FakeBackend, path: str = "/v1/completions", status: int = 200, **body: Any) -> dict[str, Any]:
    prompt = {"messages": [{"role": "user", "content": PROMPT}]} if path == CHAT else {"prompt": PROMPT}
    r = client(backend).post(path, json={"model": "fake-model", **prompt, **body})
    assert r.status_code == status, r.text
    out: dict[str, Any] = r.json()
    return out


def entry(tok: Tokenizer, token_id: int, logprob: float, rank: int) -> dict[str, Any]:
    return {"logprob": logprob, "rank": rank, "decoded_token": tok.token_text(token_id)}


def test_a_completion_carries_each_prompt_tokens_logprob_rank_and_top_n(backend: FakeBackend) -> None:
    tok, ids = backend.tokenizer, backend.tokenizer.encode(PROMPT)
    body = post(backend, max_tokens=2, prompt_logprobs=2)
    (choice,) = body["choices"]
    scores = choice["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None, "nothing predicts the first token"
    for t, got in zip(ids[1:], scores[1:], strict=True):
        assert got == {str(t): entry(tok, t, -1.5, 1), str(t + 1): entry(tok, t + 1, -2.5, 2)}
        assert list(got) == [str(t), str(t + 1)], "the token's own entry first"
    assert choice["text"] == tok.decode(backend.text_ids[:2]) and choice["logprobs"] is None
    assert backend.params[0].prompt_logprobs == 2
    plain = post(backend, max_tokens=2)
    assert "prompt_logprobs" not in plain["choices"][0] and backend.params[1].prompt_logprobs is None


def test_a_chat_response_carries_its_prompts_with_none_of_the_top(backend: FakeBackend) -> None:
    body = post(backend, CHAT, max_tokens=2, prompt_logprobs=0)
    ids = backend.prompts[0]
    scores = body["prompt_logprobs"]
    assert len(scores) == len(ids) and scores[0] is None
    assert all(list(s) == [str(t)] for t, s in zip(ids[1:], scores[1:], strict=True)), "only the token's own"
    assert "prompt_logprobs" not in body["choices"][0]


def test_n_choices_of_two_prompts_each_carry_theirs_scored_once(backend: FakeBackend) -> None:
    prompts = [PROMPT, "Paris is a city"]
    body = post(backend, prompt=prompts, n=3, max_tokens=2, prompt_logprobs=1, seed=5)
    assert len(body["choices"]) == 6
    for choice in body["choices"]:
        ids = backend.tokenizer.encode(prompts[choice["index"] // 3])
        scores = choice["prompt_logprobs"]
        assert len(scores) == len(ids) and [next(iter(s)) for s in scores[1:]] == [str(t) for t in ids[1:]]
    asked = [p.prompt_logprobs for p in backend.params]
    assert sorted(asked, key=str) == [1, 1, None, None, None, None], "a prompt's first choice scores it"


def test_beside_echo_each_shows_its_own_top_n(backend: FakeBackend) -> None:
    ids = backend.tokenizer.encode(PROMPT)
    body = post(backend, max_tokens=1, echo=True, logprobs=1, prompt_logprobs=3)
    (choice,) = body["choices"]
    assert backend.params[0].prompt_logprobs == 3, "the engine scores the wider"
    assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1 : len(ids)])
    assert all(len(s) == 3 for s in choice["prompt_logprobs"][1:])


def test_refusals_name_the_field(backend: FakeBackend) -> None:
    for bad in (-1, 21):
        err = post(backend, status=400, prompt_logprobs=bad)["error"]
        assert (
            err["param"] == "prompt_logprobs" and err["message"] == f"prompt_logprobs must be from 0 to 20 (got {bad})"
        )
    for path in ("/v1/completions", CHAT):
        err = post(backend, path, status=400, stream=True, prompt_logprobs=1)["error"]
        assert err["message"] == "`prompt_logprobs` are not available when `stream=True`.", err
    r = client(backend).post("/v1/completions", json={"prompt": PROMPT, "stream": True, "prompt_logprobs": 0})
    assert r.status_code == 200 and backend.params[-1].prompt_logprobs is None, "0 streamed: vLLM takes it, sends none"
