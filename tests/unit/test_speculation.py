"""Speculative decoding (engine/speculation.py) on a tiny random model: speculation on gives what
speculation off gives, token for token, for greedy and seeded sampling, at max_tokens boundaries,
with stop tokens and under preemption; the KV of rejected drafts is rolled back and the prefix
cache never hashes an unverified token. Plus the drafter and the policy as pure functions."""

from __future__ import annotations

import random
from collections.abc import Collection
from dataclasses import replace

import pytest

from engine.drafters import Draft, OutputTree, PromptLookup, SuffixDrafter
from engine.engine import Engine
from engine.kv_cache import KVCacheManager, prefix_hashes
from engine.model import LlamaModel
from engine.outputs import RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import SchedulerOutput
from engine.speculation import (
    MAX_TRUST,
    Speculator,
    accepted,
    row_cost,
    trusted,
    updated_trust,
    verify_len,
)
from tests.unit.kv_harness import make_pair
from tests.unit.tiny import make_engine

BS = 4


def looping(i: int, n: int = 24) -> list[int]:
    """A prompt that repeats itself, so that prompt lookup has something to draft."""
    motif = [(7 * i + 3 * j) % 120 + 1 for j in range(5)]
    return (motif * (n // 5 + 1))[:n]


def run(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> dict[str, list[RequestOutput]]:
    """Run the requests to the end, checking integrity and the prefix cache after every step."""
    outs: dict[str, list[RequestOutput]] = {}
    for i, (p, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(f"r{i}", p, sp)
        outs[f"r{i}"] = []
    while engine.has_unfinished():
        for o in engine.step():
            outs[o.request_id].append(o)
        engine.check_integrity()
        for req in engine.scheduler.running:  # only verified tokens are hashed
            hashes = engine.kv.block_hashes(req.request_id)
            assert len(hashes) <= req.num_computed_tokens // BS
            assert hashes == prefix_hashes(req.cache_keys()[: len(hashes) * BS], BS)
    return outs


def tokens(outs: list[RequestOutput]) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


SETTINGS = [
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.8, seed=11, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=1.3, top_k=7, seed=5, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.6, top_p=0.8, seed=2, ignore_eos=True, logprobs=3),
    SamplingParams(max_tokens=40, temperature=1.0, min_p=0.1, seed=4, ignore_eos=True),
    SamplingParams(max_tokens=40, temperature=0.9, seed=6, ignore_eos=True, allowed_token_ids=tuple(range(0, 64, 2))),
    # one-token words, and pairs a draft can run into: (t, t + 1), (t, t) for even t
    SamplingParams(
        max_tokens=40,
        temperature=0,
        ignore_eos=True,
        bad_words=tuple((t,) for t in range(0, 128, 5)) + tuple((t, t + d) for t in range(0, 128, 2) for d in (0, 1)),
    ),
    # penalties read the answer so far: a drafted position's includes the draft before it
    SamplingParams(max_tokens=40, temperature=0, ignore_eos=True, repetition_penalty=1.1, frequency_penalty=0.1),
    SamplingParams(
        max_tokens=40,
        temperature=0.8,
        seed=9,
        ignore_eos=True,
        presence_penalty=0.3,
        logit_bias=((3, 2.0), (8, -5.0)),
        logprobs=2,
    ),
]


@pytest.mark.parametrize("drafter", ["ngram", "suffix"])
@pytest.mark.parametrize(
    "params",
    SETTINGS,
    ids=[
        "greedy",
        "t0.8",
        "t1.3-k7",
        "t0.6-p0.8-lp",
        "t1.0-minp0.1",
        "t0.9-allowed",
        "greedy-bad-words",
        "greedy-penalized",
        "t0.8-penalized-lp",
    ],
)
def test_speculation_gives_the_tokens_of_no_speculation(
    tiny_model: LlamaModel, params: SamplingParams, drafter: str
) -> None:
    prompts = [looping(i, 12 + 5 * i) for i in range(6)]
    off = run(make_engine(tiny_model, num_blocks=256), prompts, [params] * 6)
    spec = make_engine(tiny_model, num_blocks=256, speculative=drafter)
    run(spec, prompts, [params] * 6)  # a first pass fills the suffix drafter's output tree
    on = run(spec, prompts, [params] * 6)
    for rid in off:
        assert tokens(on[rid]) == tokens(off[rid]), rid
        assert on[rid][-1].finish_reason == off[rid][-1].finish_reason == "length"
        lp_on = [lp for o in on[rid] for lp in o.logprobs]
        lp_off = [lp for o in off[rid] for lp in o.logprobs]
        assert [x.token_id for x in lp_on] == [x.token_id for x in lp_off]
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(lp_on, lp_off, strict=True))
    assert spec.speculator is not None and spec.speculator.drafted > 0
    assert 0 < spec.speculator.accepted < spec.speculator.drafted, "both acceptances and rejections ran"
    # each request's running totals ride on its outputs (the router's timing breakdown shows them)
    totals = [max((o.num_draft_tokens, o.num_accepted_tokens) for o in outs) for outs in on.values()]
    assert all(a <= d for d, a in totals) and 0 < sum(a for _, a in totals) <= spec.speculator.accepted
    assert spec.kv.num_free_blocks == 256


def test_max_tokens_stop_tokens_and_preemption_behave_as_without_speculation(tiny_model: LlamaModel) -> None:
    rng = random.Random(0)
    prompts = [looping(i, rng.randrange(8, 30)) for i in range(10)]
    params = [SamplingParams(max_tokens=rng.randrange(1, 30), temperature=rng.choice([0, 0.7]), seed=i,
                             ignore_eos=True) for i in range(10)]  # fmt: skip
    free = run(make_engine(tiny_model, num_blocks=256), prompts, params)
    for i in range(0, 10, 3):  # a stop token that the answer holds, a few tokens in
        answer = tokens(free[f"r{i}"])
        params[i] = replace(params[i], stop_token_ids=[answer[len(answer) // 2]])
    off = run(make_engine(tiny_model, num_blocks=256), prompts, params)
    # 40 blocks of 4 for 10 requests of up to ~60 tokens: preemptions, drafts pending among them
    spec = make_engine(tiny_model, num_blocks=40, speculative="ngram", max_num_batched_tokens=32)
    preempted: list[str] = []
    schedule = spec.scheduler.schedule

    def counted(alone: Collection[str] = ()) -> SchedulerOutput:  # a wrapper on the public method: counts
        out = schedule(alone)
        preempted.extend(out.preempted)
        return out

    spec.scheduler.schedule = counted  # type: ignore[method-assign]
    on = run(spec, prompts, params)
    for rid in off:
        assert tokens(on[rid]) == tokens(off[rid]), rid
        assert on[rid][-1].finish_reason == off[rid][-1].finish_reason
        assert on[rid][-1].num_output_tokens == off[rid][-1].num_output_tokens
    assert {off[f"r{i}"][-1].finish_reason for i in range(0, 10, 3)} == {"stop"}
    assert preempted, "the small cache preempted requests"
    assert spec.speculator is not None and spec.speculator.accepted > 0
    assert spec.kv.num_free_blocks == 40


@pytest.mark.parametrize(
    "penalties", [{}, {"presence_penalty": 0.5, "frequency_penalty": 0.6, "repetition_penalty": 1.2}]
)
def test_the_decode_side_of_pd_speculates_to_the_same_tokens(
    tiny_model: LlamaModel, penalties: dict[str, float]
) -> None:
    # with penalties, the decode side counts the first token, which the prefill side sampled
    pair = make_pair(tiny_model, decode_kw={"speculative": "ngram"})
    try:
        client = pair.client()
        params = SamplingParams(max_tokens=30, temperature=0.9, seed=4, ignore_eos=True, **penalties)  # type: ignore[arg-type]
        prompts = [looping(i, 10 + 3 * i) for i in range(4)]
        for i, prompt in enumerate(prompts):
            first, _, _ = pair.transfer(client, f"p{i}", prompt, params)
            pair.receiver.wait(f"p{i}", 2.0)
            pair.receiver.admit(f"p{i}", prompt, first.new_token_ids[0], params)
        got: dict[str, list[int]] = {f"p{i}": [] for i in range(len(prompts))}
        while pair.decode.has_unfinished():
            for o in pair.decode.step():
                got[o.request_id] += o.new_token_ids
            pair.decode.check_integrity()
        alone = make_engine(tiny_model, num_blocks=256).generate(prompts, params)
        assert [got[f"p{i}"] for i in range(len(prompts))] == [c.token_ids for c in alone]
        assert pair.decode.speculator is not None and pair.decode.speculator.accepted > 0
        client.close()
    finally:
        pair.close()


def test_prompt_lookup_drafts_what_followed_the_longest_tail() -> None:
    d = PromptLookup(max_draft=3)
    d.update([1, 2, 3, 4, 5, 9, 2, 3, 4])
    # tail [2, 3, 4] seen at 1..3, followed by 5, 9, 2: a 3-token match's first token, then copies
    assert d.propose() == Draft((5, 9, 2), (0.55, 0.85, 0.85))
    d.update([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 7])
    assert d.propose() == Draft((), ())  # [4, 7, 7], [7, 7] never seen before
    d.update([1, 2, 3, 4, 5, 9, 2, 3, 4, 7, 7, 2, 3])
    assert d.propose().token_ids == (4, 7, 7), "the latest occurrence wins"


def test_output_tree_drafts_the_most_frequent_continuation_within_its_capacity() -> None:
    tree = OutputTree(capacity=12, max_draft=3, min_count=2)
    tree.add([9, 1], [2, 3, 4])
    tree.add([9, 1], [2, 3, 4])
    tree.add([9, 1], [2, 3, 5])
    tree.check_integrity()
    d = tree.propose([7, 9, 1])  # [9, 1] -> 2 (3 of 3), [1, 2] -> 3 (3 of 3), [2, 3] -> 4 (2 of 3)
    assert d.token_ids == (2, 3, 4) and d.confidence == (1.0, 1.0, pytest.approx(2 / 3))
    assert tree.propose([8, 8]) == Draft((), ())
    tree.add([0, 0], [6, 6, 6, 6])  # 13 tokens > 12: the oldest go
    tree.check_integrity()
    assert tree.tokens <= 12
    drafter = SuffixDrafter(tree, 3)
    drafter.update([5, 9, 1])
    assert drafter.propose().token_ids[:1] == (2,), "the request's own text has no match: the tree drafts"
    tree.clear()
    tree.check_integrity()
    assert tree.tokens == 0 and tree.propose([7, 9, 1]) == Draft((), ())


def test_reset_forgets_the_requests_that_finished_since_the_last_draft(tiny_model: LlamaModel) -> None:
    """A finished request joins the output tree at the next draft; after reset it never does, so
    a benchmark round drafts nothing from the round before (clearing the tree alone let the last
    requests of a round in: the next round then drafted their very answers)."""
    spec = make_engine(tiny_model, speculative="suffix", num_speculative_tokens=3)
    s = spec.speculator
    assert s is not None and s.tree is not None
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    run(spec, [looping(1)], [params])
    assert s.tree.tokens == 0, "the finished request waits for the next draft"
    s.reset()
    run(spec, [looping(2)], [params])
    assert s.tree.tokens == 0, "the first request was forgotten, the second is pending"
    run(spec, [looping(3)], [params])
    assert s.tree.tokens == 12, "without reset, the one before joins at the next draft"
    s.tree.check_integrity()
    spec.check_integrity()


def test_verify_len_keeps_the_confident_prefix_and_less_under_load() -> None:
    # a row costs rows / (rows + 5) of a token: half a token at 5 rows, 0.95 at most
    assert row_cost(1) == pytest.approx(1 / 6) and row_cost(5) == 0.5 and row_cost(1000) == 0.95
    draft = Draft((1, 2, 3, 4), (0.95, 0.9, 0.8, 0.5))  # cumulative: 0.95, 0.855, 0.684, 0.342
    # token i's row costs row_cost(rows + i)
    assert verify_len(draft, rows=1) == 3  # 0.167, 0.286, 0.375 pass; 0.342 < 0.444
    assert verify_len(draft, rows=6) == 3  # 0.545, 0.583, 0.615 pass; 0.342 < 0.643
    assert verify_len(draft, rows=9) == 2  # 0.643, 0.667 pass; 0.684 < 0.6875
    assert verify_len(draft, rows=30) == 1  # 0.857 passes; 0.855 < 0.861
    assert verify_len(draft, rows=200) == 1  # capped at 0.95: a sure first token still goes
    assert verify_len(Draft((), ()), rows=1) == 0


@pytest.mark.parametrize(("running", "granted"), [(4, [3, 2, 2, 0]), (8, [2, 0, 0, 0, 0, 0, 0, 0])])
def test_drafts_granted_earlier_in_a_step_make_later_ones_dearer(running: int, granted: list[int]) -> None:
    spec = Speculator(KVCacheManager(64, 4), max_draft=4, max_model_len=256)
    reqs = []
    for i in range(running):
        r = Request(f"r{i}", [5, 6, 7, 8] * 3 + [5, 6], SamplingParams(max_tokens=50), arrival_seq=i)
        r.token_ids.append(7)  # its first output token: decoding
        r.num_computed_tokens = r.num_tokens - 1
        reqs.append(r)
    spec.draft(reqs)
    # each proposes [8, 5, 6, 7], a 4-token match: 0.8 for the first token, 0.85 for each next
    # (cumulative 0.8, 0.68, 0.578, 0.491), against row costs rows / (rows + 5) that grow with
    # each grant. 4 running: r0 passes 0.444, 0.5, 0.545 (not 0.583), r1 0.583, 0.615 (not
    # 0.643), r2 0.643, 0.667 (not 0.6875); at 11 rows a row costs 0.6875 >= DRAFT_BELOW_COST: r3
    # does not look. 8 running: r0 0.615, 0.643 (not 0.667), then at 10 rows no one looks.
    assert [len(r.draft) for r in reqs] == granted
    assert reqs[0].draft == (8, 5, 6, 7)[: granted[0]]


def test_a_request_whose_prompts_last_token_is_left_drafts_nothing() -> None:
    """Its last prompt token is prefilled (ScheduledChunk.is_decode), as it is when the prompt
    runs whole, so its first output token does not depend on a prefix-cache hit."""
    spec = Speculator(KVCacheManager(64, 4), max_draft=4, max_model_len=256)
    r = Request("r", [5, 6, 7, 8] * 3 + [5, 6, 7], SamplingParams(max_tokens=50), arrival_seq=0)
    r.num_computed_tokens = r.num_tokens - 1  # the rest in the prefix cache
    spec.draft([r])
    assert r.draft == ()


def test_trust_scales_the_first_token_by_how_the_drafter_fared() -> None:
    assert updated_trust(1.0, 0.5, True) == pytest.approx(0.7 + 0.3 * 2)  # right where it said 0.5
    assert updated_trust(1.0, 0.8, False) == pytest.approx(0.7)
    assert updated_trust(1.9, 0.1, True) == MAX_TRUST
    d = Draft((4, 5), (0.5, 0.85))
    assert trusted(d, 1.3) == Draft((4, 5), (pytest.approx(0.65), 0.85)), "only the first token's"
    assert trusted(d, 3.0).confidence[0] == 1.0 and trusted(Draft((), ()), 2.0) == Draft((), ())


@pytest.mark.parametrize(("came", "then"), [(5, (1, 2)), (3, ())])
def test_a_draft_not_verified_is_scored_against_the_token_that_came(came: int, then: tuple[int, ...]) -> None:
    """Trust learns from every draft proposed, so a request whose drafts were not worth a row
    for a while drafts again when its text turns copyable (scored only on verified drafts, a
    request under a row's cost never moved again)."""
    spec = Speculator(KVCacheManager(64, 4), max_draft=4, max_model_len=256)
    busy = [Request(f"p{i}", [1] * 8, SamplingParams(max_tokens=8), arrival_seq=i) for i in range(5)]  # prefilling
    req = Request("r", [1, 2, 3, 9, 1, 2, 5, 1], SamplingParams(max_tokens=50), arrival_seq=5)
    req.token_ids.append(2)  # its first output token: decoding
    req.num_computed_tokens = req.num_tokens - 1
    spec.draft([*busy, req])
    # a 2-token match ([1, 2] -> 5, 1, 2) at 0.5 against a row of 0.545 (6 rows): not verified
    assert req.draft == ()
    req.token_ids.append(came)
    req.num_computed_tokens += 1
    spec.draft([*busy, req])
    # 5 came: trust 0.7 + 0.3 x 1 / 0.5 = 1.3; [1, 2, 5] -> 1, 2, 5 at 0.55 x 1.3 = 0.715, then
    # 0.608, 0.517: 2 tokens pass 0.545, 0.583 (not 0.615). 3 came: trust 0.7; [1, 2, 3] -> 9, 1,
    # 2, 5 at 0.55 x 0.7 = 0.385 < 0.545 (at trust 1 its first token would pass).
    assert req.draft == then


def test_accepted_counts_the_confirmed_prefix() -> None:
    assert accepted([5, 6, 7], [5, 6, 7, 8]) == 3
    assert accepted([5, 6, 7], [5, 9, 7, 8]) == 1
    assert accepted([5], [4, 1]) == 0


def test_min_tokens_holds_back_the_same_stop_tokens_with_and_without_speculation(tiny_model: LlamaModel) -> None:
    prompts = [looping(i, 12 + 3 * i) for i in range(6)]
    base = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    free = run(make_engine(tiny_model, num_blocks=256), prompts, [base] * 6)
    stops = [tokens(free[f"r{i}"])[2] for i in range(6)]  # each answer's third token ends it early
    params = [replace(base, stop_token_ids=[stops[i]], min_tokens=10, temperature=0.8 * (i % 2), seed=i)
              for i in range(6)]  # fmt: skip
    off = run(make_engine(tiny_model, num_blocks=256), prompts, params)
    spec = make_engine(tiny_model, num_blocks=256, speculative="ngram")
    on = run(spec, prompts, params)
    for i, rid in enumerate(off):
        assert tokens(on[rid]) == tokens(off[rid]), rid
        assert len(tokens(off[rid])) >= 10 and stops[i] not in tokens(off[rid])[:10], rid
    assert spec.speculator is not None and spec.speculator.accepted > 0
