"""vLLM's request extensions (router/vllm_fields.py) against the fake backend: the ones served
(include_stop_str_in_output reaches the engine, return_tokens_as_token_ids names the logprobs'
tokens, chat_template_kwargs reaches the template) and the ones refused unless neutral."""

from __future__ import annotations

from typing import Any

import pytest

from engine.tokenizer import Tokenizer
from router.vllm_fields import CHAT_NEUTRAL, NEUTRAL
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client

COMPLETIONS = "/v1/completions"


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(smollm_tokenizer)


def post(backend: FakeBackend, path: str, status: int = 200, **body: Any) -> dict[str, Any]:
    prompt = {"messages": HELLO} if path == CHAT else {"prompt": "The capital of France is"}
    r = client(backend).post(path, json={"model": "fake-model", "max_tokens": 2, **prompt, **body})
    assert r.status_code == status, r.text
    out: dict[str, Any] = r.json()
    return out


def test_include_stop_str_in_output_reaches_the_engine(backend: FakeBackend) -> None:
    post(backend, CHAT, stop=["x"], include_stop_str_in_output=True)
    post(backend, CHAT, stop=["x"])
    assert [p.include_stop_str_in_output for p in backend.params] == [True, False]


def test_tokens_named_by_their_ids(backend: FakeBackend) -> None:
    ids = backend.text_ids[:2]
    names = [f"token_id:{t}" for t in ids]
    lp = post(backend, COMPLETIONS, logprobs=1, return_tokens_as_token_ids=True)["choices"][0]["logprobs"]
    assert lp["tokens"] == names and [list(top) for top in lp["top_logprobs"]] == [[n] for n in names]
    texts = [backend.tokenizer.token_text(t) for t in ids]
    assert lp["text_offset"] == [0, len(texts[0])], "offsets in the text, whatever names the tokens"
    chat = post(backend, CHAT, logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
    content = chat["choices"][0]["logprobs"]["content"]
    assert [c["token"] for c in content] == names and content[0]["bytes"] == list(names[0].encode())
    assert content[0]["top_logprobs"][0]["token"] == names[0]
    plain = post(backend, COMPLETIONS, logprobs=1)["choices"][0]["logprobs"]
    assert plain["tokens"] == texts


def test_template_kwargs_and_documents_reach_it(backend: FakeBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    tok = backend.tokenizer
    template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/no_think{% endif %}"
        "{% for d in documents or [] %}[{{ d.title }}]{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    monkeypatch.setattr(tok, "chat_template", template)
    monkeypatch.setattr(tok, "_template", None)
    post(backend, CHAT, chat_template_kwargs={"enable_thinking": False, "messages": [], "add_generation_prompt": False})
    post(backend, CHAT)
    kw, plain = (tok.decode(p, skip_special_tokens=False) for p in backend.prompts)
    assert kw.endswith("/no_think<|im_start|>assistant\n"), "the variable read; the messages and prompt the request's"
    assert plain == kw.replace("/no_think", "")
    r = client(backend).post("/tokenize", json={"messages": HELLO, "chat_template_kwargs": {"enable_thinking": False}})
    assert r.status_code == 200 and r.json()["tokens"] == backend.prompts[0]
    post(backend, CHAT, documents=[{"title": "Doc A", "text": "..."}])  # vLLM's RAG documents
    assert tok.decode(backend.prompts[-1], skip_special_tokens=False).endswith("[Doc A]<|im_start|>assistant\n")


@pytest.mark.parametrize("name", sorted(NEUTRAL))
def test_a_field_not_served_is_refused_unless_neutral(backend: FakeBackend, name: str) -> None:
    err = post(backend, COMPLETIONS, 400, **{name: {"asks": "something"}})["error"]
    assert err["param"] == name and err["message"] == f"{name} is not supported by this server (a vLLM extension)"
    for neutral in NEUTRAL[name]:
        post(backend, CHAT, **{name: neutral})


def test_chat_fields_not_served_are_refused_on_chats_only(backend: FakeBackend) -> None:
    for name in CHAT_NEUTRAL:
        assert post(backend, CHAT, 400, **{name: "x"})["error"]["param"] == name
    post(backend, CHAT, echo=False, documents=[], chat_template=None)
    assert post(backend, COMPLETIONS, echo=True)["choices"][0]["text"].startswith("The capital of France is")


def test_allowed_token_ids_reach_the_engine_checked(backend: FakeBackend) -> None:
    post(backend, CHAT, allowed_token_ids=[5, 7])
    assert backend.params[0].allowed_token_ids == (5, 7)
    for bad, why in (([], "allowed_token_ids"), ([10**7], "allowed_token_ids")):
        assert post(backend, CHAT, 400, allowed_token_ids=bad)["error"]["param"] == why
    guided = {"response_format": {"type": "json_object"}}
    assert post(backend, CHAT, 400, allowed_token_ids=[5], **guided)["error"]["param"] == "allowed_token_ids"


def test_truncate_prompt_tokens_serves_and_counts_the_last_k(backend: FakeBackend) -> None:
    tok = backend.tokenizer
    ids = tok.encode("one two three four five six seven eight")
    body = post(backend, COMPLETIONS, prompt=ids, truncate_prompt_tokens=3, echo=True)
    assert backend.prompts[0] == ids[-3:] and body["usage"]["prompt_tokens"] == 3
    assert body["choices"][0]["text"].startswith(tok.decode(ids[-3:])), "echo: the prompt as served"
    long_text = "word " * (backend.model.max_model_len + 10)  # past the context: served truncated, not a 413
    context = backend.model.max_model_len
    for max_tokens, served in ((None, context - 1), (8, context - 8)):  # -1: room left for the answer
        post(backend, COMPLETIONS, prompt=long_text, truncate_prompt_tokens=-1, max_tokens=max_tokens)
        assert backend.prompts[-1] == tok.encode(long_text)[-served:]
    err = post(backend, COMPLETIONS, 413, prompt=long_text)["error"]
    assert err["param"] == "prompt"
    assert post(backend, CHAT, 400, truncate_prompt_tokens=0)["error"]["param"] == "truncate_prompt_tokens"


def test_a_truncated_chat_keeps_its_answers_marked(backend: FakeBackend) -> None:
    messages = [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue, like the sea on a clear day."},
        {"role": "user", "content": "Another?"},
    ]
    client(backend).post(CHAT, json={"messages": messages, "max_tokens": 2})
    client(backend).post(CHAT, json={"messages": messages, "max_tokens": 2, "truncate_prompt_tokens": 20})
    (whole, cut) = backend.prompts
    assert cut == whole[-20:]
    removed = len(whole) - 20
    (a, b), (c, d) = backend.params[0].decoded[0], backend.params[1].decoded[0]
    assert (max(a - removed, 0), b - removed) == (c, d) and cut[c:d] == whole[a:b][-(d - c) :]


def test_guided_grammar_reaches_the_engine_as_a_guide(backend: FakeBackend) -> None:
    ebnf = 'root ::= "yes" | "no"'
    post(backend, CHAT, guided_grammar=ebnf)
    guide = backend.params[0].guide
    assert guide is not None and (guide.kind, guide.spec, guide.field) == ("grammar", ebnf, "guided_grammar")
    err = post(backend, CHAT, 400, guided_grammar=ebnf, guided_regex="a+")["error"]
    assert err["message"].startswith("ask for one of") and "guided_grammar" in err["message"]


def test_bad_words_reach_the_engine_as_vllm_tokenizes_them(backend: FakeBackend) -> None:
    tok = backend.tokenizer
    post(backend, CHAT, bad_words=["Paris", "  hello world"])
    bare, spaced = tuple(tok.encode("Paris")), tuple(tok.encode(" Paris"))
    hello, spaced_hello = tuple(tok.encode("hello world")), tuple(tok.encode(" hello world"))
    want = [bare] + ([spaced] if spaced[0] != bare[0] and len(spaced) == len(bare) else [])
    want += [hello] + ([spaced_hello] if spaced_hello[0] != hello[0] and len(spaced_hello) == len(hello) else [])
    assert backend.params[0].bad_words == tuple(want) and len(want) >= 3, "the spaced forms that differ are added"
    assert post(backend, CHAT, 400, bad_words=["  "])["error"]["param"] == "bad_words"
    assert post(backend, CHAT, 400, bad_words=["x"] * 257)["error"]["param"] == "bad_words"


def test_a_cache_salt_reaches_the_engine_and_an_empty_one_is_refused(backend: FakeBackend) -> None:
    post(backend, COMPLETIONS, cache_salt="tenant-7")
    assert backend.params[0].cache_salt == "tenant-7"
    assert post(backend, COMPLETIONS, 400, cache_salt="")["error"]["param"] == "cache_salt"
