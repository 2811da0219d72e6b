"""Structured output (engine/grammar.py) on the real model, fp32: a guided answer is JSON its
schema accepts, and the same answer whether the request runs whole, replayed after some of its
tokens (a failover), split across a prefill and a decode engine, or preempted."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.grammar import Guide
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from tests.integration.test_engine_paths_real import chats, run_short_of_blocks, sibling

pytest.importorskip("xgrammar", reason="structured output needs xgrammar (make setup installs it)")

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"type": "string", "maxLength": 40}, "confident": {"type": "boolean"}},
    "required": ["answer", "confident"],
    "additionalProperties": False,
}
GUIDE = Guide("json_schema", json.dumps(SCHEMA))
PARAMS = [
    SamplingParams(max_tokens=48, temperature=0, guide=GUIDE),
    SamplingParams(max_tokens=48, temperature=0.9, seed=21, guide=GUIDE, logprobs=1),
]


def pd_split(base: Engine, prompt: str, params: SamplingParams) -> list[int]:
    """The request's tokens, its first sampled by a prefill engine, the rest by a decode engine."""
    prefill = sibling(base, role="prefill", num_blocks=64)
    decode = sibling(base, role="decode", num_blocks=64)
    prefill.add_request("x", prompt, params)
    outs: list[RequestOutput] = []
    while prefill.has_unfinished():
        outs += prefill.step()
    (first,) = outs
    assert first.kv is not None and base.tokenizer is not None
    decode.cache.write_blocks(decode.reserve("x", first.kv.num_tokens), prefill.cache.read_blocks(first.kv.block_ids))
    decode.add_prefilled_request("x", base.tokenizer.encode(prompt), first.new_token_ids[0], params)
    prefill.release("x")
    tokens: list[int] = []
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    prefill.check_integrity()
    decode.check_integrity()
    assert prefill.kv.num_free_blocks == decode.kv.num_free_blocks == 64
    return tokens


def test_a_guided_answer_is_json_of_its_schema_however_it_runs(engine_fp32: Engine) -> None:
    e = engine_fp32
    assert e.tokenizer is not None
    prompts = chats(e)[:2]
    for prompt, params in zip(prompts, PARAMS, strict=True):  # greedy, then seeded
        whole = e.generate([prompt], params)[0]
        value = json.loads(whole.text)
        assert set(value) == {"answer", "confident"} and whole.finish_reason == "stop", whole.text
        ids = e.tokenizer.encode(prompt)
        cut = 5  # a replay carries the tokens sent; its matcher has read them
        rest = replace(params, max_tokens=params.max_tokens - cut, output_offset=cut)
        replay = e.generate([ids + whole.token_ids[:cut]], rest)[0]
        assert whole.token_ids[:cut] + replay.token_ids == whole.token_ids, params
        assert pd_split(e, prompt, params) == whole.token_ids
        e.check_integrity()
    plain = [c.token_ids for c in e.generate(prompts * 2, PARAMS[0])]
    tight = Engine(e.model, e.tokenizer, EngineConfig(dtype="fp32", num_blocks=8, block_size=16))
    got, preempted = run_short_of_blocks(tight, prompts * 2, PARAMS[0])
    assert preempted > 0 and got == plain
    assert tight.kv.num_free_blocks == tight.config.num_blocks


def test_speculation_keeps_a_guided_answer_and_its_drafts_pay(engine_fp32: Engine) -> None:
    """Drafts cut to what the grammar allows, each position sampled under the mask of the draft
    before it: the tokens of speculation off, greedy and seeded, and drafts accepted (a list of
    records repeats its keys, which prompt lookup drafts)."""
    e = engine_fp32
    people = {"type": "array", "minItems": 3, "maxItems": 3, "items": {
        "type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
        "required": ["name", "age"], "additionalProperties": False}}  # fmt: skip
    guide = Guide("json_schema", json.dumps(people))
    assert e.tokenizer is not None
    prompt = e.tokenizer.apply_chat_template([{"role": "user", "content": "List three people with their ages."}])
    for params in (SamplingParams(max_tokens=80, temperature=0, guide=guide),
                   SamplingParams(max_tokens=80, temperature=0.8, seed=4, guide=guide)):  # fmt: skip
        plain = e.generate([prompt], params)[0]
        assert len(json.loads(plain.text)) == 3 and plain.finish_reason == "stop", plain.text
        for kind in ("ngram", "suffix"):
            spec = sibling(e, num_blocks=64, speculative=kind)
            assert spec.speculator is not None
            drafted = spec.generate([prompt], params)[0]
            assert drafted.token_ids == plain.token_ids, (kind, params)
            # again: the worker's tree drafts the whole answer, its stop token included
            assert spec.generate([prompt], params)[0].token_ids == plain.token_ids, (kind, params)
            assert spec.speculator.accepted > 0, "the records' keys are drafted and accepted"
            spec.check_integrity()
