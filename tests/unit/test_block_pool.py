"""The KV cache's block pool (engine/kv_cache.py's BlockPool): block ids handed out in order,
freed blocks queued in LRU order and revived by a touch, double frees refused, the prefix
cache's hashes and their events, and check_integrity() catching corruption."""

from __future__ import annotations

import pytest

from engine.errors import NoFreeBlocksError
from engine.kv_cache import BlockPool


def test_pool_allocates_in_id_order() -> None:
    pool = BlockPool(num_blocks=6, block_size=4)
    assert pool.allocate(2) == [0, 1]
    pool.check_integrity()
    assert pool.allocate(3) == [2, 3, 4]
    pool.check_integrity()
    assert pool.num_free_blocks == 1
    assert pool.free_queue() == [5]


def test_pool_exhausted_raises_and_allocates_nothing() -> None:
    pool = BlockPool(num_blocks=4, block_size=4)
    assert pool.allocate(3) == [0, 1, 2]
    with pytest.raises(NoFreeBlocksError, match="need 2 blocks but only 1"):
        pool.allocate(2)
    pool.check_integrity()
    assert pool.num_free_blocks == 1
    assert pool.allocate(1) == [3]


def test_pool_free_appends_to_tail_in_order() -> None:
    pool = BlockPool(num_blocks=5, block_size=4)
    assert pool.allocate(4) == [0, 1, 2, 3]
    pool.free([2, 0])
    pool.check_integrity()
    assert pool.free_queue() == [4, 2, 0]
    pool.free([3])
    pool.check_integrity()
    assert pool.free_queue() == [4, 2, 0, 3]
    assert pool.allocate(3) == [0, 2, 4]  # the LRU head's three, in ascending order
    pool.check_integrity()


def test_pool_gives_a_freed_request_its_blocks_back_in_runs() -> None:
    pool = BlockPool(num_blocks=8, block_size=4)
    kv = pool.allocate(6)
    pool.free(reversed(kv))  # as KVCache.free does: tail blocks first
    assert pool.free_queue() == [6, 7, 5, 4, 3, 2, 1, 0]
    assert pool.allocate(2) == [6, 7]
    assert pool.allocate(6) == [0, 1, 2, 3, 4, 5]  # consecutive, not [5, 4, 3, 2, 1, 0]
    pool.check_integrity()


def test_pool_double_free_raises_and_changes_nothing() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    assert pool.allocate(2) == [0, 1]
    pool.free([0])
    with pytest.raises(ValueError, match="double free of block 0"):
        pool.free([0])
    with pytest.raises(ValueError, match="double free of block 1"):
        pool.free([1, 1])
    pool.check_integrity()
    assert pool.ref_count(1) == 1
    assert pool.free_queue() == [2, 0]


def test_pool_touch_revives_free_block() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    assert pool.allocate(2) == [0, 1]
    pool.free([0])
    pool.touch([0, 1])
    pool.check_integrity()
    assert pool.ref_count(0) == 1
    assert pool.ref_count(1) == 2
    assert pool.free_queue() == [2]


def test_pool_duplicate_hash_keeps_first_mapping() -> None:
    pool = BlockPool(num_blocks=3, block_size=4)
    assert pool.allocate(2) == [0, 1]
    pool.cache_block(0, 111)
    pool.cache_block(1, 111)
    pool.check_integrity()
    assert pool.lookup(111) == 0
    assert pool.num_cached_blocks == 1
    assert pool.pop_events() == ([111], [])
    with pytest.raises(ValueError, match="already cached"):
        pool.cache_block(0, 222)


def test_pool_events_record_stores_and_evictions() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    assert pool.allocate(2) == [0, 1]
    pool.cache_block(0, 10)
    pool.cache_block(1, 11)
    assert pool.pop_events() == ([10, 11], [])
    assert pool.pop_events() == ([], [])
    pool.free([1, 0])
    assert pool.allocate(1) == [1]
    pool.check_integrity()
    assert pool.pop_events() == ([], [11])
    assert pool.lookup(11) is None
    assert pool.lookup(10) == 0


def test_pool_check_integrity_catches_corruption() -> None:
    pool = BlockPool(num_blocks=2, block_size=4)
    assert pool.allocate(1) == [0]
    pool._refs[0] = 0
    with pytest.raises(AssertionError, match="block 0"):
        pool.check_integrity()
