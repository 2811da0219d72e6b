"""Logit bias and penalties (engine/penalties.py): each against a plain reference, where the
sampler applies them, what they leave alone (logprobs, other rows), and their bounds."""

from __future__ import annotations

import random

import pytest
import torch

from engine.errors import InvalidRequestError
from engine.grammar import Guide
from engine.penalties import SeenTokens, apply_penalties
from engine.sampler import Sampler
from engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams

V = 40


def reference(x: list[float], p: SamplingParams, seen: SeenTokens) -> list[float]:
    """One row, token by token, as the docstring of engine/penalties.py says."""
    answer = list(seen.token_ids[seen.answer_from :])
    out = list(x)
    for t, b in p.logit_bias:
        out[t] += b
    for t in range(len(out)):
        if t in seen.token_ids and p.repetition_penalty != 1:
            out[t] = out[t] / p.repetition_penalty if out[t] > 0 else out[t] * p.repetition_penalty
        n = answer.count(t)
        out[t] -= p.frequency_penalty * n + (p.presence_penalty if n else 0.0)
    return out


def random_case(rng: random.Random) -> tuple[SamplingParams, SeenTokens]:
    tokens = [rng.randrange(V) for _ in range(rng.randrange(1, 30))]
    params = SamplingParams(
        temperature=0,
        presence_penalty=rng.choice([0.0, 1.5, -0.7]),
        frequency_penalty=rng.choice([0.0, 0.4, -2.0]),
        repetition_penalty=rng.choice([1.0, 1.3, 0.8]),
        logit_bias=tuple((rng.randrange(V), rng.uniform(-100, 100)) for _ in range(rng.randrange(3))),
    )
    return params, SeenTokens(tokens, rng.randrange(len(tokens) + 1))


def test_each_row_matches_the_reference() -> None:
    rng = random.Random(3)
    cases = [random_case(rng) for _ in range(40)]
    x = torch.randn(len(cases), V, generator=torch.Generator().manual_seed(1)) * 4
    got = apply_penalties(x, [p for p, _ in cases], [s for _, s in cases])
    for j, (p, s) in enumerate(cases):
        assert got[j].tolist() == pytest.approx(reference(x[j].tolist(), p, s), abs=1e-4), p
    assert not torch.equal(got, x) and x.isfinite().all(), "a new tensor, the input untouched"


def test_presence_and_frequency_count_the_answer_and_repetition_the_prompt_too() -> None:
    x = torch.full((1, V), 2.0)
    seen = SeenTokens([5, 5, 6, 7, 7, 7], answer_from=3)  # prompt 5 5 6, answer 7 7 7
    both = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    row = apply_penalties(x, [both], [seen])[0]
    assert row[7].item() == pytest.approx(2.0 - 0.5 - 3 * 0.25) and row[5].item() == row[6].item() == 2.0
    rep = apply_penalties(x - 3, [SamplingParams(repetition_penalty=2.0)], [seen])[0]  # logits -1: multiplied
    assert [rep[t].item() for t in (5, 6, 7, 8)] == [-2.0, -2.0, -2.0, -1.0]
    rep = apply_penalties(x, [SamplingParams(repetition_penalty=2.0)], [seen])[0]  # logits 2: divided
    assert [rep[t].item() for t in (5, 6, 7, 8)] == [1.0, 1.0, 1.0, 2.0]


def test_the_sampler_applies_them_to_penalized_rows_only_and_keeps_the_models_logprobs() -> None:
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(4))
    top = x.argmax(-1).tolist()
    banned = SamplingParams(temperature=0, logit_bias=((top[0], -100.0),), logprobs=2)
    plain = SamplingParams(temperature=0, logprobs=2)
    seeded = SamplingParams(temperature=0.9, seed=3, logit_bias=tuple((t, -100.0) for t in range(V) if t != 11))
    seen = [SeenTokens([1], 1), None, SeenTokens([2], 1)]
    out = Sampler()(x, [banned, plain, seeded], [0, 0, 0], seen)
    second = x[0].clone()
    second[top[0]] = float("-inf")
    assert out.token_ids == [int(second.argmax()), top[1], 11]
    raw = torch.log_softmax(x, dim=-1)
    lp0, lp1 = out.logprobs[0], out.logprobs[1]
    assert lp0 is not None and lp1 is not None
    assert lp0.logprob == pytest.approx(raw[0, out.token_ids[0]].item(), abs=1e-5)
    assert lp0.top[0][0] == top[0], "logprobs are the model's, before the bias"
    assert lp1.token_id == top[1]
    with pytest.raises(ValueError, match="penalized row 0"):
        Sampler()(x[:1], [banned], [0])


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("presence_penalty", 2.5),
        ("frequency_penalty", -2.1),
        ("presence_penalty", float("nan")),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 11.0),
        ("logit_bias", ((3, 101.0),)),
        ("logit_bias", ((3, float("nan")),)),
        ("logit_bias", tuple((t, 1.0) for t in range(MAX_LOGIT_BIAS + 1))),
        ("min_tokens", 17),  # over max_tokens (16)
        ("min_tokens", -1),
    ],
)
def test_values_out_of_range_are_refused(field: str, value: object) -> None:
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert e.value.param == field


