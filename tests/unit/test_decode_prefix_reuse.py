"""A decode engine's cache serves a conversation's next turn (the local route, cluster.routing).

turn 1  P/D: prompt P prefilled elsewhere, its KV admitted; the answer A decoded here
        -> KV of P + A[:-1] (the last token sampled is never run), full blocks hashed with
           the prefill side's chain, cached after the request ends
turn 2  P + A + M run whole here, A marked as decoded (SamplingParams.decoded, as the router
        marks a chat's answers): only the uncached tail is prefilled
turn 3  the same again, on turn 2's answer (written by a local run this time)

Unmarked, a next turn finds only P cached: A's blocks hash as decode rows' (engine/cache_keys.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from engine.cache_keys import cache_keys
from engine.engine import Engine
from engine.kv_cache import prefix_hashes
from engine.model import LlamaModel
from engine.sampling_params import SamplingParams
from tests.unit.kv_harness import Pair, make_pair
from tests.unit.tiny import make_engine

GREEDY = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
BS = 4  # tests.unit.tiny.make_engine


@pytest.fixture
def pair(tiny_model: LlamaModel) -> Iterator[Pair]:
    p = make_pair(tiny_model, max_num_batched_tokens=8)
    yield p
    p.close()


def run_whole(e: Engine, rid: str, prompt: list[int], params: SamplingParams = GREEDY) -> tuple[list[int], int]:
    """Tokens and cached prompt tokens of `prompt` run whole on `e`; integrity checked each step."""
    e.add_request(rid, prompt, params)
    tokens: list[int] = []
    cached = -1
    while e.has_unfinished():
        for o in e.step():
            if o.request_id == rid:
                tokens += o.new_token_ids
                cached = o.num_cached_tokens if cached < 0 else cached
        e.check_integrity()
    return tokens, cached


def cold(model: LlamaModel, prompt: list[int], params: SamplingParams = GREEDY) -> list[int]:
    return make_engine(model, num_blocks=64).generate([prompt], params)[0].token_ids


def marked(*spans: tuple[int, int]) -> SamplingParams:
    return dataclasses.replace(GREEDY, decoded=spans)


def test_next_turns_reuse_the_decode_engines_kv(pair: Pair, tiny_model: LlamaModel) -> None:
    prompt = [(11 * i + 3) % 128 for i in range(17)]
    first, _, _ = pair.transfer(pair.client(), "t1", prompt, GREEDY)
    pair.receiver.wait("t1", 2.0)
    pair.receiver.admit("t1", prompt, first.new_token_ids[0], GREEDY)
    decode = pair.decode
    answer: list[int] = []
    while decode.has_unfinished():
        answer += [t for o in decode.step() for t in o.new_token_ids]
    assert answer == cold(tiny_model, prompt)
    pair.receiver.check_integrity()
    assert decode.kv.num_free_blocks == 256, "a finished request holds no block"
    # 17 + 10 tokens, the last never run: 26 have KV, 6 full blocks, all still cached
    stored, _ = decode.kv.pool.pop_events()
    turn2 = prompt + answer + [5, 6, 7]
    a1 = (17, 27)
    assert prefix_hashes(cache_keys(turn2, len(turn2), marked(a1)), BS)[:6] == stored[:6]

    _, cached = run_whole(decode, "t2-unmarked", turn2)
    assert cached == 4 * BS, "unmarked, the answer's blocks are not this prompt's: only P's hit"
    answer2, cached = run_whole(decode, "t2", turn2, marked(a1))
    assert cached == 6 * BS
    assert answer2 == cold(tiny_model, turn2, marked(a1))

    turn3 = turn2 + answer2 + [9, 8]
    a2 = (len(turn2), len(turn2) + len(answer2))
    answer3, cached = run_whole(decode, "t3", turn3, marked(a1, a2))
    assert cached == (len(turn2) + len(answer2) - 1) // BS * BS == 36
    assert answer3 == cold(tiny_model, turn3, marked(a1, a2))
    decode.check_integrity()
    assert decode.kv.num_free_blocks == 256 and decode.kv.num_requests == 0
    assert decode.kv.pool.num_cached_blocks >= len(turn3) // BS


def test_cached_answer_blocks_are_evicted_lru_under_pressure(tiny_model: LlamaModel) -> None:
    """A finished answer's blocks are free (evictable), not pinned: a new request may take them."""
    e = make_engine(tiny_model, num_blocks=12, role="decode")
    prompt = list(range(20, 37))
    answer, _ = run_whole(e, "a", prompt)
    assert e.kv.num_free_blocks == 12 and e.kv.pool.num_cached_blocks == 6
    # "a" held blocks 0-6 and freed them tail first: the free queue is 7..11, then 6, 5, ..., 0
    run_whole(e, "b", list(range(60, 92)))  # 32 + 10 tokens: 11 blocks, 7..11 and 6..1
    e.check_integrity()
    _, cached = run_whole(e, "c", prompt + answer + [1], marked((len(prompt), len(prompt) + len(answer))))
    assert cached == BS, "only block 0, the head of the old prefix, was left to hit"
    e.check_integrity()
    assert e.kv.num_free_blocks == 12
