"""Prompt logprobs (engine/prompt_logprobs.py) on a tiny random model: each prompt token's logprob
equals the logprob the engine gives that token when it samples it after the same prefix, in
chunks or whole, batched or alone, with the prefix cache warm, and the blocks all come back."""

from __future__ import annotations

import random

import pytest

from engine.engine import Engine
from engine.errors import InvalidRequestError
from engine.model import LlamaModel
from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from tests.unit.tiny import make_engine

SCORED = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True, prompt_logprobs=5)


def reference(model: LlamaModel, prompt: list[int]) -> list[TokenLogprob]:
    """Token p's logprob after prompt[:p], as the engine's sampler reports a token it samples
    there: forced by a bias (logprobs come from the raw logits), top 5 alongside."""
    e = make_engine(model, num_blocks=64, enable_prefix_caching=False)
    out = []
    for p in range(1, len(prompt)):
        forced = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, logprobs=5,
                                logit_bias=((prompt[p], 100.0),))  # fmt: skip
        (lp,) = e.generate([prompt[:p]], forced)[0].logprobs
        assert lp.token_id == prompt[p]
        out.append(lp)
    return out


def assert_close(got: tuple[TokenLogprob, ...], want: list[TokenLogprob]) -> None:
    assert [g.token_id for g in got] == [w.token_id for w in want]
    assert [g.logprob for g in got] == pytest.approx([w.logprob for w in want], abs=1e-4)
    for g, w in zip(got, want, strict=True):
        assert [t for t, _ in g.top] == [t for t, _ in w.top]
        assert [v for _, v in g.top] == pytest.approx([v for _, v in w.top], abs=1e-4)
        top5 = [t for t, _ in w.top]  # its rank: its place there, or past it
        assert g.rank is not None
        assert (g.rank == top5.index(g.token_id) + 1) if g.token_id in top5 else (g.rank > 5)


def run(engine: Engine, prompts: dict[str, list[int]], params: SamplingParams) -> dict[str, tuple[TokenLogprob, ...]]:
    """Each request's prompt logprobs (from its first output only), integrity checked every step."""
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    got: dict[str, tuple[TokenLogprob, ...]] = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.prompt_logprobs:
                assert o.request_id not in got, "sent once, with the first token"
                assert o.num_output_tokens == 1
                got[o.request_id] = o.prompt_logprobs
        engine.check_integrity()
    assert engine.kv.num_requests == 0
    return got


def test_each_prompt_token_scored_as_if_sampled_there(tiny_model: LlamaModel) -> None:
    rng = random.Random(5)
    prompts = {f"r{i}": [rng.randrange(128) for _ in range(rng.randrange(2, 40))] for i in range(4)}
    # chunks of 8 (a prompt's rows over several steps), the four side by side
    e = make_engine(tiny_model, num_blocks=64, max_num_batched_tokens=16, max_prefill_chunk=8)
    got = run(e, prompts, SCORED)
    assert set(got) == set(prompts)
    for rid, p in prompts.items():
        assert len(got[rid]) == len(p) - 1, "every token but the first"
        assert_close(got[rid], reference(tiny_model, p))


def test_a_warm_prefix_cache_is_not_used_and_the_answer_is_the_same(tiny_model: LlamaModel) -> None:
    prompt = [random.Random(2).randrange(128) for _ in range(37)]
    e = make_engine(tiny_model, num_blocks=64)
    plain = e.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    (scored,) = e.generate([prompt], SCORED)
    assert scored.num_cached_tokens == 0, "every position computed, though the cache held the prompt"
    assert scored.token_ids == plain.token_ids
    assert_close(scored.prompt_logprobs, reference(tiny_model, prompt))
    again = e.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))[0]
    assert again.num_cached_tokens > 0 and not again.prompt_logprobs, "others still hit it; none asked"
    e.check_integrity()


def test_top_zero_a_one_token_prompt_and_the_bounds(tiny_model: LlamaModel) -> None:
    e = make_engine(tiny_model, num_blocks=64)
    (c,) = e.generate([[3, 9, 4]], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    assert [lp.token_id for lp in c.prompt_logprobs] == [9, 4] and all(lp.top == () for lp in c.prompt_logprobs)
    (one,) = e.generate([[3]], SCORED)
    assert one.prompt_logprobs == () and len(one.token_ids) == 3, "nothing predicts a first token"
    for bad in (-1, 21):
        with pytest.raises(InvalidRequestError):
            SamplingParams(prompt_logprobs=bad)
    e.check_integrity()
    assert e.kv.num_free_blocks == e.config.num_blocks
