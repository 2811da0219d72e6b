"""Paged KV-cache bookkeeping: exact block ids, LRU eviction order and prefix-cache hits."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest

from engine.errors import NoFreeBlocksError, UnknownRequestError
from engine.kv_cache import KVCacheManager, hash_block_tokens


def chain(token_ids: list[int], block_size: int) -> list[int]:
    hashes: list[int] = []
    parent: int | None = None
    for i in range(len(token_ids) // block_size):
        parent = hash_block_tokens(parent, token_ids[i * block_size : (i + 1) * block_size])
        hashes.append(parent)
    return hashes


def prefill(kv: KVCacheManager, request_id: str, token_ids: list[int]) -> int:
    """Admit a request the way the scheduler does: lookup, allocate, compute, cache."""
    cached = kv.get_computed_blocks(request_id, token_ids)
    assert kv.allocate_slots(request_id, len(token_ids))
    kv.cache_full_blocks(request_id, token_ids, len(token_ids))
    kv.check_integrity()
    return cached


# --- KVCacheManager --------------------------------------------------------------------------


def test_allocate_slots_grows_table() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", 5)
    kv.check_integrity()
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 8)
    assert kv.block_table("a") == [0, 1]
    assert kv.allocate_slots("a", 9)
    kv.check_integrity()
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.num_free_blocks == 5
    assert kv.usage == pytest.approx(3 / 8)


def test_allocate_slots_fails_without_side_effects() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=4)
    assert kv.allocate_slots("a", 8)
    assert not kv.allocate_slots("b", 8)
    kv.check_integrity()
    assert not kv.has_request("b")
    assert not kv.allocate_slots("a", 16)
    kv.check_integrity()
    assert kv.block_table("a") == [0, 1]
    assert kv.num_free_blocks == 1


def test_prefix_hit_shares_physical_blocks() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4)
    prompt = list(range(10))
    assert prefill(kv, "a", prompt) == 0
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.block_hashes("a") == chain(prompt, 4)

    assert prefill(kv, "b", [*prompt[:8], 99, 98, 97]) == 8
    assert kv.block_table("b") == [0, 1, 3]
    assert [kv.pool.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    assert kv.prefix_queries == 21
    assert kv.prefix_hits == 8

    kv.free("a")
    kv.check_integrity()
    assert [kv.pool.ref_count(b) for b in range(4)] == [1, 1, 0, 1]
    assert kv.pool.free_queue() == [4, 5, 6, 7, 8, 9, 2]
    kv.free("b")
    kv.check_integrity()
    assert kv.num_free_blocks == 10
    assert kv.num_requests == 0


def test_block_aligned_prompt_leaves_one_token_to_compute() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    prompt = list(range(8))
    assert prefill(kv, "a", prompt) == 0
    assert kv.get_computed_blocks("b", prompt) == 4
    kv.check_integrity()
    assert kv.block_table("b") == [0]
    assert kv.allocate_slots("b", 8)
    kv.check_integrity()
    assert kv.block_table("b") == [0, 2]


def test_freed_cached_blocks_revive_then_evict_in_lru_order() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(8))
    h0, h1 = chain(prompt, 4)
    assert prefill(kv, "a", prompt) == 0
    assert kv.pool.pop_events() == ([h0, h1], [])
    kv.free("a")
    kv.check_integrity()
    assert kv.pool.free_queue() == [2, 3, 1, 0]

    assert prefill(kv, "b", [*prompt, 8]) == 8
    assert kv.block_table("b") == [0, 1, 2]
    assert kv.pool.pop_events() == ([], [])
    kv.free("b")
    kv.check_integrity()
    assert kv.pool.free_queue() == [3, 2, 1, 0]

    assert kv.allocate_slots("c", 8)
    kv.check_integrity()
    assert kv.block_table("c") == [2, 3]  # the LRU head's two, ascending
    assert kv.pool.pop_events() == ([], [])
    assert kv.allocate_slots("c", 12)
    kv.check_integrity()
    assert kv.block_table("c") == [2, 3, 1]
    assert kv.pool.pop_events() == ([], [h1])
    assert kv.pool.lookup(h1) is None
    assert kv.pool.lookup(h0) == 0
    assert kv.get_computed_blocks("d", [*prompt, 8]) == 4
    assert kv.block_table("d") == [0]
    kv.check_integrity()


def test_tail_blocks_evicted_before_head_blocks() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    prompt = [5, 6, 7, 8, 9, 10]
    h0, h1, h2 = chain(prompt, 2)
    assert prefill(kv, "a", prompt) == 0
    kv.free("a")
    kv.check_integrity()
    assert kv.pool.free_queue() == [2, 1, 0]
    kv.pool.pop_events()
    assert kv.allocate_slots("b", 2)
    assert kv.pool.pop_events() == ([], [h2])
    assert kv.allocate_slots("b", 4)
    assert kv.pool.pop_events() == ([], [h1])
    kv.check_integrity()
    assert kv.block_table("b") == [2, 1]
    assert kv.pool.lookup(h0) == 0


def test_duplicate_content_keeps_first_block_cached() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4)
    prompt = [1, 2, 3, 4, 5]
    assert kv.allocate_slots("a", 5)
    assert kv.allocate_slots("b", 5)
    kv.cache_full_blocks("a", prompt, 5)
    kv.cache_full_blocks("b", prompt, 5)
    kv.check_integrity()
    assert kv.block_table("b") == [2, 3]
    assert kv.block_hashes("b") == chain(prompt, 4)
    assert kv.pool.lookup(chain(prompt, 4)[0]) == 0
    assert kv.pool.num_cached_blocks == 1


def test_cache_full_blocks_is_incremental() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=2)
    tokens = [1, 2, 3]
    assert kv.get_computed_blocks("a", tokens) == 0
    assert kv.allocate_slots("a", 3)
    kv.cache_full_blocks("a", tokens, 3)
    assert kv.block_hashes("a") == chain(tokens, 2)
    tokens += [4, 5]
    assert kv.allocate_slots("a", 5)
    kv.cache_full_blocks("a", tokens, 5)
    kv.check_integrity()
    assert kv.block_hashes("a") == chain(tokens, 2)
    assert kv.pool.pop_events() == (chain(tokens, 2), [])
    with pytest.raises(ValueError, match="exceed"):
        kv.cache_full_blocks("a", tokens, 7)
    with pytest.raises(UnknownRequestError):
        kv.cache_full_blocks("nope", tokens, 2)


def test_prefix_caching_off_never_hits() -> None:
    kv = KVCacheManager(num_blocks=6, block_size=4, enable_prefix_caching=False)
    prompt = list(range(9))
    assert prefill(kv, "a", prompt) == 0
    assert prefill(kv, "b", prompt) == 0
    assert kv.block_table("a") == [0, 1, 2]
    assert kv.block_table("b") == [3, 4, 5]
    assert kv.block_hashes("a") == []
    assert kv.pool.num_cached_blocks == 0
    assert kv.pool.pop_events() == ([], [])
    assert kv.prefix_hits == 0


def test_reserve_allocates_fresh_table() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    prompt = list(range(9))
    assert prefill(kv, "a", prompt[:4]) == 0
    assert kv.reserve("d", 9) == [1, 2, 3]
    kv.check_integrity()
    assert kv.block_table("d") == [1, 2, 3]
    with pytest.raises(ValueError, match="already holds blocks"):
        kv.reserve("d", 1)
    with pytest.raises(NoFreeBlocksError):
        kv.reserve("e", 1)
    kv.check_integrity()
    assert not kv.has_request("e")
    kv.free("d")
    kv.check_integrity()
    assert kv.pool.free_queue() == [3, 2, 1]


def test_free_unknown_request_is_noop() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    kv.free("ghost")
    assert kv.allocate_slots("a", 4)
    kv.free("a")
    kv.free("a")
    kv.check_integrity()
    assert kv.num_free_blocks == 2
    with pytest.raises(UnknownRequestError):
        kv.block_table("a")


def test_manager_check_integrity_catches_leak() -> None:
    kv = KVCacheManager(num_blocks=2, block_size=4)
    assert kv.allocate_slots("a", 4)
    kv.pool.touch([0])
    with pytest.raises(AssertionError, match="block 0: 1 table references but ref count 2"):
        kv.check_integrity()


def test_randomized_stress() -> None:
    rng = random.Random(0)
    block_size = 4
    kv = KVCacheManager(num_blocks=32, block_size=block_size)
    prefixes = [[rng.randrange(50) for _ in range(rng.randrange(4, 20))] for _ in range(4)]
    live: dict[str, list[int]] = {}
    for step in range(2000):
        op = rng.random()
        if op < 0.35 and len(live) < 12:
            rid = f"r{step}"
            tokens = [*rng.choice(prefixes), *(rng.randrange(50) for _ in range(rng.randrange(1, 10)))]
            cached = kv.get_computed_blocks(rid, tokens)
            assert cached % block_size == 0 and cached < len(tokens)
            assert kv.block_table(rid) == [kv.pool.lookup(h) for h in chain(tokens, block_size)[: cached // block_size]]
            if kv.allocate_slots(rid, len(tokens)):
                kv.cache_full_blocks(rid, tokens, len(tokens))
                live[rid] = tokens
            else:
                kv.free(rid)
        elif op < 0.75 and live:
            rid = rng.choice(sorted(live))
            tokens = live[rid]
            tokens.append(rng.randrange(50))
            if kv.allocate_slots(rid, len(tokens)):
                kv.cache_full_blocks(rid, tokens, len(tokens))
            else:
                kv.free(rid)
                del live[rid]
        elif live:
            rid = rng.choice(sorted(live))
            kv.free(rid)
            del live[rid]
        kv.check_integrity()
        kv.pool.pop_events()
    for rid in list(live):
        kv.free(rid)
        kv.check_integrity()
    assert kv.num_free_blocks == 32
    assert kv.num_requests == 0
    assert kv.usage == 0.0
    assert kv.prefix_hits > 0


def test_kv_cache_does_not_import_torch() -> None:
    code = "import engine.kv_cache, sys; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


@pytest.mark.parametrize("caching", [True, False])
def test_a_cache_holds_kv_while_a_request_or_a_cached_prefix_does(caching: bool) -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=caching)
    assert not kv.holds_kv, "a new cache: no block's contents matter"
    prefill(kv, "a", list(range(9)))
    assert kv.holds_kv
    kv.free("a")
    kv.check_integrity()
    assert kv.holds_kv == caching, "freed, its full blocks stay cached (when caching)"
