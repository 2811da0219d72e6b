"""Tool calling (router/tools.py): the plan a request's tools make (the grammar's schema, the
system text), the answer read back as calls or content, and both through the app against the
fake backend, whose stream is a scripted answer: whole, streamed, n > 1, a chat's earlier calls
sent back, and each refusal a 400 naming its field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from engine.tokenizer import Tokenizer
from router.errors import APIError
from router.tools import NamedToolChoice, Tool, ToolChoice, tool_plan
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client, events

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters: an empty object
CALL = '{"tool_call": {"name": "get_weather", "arguments": {"city": "Paris"}}}'
TWO = ('{"tool_calls": [{"name": "get_weather", "arguments": {"city": "Paris"}}, '
       '{"name": "get_time", "arguments": {}}]}')  # fmt: skip


def tools(*defs: dict[str, Any]) -> list[Tool]:
    return [Tool.model_validate(d) for d in defs]


def named(name: str) -> NamedToolChoice:
    return NamedToolChoice.model_validate({"type": "function", "function": {"name": name}})


def schema(choice: ToolChoice | None, parallel: bool = False) -> Any:
    plan = tool_plan(tools(WEATHER, CLOCK), choice, parallel)
    assert plan is not None and plan.guide.kind == "json_schema"
    return json.loads(plan.guide.spec)


def test_the_plan_holds_the_answer_to_calls_of_the_tools_it_may_call() -> None:
    weather = {"type": "object", "properties": {"name": {"const": "get_weather"},
               "arguments": WEATHER["function"]["parameters"]}, "required": ["name", "arguments"]}  # fmt: skip
    clock = {"type": "object", "properties": {"name": {"const": "get_time"},
             "arguments": {"type": "object", "properties": {}}}, "required": ["name", "arguments"]}  # fmt: skip
    one = {"type": "object", "properties": {"tool_call": {"anyOf": [weather, clock]}}, "required": ["tool_call"]}
    reply = {"type": "object", "properties": {"response": {"type": "string"}}, "required": ["response"]}
    assert schema("required") == one
    assert schema(None) == schema("auto") == {"anyOf": [one, reply]}
    assert schema(named("get_weather")) == {"type": "object", "properties": {"tool_call": weather},
                                            "required": ["tool_call"]}  # fmt: skip
    many = {"type": "array", "items": {"anyOf": [weather, clock]}, "minItems": 1}
    assert schema("required", parallel=True) == {"type": "object", "properties": {"tool_calls": many},
                                                 "required": ["tool_calls"]}  # fmt: skip
    assert tool_plan(tools(WEATHER), "none", False) is None and tool_plan(None, None, False) is None
    text = tool_plan(tools(WEATHER, CLOCK), named("get_time"), False).system_text  # type: ignore[union-attr]
    assert '"name": "get_weather"' in text and '"description": "The weather in a city"' in text
    assert text.endswith("Call get_time.") and '{"tool_call": ' in text and '"response"' not in text


@pytest.mark.parametrize(
    ("defs", "choice", "param", "says"),
    [
        ((WEATHER,), named("send_email"), "tool_choice", "not in tools"),
        ((), "required", "tool_choice", "needs tools"),
        ((WEATHER, WEATHER), "auto", "tools", "name of its own"),
        (
            ({"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}},),
            "auto",
            "tools",
            "schema of an object",
        ),
        ((WEATHER,) * 129, "auto", "tools", "at most 128"),
    ],
)
def test_a_plan_it_cannot_make_is_a_400_naming_the_field(
    defs: tuple[dict[str, Any], ...], choice: ToolChoice, param: str, says: str
) -> None:
    with pytest.raises(APIError) as e:
        tool_plan(tools(*defs), choice, False)
    assert e.value.status == 400 and e.value.param == param and says in e.value.message


def test_an_answer_reads_back_as_calls_content_or_the_text_it_was() -> None:
    plan = tool_plan(tools(WEATHER, CLOCK), None, True)
    assert plan is not None
    one = plan.answer(CALL, "stop")
    assert one.content is None and one.finish("stop") == "tool_calls"
    (call,) = one.calls
    assert call.name == "get_weather" and call.arguments == '{"city": "Paris"}' and call.id.startswith("call_")
    assert [c.name for c in plan.answer(TWO, "stop").calls] == ["get_weather", "get_time"]
    assert len({c.id for c in plan.answer(TWO, "stop").calls}) == 2
    reply = plan.answer('{"response": "Hello!"}', "stop")
    assert reply.content == "Hello!" and not reply.calls and reply.finish("stop") == "stop"
    assert plan.answer(CALL[:30], "length").content == CALL[:30]  # cut short: the text as it was
    assert plan.answer(CALL, "length").content == CALL  # whole but cut by length: not read as a call
    assert plan.answer("[1, 2]", "stop").content == "[1, 2]"


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(smollm_tokenizer, answer=CALL)


def test_a_call_comes_back_as_tool_calls_and_the_engine_held_the_answer(backend: FakeBackend) -> None:
    r = client(backend).post(CHAT, json={"messages": HELLO, "tools": [WEATHER, CLOCK], "max_tokens": 64})
    assert r.status_code == 200, r.text
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
    (call,) = choice["message"]["tool_calls"]
    assert call["type"] == "function" and call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    guide = backend.params[-1].guide
    assert guide is not None and json.loads(guide.spec) == schema(None)


def test_the_tools_are_described_in_the_system_message(backend: FakeBackend) -> None:
    """... the first message's, where it is one; /tokenize counts what is served."""
    c = client(backend)
    system = [{"role": "system", "content": "Be brief."}, *HELLO]
    plan = tool_plan(tools(WEATHER), named("get_weather"), False)
    assert plan is not None
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for messages, first in ((HELLO, plan.system_text), (system, f"Be brief.\n\n{plan.system_text}")):
        body = {"messages": messages, "tools": [WEATHER], "tool_choice": choice}
        assert c.post(CHAT, json={**body, "max_tokens": 64}).status_code == 200
        sent = backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False)
        assert sent.startswith(f"<|im_start|>system\n{first}<|im_end|>\n"), sent
        assert c.post("/tokenize", json=body).json()["tokens"] == backend.prompts[-1]
        plain = c.post("/tokenize", json={"messages": messages}).json()["tokens"]
        assert first not in backend.tokenizer.decode(plain, skip_special_tokens=False)
    r = c.post("/tokenize", json={"messages": HELLO, "tool_choice": "required"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"


def streamed(chunks: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]]:
    """A streamed choice's content, and its calls put together from their deltas (OpenAI's way:
    a call's first delta has its id, type and name; the rest, pieces of its arguments)."""
    content = "".join(c["delta"].get("content") or "" for c in chunks)
    calls: list[dict[str, Any]] = []
    for c in chunks:
        for d in c["delta"].get("tool_calls", []):
            if "id" in d:
                assert d["index"] == len(calls) and d["type"] == "function"
                calls.append({"id": d["id"], "name": d["function"]["name"], "arguments": d["function"]["arguments"]})
            else:
                assert set(d) == {"index", "function"} and set(d["function"]) == {"arguments"}
                calls[d["index"]]["arguments"] += d["function"]["arguments"]
    return content, calls


def test_streamed_calls_come_as_they_are_written(smollm_tokenizer: Tokenizer) -> None:
    backend = FakeBackend(smollm_tokenizer, answer=TWO)
    body = {"messages": HELLO, "tools": [WEATHER, CLOCK], "tool_choice": "required", "parallel_tool_calls": True,
            "stream": True, "max_tokens": 64, "logprobs": True}  # fmt: skip
    r = client(backend).post(CHAT, json=body)
    chunks = [e["choices"][0] for e in events(r.text)]
    assert chunks[0]["delta"] == {"role": "assistant", "content": ""}
    content, calls = streamed(chunks[1:])
    assert content == "" and [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("get_time", {}),
    ]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    argument_deltas = [c for c in chunks if "tool_calls" in c["delta"]]
    assert len(argument_deltas) > 4, "the arguments come in pieces, as written"
    first_call = next(i for i, c in enumerate(chunks) if "tool_calls" in c["delta"])
    assert first_call < len(chunks) // 2, "the first call begins well before the answer ends"
    assert sum(len(c["logprobs"]["content"]) for c in chunks if c.get("logprobs")) == len(backend.text_ids)
    assert chunks[-1]["finish_reason"] == "tool_calls" and chunks[-1]["delta"] == {}


def test_a_streamed_response_is_content_as_it_is_written(smollm_tokenizer: Tokenizer) -> None:
    text = r"Hello \"there\", caf\u00e9 \ud83d\ude00 \\ done"
    backend = FakeBackend(smollm_tokenizer, answer='{"response": "' + text + '"}')
    r = client(backend).post(CHAT, json={"messages": HELLO, "tools": [WEATHER], "stream": True, "max_tokens": 64})
    chunks = [e["choices"][0] for e in events(r.text)]
    content, calls = streamed(chunks[1:])
    assert content == json.loads('"' + text + '"') and calls == []
    assert len([c for c in chunks if c["delta"].get("content")]) > 4, "in pieces, as written"
    assert chunks[-1]["finish_reason"] == "stop"
    whole = client(backend).post(CHAT, json={"messages": HELLO, "tools": [WEATHER], "max_tokens": 64}).json()
    assert whole["choices"][0]["message"]["content"] == content


def test_a_streamed_answer_cut_short_ends_on_length(smollm_tokenizer: Tokenizer) -> None:
    backend = FakeBackend(smollm_tokenizer, answer=CALL)
    cut = len(smollm_tokenizer.encode(CALL)) - 4  # inside the arguments
    r = client(backend).post(CHAT, json={"messages": HELLO, "tools": [WEATHER], "stream": True, "max_tokens": cut})
    chunks = [e["choices"][0] for e in events(r.text)]
    content, calls = streamed(chunks[1:])
    assert chunks[-1]["finish_reason"] == "length" and content == ""
    assert [c["name"] for c in calls] == ["get_weather"] and '{"city": "Paris"}'.startswith(calls[0]["arguments"])
    r = client(backend).post(CHAT, json={"messages": HELLO, "tools": [WEATHER], "stream": True, "max_tokens": 2})
    chunks = [e["choices"][0] for e in events(r.text)]
    assert streamed(chunks[1:])[0] == backend.tokenizer.decode(backend.text_ids[:2]), "nothing read: the text"


def test_each_of_n_choices_is_read_alone(backend: FakeBackend) -> None:
    c = client(backend)
    r = c.post(CHAT, json={"messages": HELLO, "tools": [WEATHER], "n": 2, "max_tokens": 64})
    got = r.json()["choices"]
    assert [ch["finish_reason"] for ch in got] == ["tool_calls"] * 2
    ids = {ch["message"]["tool_calls"][0]["id"] for ch in got}
    assert len(ids) == 2
    r = c.post(CHAT, json={"messages": HELLO, "tools": [WEATHER], "n": 2, "max_tokens": 64, "stream": True})
    ends = [e["choices"][0] for e in events(r.text) if e["choices"][0]["finish_reason"]]
    assert sorted(ch["index"] for ch in ends) == [0, 1] and {ch["finish_reason"] for ch in ends} == {"tool_calls"}


def test_none_answers_in_text_and_a_cut_call_comes_back_as_its_text(backend: FakeBackend) -> None:
    c = client(backend)
    r = c.post(CHAT, json={"messages": HELLO, "tools": [WEATHER], "tool_choice": "none", "max_tokens": 64})
    assert r.json()["choices"][0]["message"] == {"role": "assistant", "content": CALL}
    assert backend.params[-1].guide is None
    r = c.post(CHAT, json={"messages": HELLO, "tools": [WEATHER], "max_tokens": 5})
    (choice,) = r.json()["choices"]
    assert choice["finish_reason"] == "length" and "tool_calls" not in choice["message"]
    assert CALL.startswith(choice["message"]["content"])


def test_a_chats_earlier_calls_and_their_results_are_sent_back(backend: FakeBackend) -> None:
    asked = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    chat = [*HELLO, {"role": "assistant", "content": None, "tool_calls": [asked]},
            {"role": "tool", "tool_call_id": "call_1", "content": "18 C, cloudy"}]  # fmt: skip
    c = client(backend)
    r = c.post(CHAT, json={"messages": chat, "tools": [WEATHER], "max_tokens": 64})
    assert r.status_code == 200, r.text
    sent = backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False)
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in sent and "<|im_start|>tool\n18 C, cloudy" in sent
    for bad, says in (
        ({"role": "user", "content": None}, "content is required"),
        ({"role": "user", "content": "hi", "tool_calls": [asked]}, "only an assistant"),
        (
            {"role": "assistant", "tool_calls": [{**asked, "function": {"name": "f", "arguments": "[1]"}}]},
            "not a JSON object",
        ),
    ):
        r = c.post(CHAT, json={"messages": [*HELLO, bad], "tools": [WEATHER]})
        assert r.status_code == 400 and says in r.json()["error"]["message"], (bad, r.text)


def test_tools_and_a_response_format_of_the_clients_own_are_refused(backend: FakeBackend) -> None:
    c = client(backend)
    for extra in ({"response_format": {"type": "json_object"}}, {"guided_regex": "a+"}):
        r = c.post(CHAT, json={"messages": HELLO, "tools": [WEATHER], **extra})
        assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice", r.text
    r = c.post(CHAT, json={"messages": HELLO, "tools": [WEATHER], "tool_choice": "none", "guided_regex": "a+"})
    assert r.status_code == 200
