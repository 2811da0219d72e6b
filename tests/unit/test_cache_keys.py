"""What the prefix cache hashes a position as (engine/cache_keys.py): its token, flagged where a
decode row computed its KV, so that a prompt finds only blocks computed the way it runs them."""

from __future__ import annotations

from dataclasses import replace

from engine.cache_keys import DECODE_ROW, SALTED, cache_keys
from engine.model import LlamaModel
from engine.request import Request
from engine.sampling_params import SamplingParams
from tests.unit.tiny import make_engine

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
D = DECODE_ROW


def test_flags_the_marked_spans_and_everything_from_where_decoding_starts() -> None:
    tokens = list(range(1, 11))
    assert cache_keys(tokens, 10, GREEDY) == tokens
    assert cache_keys(tokens, 6, GREEDY) == [1, 2, 3, 4, 5, 6, 7 | D, 8 | D, 9 | D, 10 | D]  # 4 outputs
    replay = replace(GREEDY, output_offset=2)  # a replay's prompt carries its 2 earlier outputs
    assert cache_keys(tokens, 6, replay) == [1, 2, 3, 4, 5 | D, 6 | D, 7 | D, 8 | D, 9 | D, 10 | D]
    marked = replace(GREEDY, decoded=((1, 3), (5, 9)))  # the second span runs into the outputs
    assert cache_keys(tokens, 8, marked) == [1, 2 | D, 3 | D, 4, 5, 6 | D, 7 | D, 8 | D, 9 | D, 10 | D]
    fast = replace(marked, decoded_as_prompt=True)
    assert cache_keys(tokens, 8, fast) == cache_keys(tokens, 8, marked), "they hash as decoded all the same"


def test_a_requests_keys_grow_with_its_outputs() -> None:
    params = replace(GREEDY, decoded=((1, 2),))
    req = Request("r", [5, 6, 7], params, arrival_seq=0)
    assert req.cache_keys() == [5, 6 | D, 7]
    req.token_ids += [8, 9]
    assert req.cache_keys() == [5, 6 | D, 7, 8 | D, 9 | D] == cache_keys(req.token_ids, 3, params)


def test_decoded_as_prompt_prefills_the_spans() -> None:
    marked = Request("r", list(range(10)), replace(GREEDY, decoded=((2, 5),)), arrival_seq=0)
    assert [marked.run_from(p) for p in (0, 2, 5)] == [(False, 2), (True, 5), (False, 10)]
    fast = Request("f", list(range(10)), replace(GREEDY, decoded=((2, 5),), decoded_as_prompt=True), arrival_seq=0)
    assert [fast.run_from(p) for p in (0, 2, 5)] == [(False, 10)] * 3


def test_a_next_turn_reuses_the_answer_only_where_its_prompt_says_a_decode_wrote_it(tiny_model: LlamaModel) -> None:
    """Turn 1 (17 tokens, 10 answered) leaves 6 full blocks cached (4-token blocks; the last
    token has no KV). Turn 2 carries the answer: marked, it hits all 6; unmarked (a completions
    prompt), only the 4 of the first prompt, and prefills the answer, as a cold run does;
    marked but prefilled (`--fast-history`), all 6 again. Integrity holds after each."""
    prompt = [(11 * i + 3) % 128 for i in range(17)]
    cold = make_engine(tiny_model, num_blocks=64, enable_prefix_caching=False)
    spans = ((17, 27),)
    for params, cached in (
        (GREEDY, 16),
        (replace(GREEDY, decoded=spans), 24),
        (replace(GREEDY, decoded=spans, decoded_as_prompt=True), 24),
    ):
        e = make_engine(tiny_model, num_blocks=64)
        answer = e.generate([prompt], GREEDY)[0].token_ids
        turn2 = prompt + answer + [5, 6, 7]
        out = e.generate([turn2], params)[0]
        e.check_integrity()
        assert out.num_cached_tokens == cached, params
        assert out.token_ids == cold.generate([turn2], params)[0].token_ids
        assert e.kv.num_free_blocks == 64


def test_a_salt_keys_the_first_positions_apart_and_grows_alike() -> None:
    tokens = list(range(1, 81))
    a, b = replace(GREEDY, cache_salt="tenant-a"), replace(GREEDY, cache_salt="tenant-b")
    salted = cache_keys(tokens, 80, a)
    assert all(k < 0 for k in salted[:SALTED]) and salted[SALTED:] == tokens[SALTED:], "int32, apart from unsalted"
    assert len(set(salted[:SALTED])) == SALTED and salted == cache_keys(tokens, 80, a), "fixed by salt and key"
    assert cache_keys(tokens, 80, b)[:SALTED] != salted[:SALTED]
    req = Request("r", [5, 6, 7], a, arrival_seq=0)
    req.cache_keys()
    req.token_ids += [8, 9]  # outputs within the salted positions: salted as a fresh computation salts them
    assert req.cache_keys() == cache_keys(req.token_ids, 3, a) and all(k < 0 for k in req.cache_keys())


def test_the_prefix_cache_is_shared_only_within_a_salt(tiny_model: LlamaModel) -> None:
    """Each prompt run after another: a hit only where both carry the same salt (or both none);
    the answer the same every time; integrity after each."""
    prompt = [(7 * i + 2) % 128 for i in range(40)]
    e = make_engine(tiny_model, num_blocks=64)
    outs = []
    for salt in [None, "a", "a", "b", None, "b"]:
        outs.append(e.generate([prompt], replace(GREEDY, cache_salt=salt))[0])
        e.check_integrity()
    assert [o.num_cached_tokens > 0 for o in outs] == [False, False, True, False, True, True]
    assert len({tuple(o.token_ids) for o in outs}) == 1
    assert e.kv.num_free_blocks == 64