def test_a_bias_on_a_token_outside_the_vocabulary_is_refused() -> None:
    SamplingParams(logit_bias=((V - 1, 5.0),)).validate_for_vocab(V)
    with pytest.raises(InvalidRequestError, match="unknown token id 40"):
        SamplingParams(logit_bias=((V, 5.0),)).validate_for_vocab(V)
    assert not SamplingParams().penalized and SamplingParams(repetition_penalty=1.1).penalized


def test_min_tokens_bans_stop_tokens_and_counts_the_answer_of_earlier_runs() -> None:
    x = torch.zeros(2, V)
    seen = [SeenTokens([1, 2, 3], 2, banned=(5, 9)), None]
    out = apply_penalties(x, [SamplingParams(min_tokens=4), SamplingParams()], seen)
    assert out[0, 5] == out[0, 9] == float("-inf") and out[0].isfinite().sum() == V - 2 and torch.equal(out[1], x[1])
    # a replay carrying 10 outputs of an answer that asked for at least 20, of 24: 14 to go
    assert SamplingParams(max_tokens=14, output_offset=10, min_tokens=20).penalized


def test_allowed_token_ids_leave_only_those_to_sample_greedy_or_not() -> None:
    x = torch.randn(3, V, generator=torch.Generator().manual_seed(7))
    allowed = (3, 17, 17, 30)  # a repeat is one token
    seen = [SeenTokens([1], 1), SeenTokens([1], 1), None]
    greedy = SamplingParams(temperature=0, allowed_token_ids=allowed)
    sampled = SamplingParams(allowed_token_ids=allowed)
    out = apply_penalties(x, [greedy, sampled, SamplingParams()], seen)
    assert out[0].isfinite().nonzero().flatten().tolist() == [3, 17, 30]
    assert torch.equal(out[0, [3, 17, 30]], x[0, [3, 17, 30]])
    assert torch.equal(out[2], x[2])
    best = max((3, 17, 30), key=lambda t: x[0, t].item())
    assert Sampler()(x[:1], [greedy], [0], seen[:1]).token_ids == [best]
    draws = Sampler()(x[1:2].expand(300, -1), [sampled] * 300, [0] * 300, [seen[1]] * 300).token_ids
    assert set(draws) == {3, 17, 30}
    assert greedy.penalized
    with pytest.raises(InvalidRequestError, match="unknown token id 40"):
        SamplingParams(allowed_token_ids=(1, V)).validate_for_vocab(V)
    with pytest.raises(InvalidRequestError, match="structured output") as e:
        SamplingParams(allowed_token_ids=(1,), guide=Guide("regex", "a+"))
    assert e.value.param == "allowed_token_ids"


def test_bad_words_ban_the_token_that_would_complete_one_in_the_answer() -> None:
    x = torch.zeros(1, V)
    words = ((5,), (7, 9), (3, 3, 4))
    params = SamplingParams(bad_words=words)

    def banned(prompt: list[int], answer: list[int]) -> list[int]:
        out = apply_penalties(x, [params], [SeenTokens([*prompt, *answer], len(prompt))])
        return (~out[0].isfinite()).nonzero().flatten().tolist()

    assert banned([], []) == [5], "a one-token word always"
    assert banned([7], []) == [5], "the prompt is not the answer"
    assert banned([1], [2, 7]) == [5, 9]
    assert banned([1], [3, 3]) == [4, 5] and banned([1], [3]) == [5]
    assert params.penalized and not SamplingParams(bad_words=()).penalized
    for bad in ((),), ((1,),) * 257, (tuple(range(65)),):
        with pytest.raises(InvalidRequestError) as e:
            SamplingParams(bad_words=bad)
        assert e.value.param == "bad_words"
    with pytest.raises(InvalidRequestError, match="unknown token id 40") as e:
        SamplingParams(bad_words=((1, V),)).validate_for_vocab(V)
    assert e.value.param == "bad_words"
