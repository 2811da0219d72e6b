"""Our engine against HF transformers on the real SmolLM2 model, both fp32.

Greedy token ids must be equal for 64 new tokens; a divergence is accepted only at a
genuine near-tie (HF's top-2 logit gap < 1e-4 at the first differing step), which the
test reports. Teacher-forced logits must agree within 1e-3.

HF's greedy answer is checked through one teacher-forced forward over the prompt and our
answer: HF's argmax after each prefix of it. Up to the first difference those prefixes are the
ones HF's own greedy loop would see, so the first position where HF's argmax is not our token
is where HF's greedy answer leaves ours. (HF's loop, a forward a token, took 4-5 s a prompt here.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
import torch

from engine.attention import AttentionMetadata, PrefillChunk
from engine.engine import Engine
from engine.paged_cache import PagedKVCache
from engine.sampling_params import SamplingParams
from router.vllm_fields import bad_word_ids
from tests.integration.reference import CHAT, NEW_TOKENS, RAW, reference_prompts


def hf_logits(hf: Any, ids: list[int]) -> torch.Tensor:
    """HF's teacher-forced logits over `ids`."""
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def our_logits(engine: Engine, ids: list[int]) -> torch.Tensor:
    """Teacher-forced logits of our model over `ids`, through the paged cache."""
    bs = engine.config.block_size
    cache = PagedKVCache(engine.model.config, -(-len(ids) // bs), bs, engine.model.dtype)
    n = len(ids)
    meta = AttentionMetadata(torch.arange(n), 0, None, None, (PrefillChunk(0, n, 0, torch.arange(cache.num_blocks)),))
    return engine.model.forward(torch.tensor(ids), torch.arange(n), cache, meta, torch.arange(n))


@pytest.mark.parametrize("index,text", list(enumerate(CHAT + RAW)))
def test_greedy_and_logits_match_hf(
    engine_fp32: Engine, hf_model: Any, fp32_greedy: list[list[int]], index: int, text: str
) -> None:
    prompt, ours = reference_prompts(engine_fp32)[index], fp32_greedy[index]
    assert len(ours) == NEW_TOKENS

    ids = prompt + ours
    ref_logits = hf_logits(hf_model, ids)
    diff = (our_logits(engine_fp32, ids) - ref_logits).abs().max().item()
    assert diff <= 1e-3, f"teacher-forced logits differ by {diff}"

    hf_next = ref_logits[len(prompt) - 1 : len(ids) - 1].argmax(-1).tolist()  # HF's pick after each prefix
    if hf_next != ours:
        i = next(j for j, (a, b) in enumerate(zip(ours, hf_next, strict=True)) if a != b)
        top2 = ref_logits[len(prompt) + i - 1].topk(2).values
        gap = (top2[0] - top2[1]).item()
        print(f"divergence at step {i}: ours {ours[i]} vs HF {hf_next[i]}, HF top-2 gap {gap:.2e}")
        assert gap < 1e-4, f"greedy output differs at step {i} with a top-2 gap of {gap} (not a near-tie)"


def test_batched_real_model_matches_alone(engine_fp32: Engine, fp32_greedy: list[list[int]]) -> None:
    """Each reference prompt alone starts as it did in the batch (fp32_greedy)."""
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    for p, together in zip(reference_prompts(engine_fp32), fp32_greedy, strict=True):
        assert engine_fp32.generate([p], params)[0].token_ids == together[:24]
    engine_fp32.check_integrity()


def test_penalties_and_logit_bias_match_hf_and_openais_formula(engine_fp32: Engine, hf_model: Any) -> None:
    """Greedy with a logit bias, repetition (HF's own processor: over prompt and answer) and
    presence/frequency penalties (OpenAI's formula: over the answer) against HF's teacher-forced
    logits put through the same, step by step."""
    from transformers import RepetitionPenaltyLogitsProcessor

    tok = engine_fp32.tokenizer
    assert tok is not None
    bias = ((tok.encode(" the")[0], -4.0), (tok.encode(".")[0], 1.5))
    params = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True, repetition_penalty=1.3,
                            presence_penalty=0.6, frequency_penalty=0.4, logit_bias=bias)  # fmt: skip
    repetition = RepetitionPenaltyLogitsProcessor(penalty=1.3)
    texts = [tok.apply_chat_template([{"role": "user", "content": t}]) for t in CHAT[:3]] + RAW[:2]
    prompts = [tok.encode(text) for text in texts]
    answers = [o.token_ids for o in engine_fp32.generate(prompts, params)]  # one batch, as served
    plain = engine_fp32.generate(prompts, SamplingParams(max_tokens=48, temperature=0, ignore_eos=True))
    changed = sum(ours != p.token_ids for ours, p in zip(answers, plain, strict=True))
    for text, prompt, ours in zip(texts, prompts, answers, strict=True):
        ref = hf_logits(hf_model, prompt + ours)
        for j, token in enumerate(ours):
            x = ref[len(prompt) + j - 1].clone()
            for t, b in bias:
                x[t] += b
            x = repetition(torch.tensor([prompt + ours[:j]]), x.unsqueeze(0))[0]
            counts = torch.bincount(torch.tensor(ours[:j], dtype=torch.int64), minlength=x.shape[0]).float()
            x -= 0.4 * counts + 0.6 * (counts > 0).float()
            top2 = x.topk(2)
            if int(top2.indices[0]) != token:
                gap = (top2.values[0] - top2.values[1]).item()
                assert gap < 1e-4, f"{text[:30]!r}: step {j} ours {token}, reference {int(top2.indices[0])} (gap {gap})"
                break  # a genuine near-tie: the two answers part here
    assert changed >= 3, "the penalties changed most answers"
    engine_fp32.check_integrity()


def test_prompt_logprobs_match_hf(engine_fp32: Engine, hf_model: Any) -> None:
    """Each prompt token's logprob (its rank, and the top 5 there) as HF's log_softmax over its teacher-forced
    logits says, for a prompt of several chunks, the prefix cache warm with it."""
    tok = engine_fp32.tokenizer
    assert tok is not None
    prompt = tok.encode(" ".join(RAW) * 30)[:1100]  # 3 chunks of 512
    engine_fp32.generate([prompt], SamplingParams(max_tokens=1, temperature=0))  # now cached
    (c,) = engine_fp32.generate([prompt], SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=5))
    engine_fp32.check_integrity()
    ref = torch.log_softmax(hf_logits(hf_model, prompt)[:-1], dim=-1)  # position p scores token p + 1
    assert [lp.token_id for lp in c.prompt_logprobs] == prompt[1:]
    want = ref.gather(1, torch.tensor(prompt[1:]).unsqueeze(1)).squeeze(1)
    assert torch.tensor([lp.logprob for lp in c.prompt_logprobs]) == pytest.approx(want, abs=1e-3)
    # each rank: 1 + the tokens HF scores above it, give or take those within 1e-3 of it
    above = (ref > want.unsqueeze(1) + 1e-3).sum(dim=1) + 1
    within = (ref >= want.unsqueeze(1) - 1e-3).sum(dim=1)
    assert all(lo <= lp.rank <= max(lo, hi) for lp, lo, hi in zip(c.prompt_logprobs, above, within, strict=True))
    top = ref.topk(5, dim=-1)
    for p in (0, 511, 512, 1098):  # chunk edges, and the last
        got = c.prompt_logprobs[p].top
        assert [v for _, v in got] == pytest.approx(top.values[p].tolist(), abs=1e-3)
        near_tie = (top.values[p][:-1] - top.values[p][1:]).abs().min() < 1e-3
        assert near_tie or [t for t, _ in got] == top.indices[p].tolist()


