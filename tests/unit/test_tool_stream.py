"""An answer under a tool plan read as it comes (router/tool_stream.py): answers the real grammar
writes from random logits, streamed a token's text at a time as the engine detokenizes them,
read back to the content and calls router/tools.py reads from the whole; JSON string escapes
split anywhere; text that is not the plan's JSON, and an answer cut short."""

from __future__ import annotations

import functools
import json
import random

import pytest
import torch

from engine.detokenizer import IncrementalDetokenizer
from engine.grammar import Grammars, allowed_tokens
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer
from router.tool_stream import ToolStream
from router.tools import NamedToolChoice, Tool, ToolChoice, ToolPlan, tool_plan

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}, "days": {"type": "integer"}},
        "required": ["city"]}  # fmt: skip
TOOLS = [
    Tool.model_validate({"type": "function", "function": {"name": "get_weather", "parameters": CITY}}),
    Tool.model_validate({"type": "function", "function": {"name": "get_time"}}),
]
NAMED = NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_weather"}})


@functools.cache
def closers(tok: Tokenizer) -> torch.Tensor:
    """Tokens that end a string, an object or a list: favoured after a while, so answers end."""
    ids = [t for t in range(tok.vocab_size) if any(c in tok.token_text(t) for c in '"}]')]
    return torch.tensor(ids)


def written(tok: Tokenizer, grammars: Grammars, plan: ToolPlan, seed: int) -> list[str]:
    """An answer the plan's grammar writes from random logits, as the text pieces a stream sends."""
    matcher = grammars.matcher(plan.guide)
    gen = torch.Generator().manual_seed(seed)
    detok = IncrementalDetokenizer(tok, [])
    params = SamplingParams(temperature=1.0, seed=seed)
    pieces = []
    for i in range(400):
        logits = torch.randn(1, tok.vocab_size, generator=gen) * 3
        if i > 30:
            logits[0, closers(tok)] += 6.0
        token = Sampler()(logits, [params], [i], [None], allowed_tokens([matcher], tok.vocab_size, logits.device))
        assert matcher.accept_token(token.token_ids[0])
        if matcher.is_terminated():
            break
        pieces.append(detok.step(token.token_ids))
    assert matcher.is_terminated(), "the grammar ended it"
    return [*pieces, detok.flush()]


@pytest.mark.parametrize("choice,parallel", [("auto", False), ("required", False), ("required", True),
                                             (NAMED, False), ("auto", True)])  # fmt: skip
def test_a_written_answer_reads_as_the_whole_does(
    smollm_tokenizer: Tokenizer, choice: ToolChoice, parallel: bool
) -> None:
    plan = tool_plan(TOOLS, choice, parallel)
    assert plan is not None
    grammars = Grammars(smollm_tokenizer, smollm_tokenizer.vocab_size)
    for seed in range(6):
        pieces = written(smollm_tokenizer, grammars, plan, seed)
        whole = plan.answer("".join(pieces), "stop")
        stream = ToolStream()
        deltas = [stream.feed(p) for p in pieces]
        assert stream.settled, "".join(pieces)
        content = "".join(d.content for d in deltas)
        assert content == (whole.content or ""), "".join(pieces)
        got = [(c.name, json.loads(c.arguments)) for c in stream.calls]
        assert got == [(c.name, json.loads(c.arguments)) for c in whole.calls], "".join(pieces)
        pieced: list[str] = []
        for d in deltas:
            assert len({i for i, _, _ in d.calls}) == len(d.calls), "one entry a call a delta"
            for i, begun, args in d.calls:
                assert (begun is not None) == (i == len(pieced)), "a call begins once, in order"
                pieced += [""] if begun is not None else []
                pieced[i] += args
        assert pieced == [c.arguments for c in stream.calls]


def test_escapes_split_anywhere_decode_whole() -> None:
    text = r'{"response": "a\"b\\c\n\u00e9 \ud83d\ude00 \ud83d"}'
    want = json.loads(text)["response"]
    rng = random.Random(3)
    for _ in range(50):
        stream, got, at = ToolStream(), [], 0
        while at < len(text):
            step = rng.randint(1, 4)
            got.append(stream.feed(text[at : at + step]).content)
            at += step
        assert "".join(got) == want and stream.settled
        pieces = [p for p in got if p]
        assert not any("\ud800" <= p[-1] <= "\udbff" for p in pieces[:-1]), "a pair is never split"


def test_what_is_not_the_plans_json_is_left_to_the_whole_answer() -> None:
    for text in ("Hello there", '{"answer": 1}', '["a"]', '{"tool_call": ["x"]}'):
        stream = ToolStream()
        assert not stream.feed(text) and stream.lost and not stream.settled
    cut = ToolStream()
    delta = cut.feed('{"tool_call": {"name": "get_weather", "arguments": {"city": "Pa')
    begun = [(i, b.name if b else None, a) for i, b, a in delta.calls]
    assert begun == [(0, "get_weather", '{"city": "Pa')], "one entry a call"
    assert not cut.settled and not cut.lost
    more = cut.feed('ris"}}, ')
    assert more.calls == [(0, None, 'ris"}')] and cut.lost, "one call: no list follows"
