"""max_tokens where a request names none (OpenAI's defaults: a chat the rest of the context,
completions 16; or the router's --default-max-tokens), and the room the router plans for."""

from __future__ import annotations

import pytest

from cluster.routing import ANSWER_PLAN_TOKENS, RoutingPolicy, plan_route, planned_blocks
from cluster.worker_view import WorkerView
from engine.tokenizer import Tokenizer
from tests.unit.fake_backend import CHAT, HELLO, FakeBackend, client

COMPLETIONS = "/v1/completions"
PROMPT = "Once upon a time"


@pytest.fixture
def backend(smollm_tokenizer: Tokenizer) -> FakeBackend:
    return FakeBackend(smollm_tokenizer, max_model_len=300)


def prompt_len(backend: FakeBackend) -> int:
    return len(backend.tokenizer.encode(backend.tokenizer.apply_chat_template(HELLO)))


def test_a_chat_that_names_no_max_tokens_may_answer_to_the_end_of_the_context(backend: FakeBackend) -> None:
    r = client(backend).post(CHAT, json={"model": "fake-model", "messages": HELLO})
    assert r.status_code == 200, r.text
    room = backend.max_model_len - prompt_len(backend)
    assert backend.params[-1].max_tokens == room and r.json()["usage"]["completion_tokens"] == room


def test_named_max_tokens_and_the_routers_default(backend: FakeBackend) -> None:
    c = client(backend)
    chat = {"model": "fake-model", "messages": HELLO}
    assert c.post(COMPLETIONS, json={"model": "fake-model", "prompt": PROMPT}).status_code == 200
    assert backend.params[-1].max_tokens == 16  # OpenAI's legacy completions, vLLM's, SGLang's
    for body, path in ((chat, CHAT), ({"model": "fake-model", "prompt": PROMPT}, COMPLETIONS)):
        assert c.post(path, json={**body, "max_tokens": 7}).status_code == 200
        assert backend.params[-1].max_tokens == 7
    capped = client(backend, default_max_tokens=40)
    for body, path in ((chat, CHAT), ({"model": "fake-model", "prompt": PROMPT}, COMPLETIONS)):
        assert capped.post(path, json=body).status_code == 200
        assert backend.params[-1].max_tokens == 40
    # a default never runs past the context: a prompt 5 tokens short of it may answer 5
    ids = backend.tokenizer.encode(PROMPT)
    long = (ids * backend.max_model_len)[: backend.max_model_len - 5]
    assert capped.post(COMPLETIONS, json={"model": "fake-model", "prompt": long}).status_code == 200
    assert backend.params[-1].max_tokens == 5


def test_the_room_planned_for_an_answer_stops_at_answer_plan_tokens() -> None:
    assert planned_blocks(100, 12, 16) == 7  # prompt + max_tokens, rounded up to blocks
    assert planned_blocks(100, 100_000, 16) == -(-(100 + ANSWER_PLAN_TOKENS) // 16)
    # a decode worker with room for the prompt and the plan takes a request that may run to 8K
    # tokens (a chat that names no max_tokens): past the plan, its engine makes room as it goes
    room = planned_blocks(112, ANSWER_PLAN_TOKENS, 16)  # 71 blocks, to the token
    workers = [
        WorkerView("p1", "prefill", free_blocks=room, num_blocks=room),
        WorkerView("d1", "decode", free_blocks=room, num_blocks=room),
    ]
    route = plan_route(workers, {}, 112, 8000, 16, RoutingPolicy(local_below_tokens=0))
    assert route is not None and (route.prefill, route.decode) == ("p1", "d1")
    assert plan_route(workers, {}, 113, 8000, 16, RoutingPolicy(local_below_tokens=0)) is None