def test_a_stop_string_is_cut_or_kept_as_asked(engine_fp32: Engine) -> None:
    """vLLM's include_stop_str_in_output: the text up to the stop string, then with it."""
    prompt = reference_prompts(engine_fp32)[0]
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    (plain,) = engine_fp32.generate([prompt], greedy)
    stop = plain.text[len(plain.text) // 2 :][:5]  # from the answer's middle
    at = plain.text.find(stop)
    cut, kept = (
        engine_fp32.generate([prompt], dataclasses.replace(greedy, stop=(stop,), include_stop_str_in_output=k))[0]
        for k in (False, True)
    )
    assert (cut.text, cut.finish_reason) == (plain.text[:at], "stop")
    assert (kept.text, kept.finish_reason, kept.token_ids) == (plain.text[: at + len(stop)], "stop", cut.token_ids)
    engine_fp32.check_integrity()


def test_bad_words_keep_a_word_out_of_the_answer(engine_fp32: Engine) -> None:
    """vLLM's bad_words, tokenized as the router does: the greedy answer's capital is not named."""
    tok = engine_fp32.tokenizer
    assert tok is not None
    prompt = tok.encode(tok.apply_chat_template([{"role": "user", "content": CHAT[0]}]))
    greedy = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    (plain,) = engine_fp32.generate([prompt], greedy)
    assert "Paris" in plain.text
    banned = dataclasses.replace(greedy, bad_words=bad_word_ids(tok, ["Paris"]))
    (other,) = engine_fp32.generate([prompt], banned)
    assert "Paris" not in other.text and other.text[:10] == plain.text[:10], (plain.text, other.text)
    engine_fp32.check_integrity()
