"""How a chat's messages become its prompt, vLLM's extensions to that (router/chat_messages.py):
`continue_final_message` (the answer goes on from the final assistant message's text) and
`add_generation_prompt: false`, through the app against the fake backend and /tokenize alike."""

from __future__ import annotations

from typing import Any

import pytest

from engine.tokenizer import Tokenizer
from tests.unit.fake_backend import CHAT, FakeBackend, client

ANSWER = "Paris is the capital of France."
CHAT_SO_FAR = [
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": ANSWER},
    {"role": "user", "content": "And its population?"},
    {"role": "assistant", "content": "About"},
]


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(smollm_tokenizer)


def served(backend: FakeBackend, **body: Any) -> str:
    c = client(backend)
    r = c.post(CHAT, json={"messages": CHAT_SO_FAR, "max_tokens": 2, **body})
    assert r.status_code == 200, r.text
    assert c.post("/tokenize", json={"messages": CHAT_SO_FAR, **body}).json()["tokens"] == backend.prompts[-1]
    return backend.tokenizer.decode(backend.prompts[-1], skip_special_tokens=False)


def test_continue_final_message_goes_on_from_its_text(backend: FakeBackend) -> None:
    prompt = served(backend, continue_final_message=True)
    assert prompt.endswith("<|im_start|>assistant\nAbout"), prompt
    tok = backend.tokenizer
    # the earlier answer is still run as the decode rows that wrote it; the text to go on from is not
    (span,) = backend.params[-1].decoded
    assert tok.decode(backend.prompts[-1][span[0] : span[1]]) == ANSWER
    assert served(backend, continue_final_message=True, add_generation_prompt=True) == prompt


def test_without_the_generation_prompt_the_messages_end_the_prompt(backend: FakeBackend) -> None:
    assert served(backend, add_generation_prompt=False).endswith("<|im_start|>assistant\nAbout<|im_end|>\n")
    assert served(backend).endswith("About<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize(
    ("messages", "extra", "param", "says"),
    [
        (CHAT_SO_FAR[:3], {}, "messages", "assistant's message last"),
        ([*CHAT_SO_FAR[:3], {"role": "assistant", "content": ""}], {}, "messages", "final message is empty"),
        (CHAT_SO_FAR, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "continue_final_message",
         "a call starts an answer"),
    ],
)  # fmt: skip
def test_what_cannot_be_continued_is_a_400(
    backend: FakeBackend, messages: list[dict[str, str]], extra: dict[str, Any], param: str, says: str
) -> None:
    r = client(backend).post(CHAT, json={"messages": messages, "continue_final_message": True, **extra})
    assert r.status_code == 400 and r.json()["error"]["param"] == param and says in r.json()["error"]["message"], r.text
    assert not backend.started
