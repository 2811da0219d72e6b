"""Paged KV-cache bookkeeping: physical blocks, per-request block tables, prefix caching.

The KV cache is cut into `num_blocks` fixed-size blocks of `block_size` token slots.
A request's block table maps logical block i -> physical block id, so token t lives
in block `block_table[t // block_size]` at offset `t % block_size`:

    block_size = 4, block_table = [7, 2, 5]

    token t:     0  1  2  3 | 4  5  6  7 | 8  9
    logical:     [    0    ] [    1    ] [  2 ..
    physical:    [ block 7 ] [ block 2 ] [ block 5: slots 8, 9 used, 2 free ]

Every full block gets a hash chained over the whole prefix, so equal hashes mean
equal prefixes (not just equal blocks):

    h_0 = xxh64(                 int32le(tokens[0:B]))
    h_i = xxh64(uint64le(h_{i-1}) + int32le(tokens[i*B:(i+1)*B]))

    [ block 0 ] -> [ block 1 ] -> [ block 2 ]      B = block_size
        h_0  ------>  h_1  ------>  h_2

Blocks with ref count 0 sit in an LRU free queue; they keep their hash until
allocation pops them from the head, so a later request can revive them:

    free queue:  head (evicted first) [ 4, 9, 1, 0 ] tail (freed last)

Nothing here touches torch: it is ints, lists and dicts, testable on any CPU.
"""

from __future__ import annotations

import struct
from collections import Counter, OrderedDict
from collections.abc import Iterable, Sequence

import xxhash

from engine.errors import NoFreeBlocksError


def hash_block_tokens(parent_hash: int | None, token_ids: Sequence[int]) -> int:
    """Chained hash of one full block: xxh64 of the parent hash bytes plus the tokens as int32le."""
    prefix = b"" if parent_hash is None else struct.pack("<Q", parent_hash)
    data = prefix + struct.pack(f"<{len(token_ids)}i", *token_ids)
    return int(xxhash.xxh64_intdigest(data))


def prefix_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """The chained hashes of every full block of `token_ids` (what the prefix index stores)."""
    hashes: list[int] = []
    parent: int | None = None
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[i : i + block_size])
        hashes.append(parent)
    return hashes


class BlockPool:
    """Owns the physical blocks: ref counts, the LRU free queue and the hash <-> block maps."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks ({num_blocks}) and block_size ({block_size}) must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refs = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._hash_to_block: dict[int, int] = {}
        self._block_to_hash: dict[int, int] = {}
        self._stored: list[int] = []
        self._evicted: list[int] = []

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._hash_to_block)

    def ref_count(self, block_id: int) -> int:
        return self._refs[block_id]

    def free_queue(self) -> list[int]:
        """The free block ids in eviction order (head first)."""
        return list(self._free)

    def allocate(self, n: int) -> list[int]:
        """Pop `n` blocks from the free-queue head, each with ref count 1, in ascending id order.

        The queue picks which blocks (LRU); the order is ascending so that a request's blocks
        form runs of consecutive ids wherever the set allows, as it does on a quiet pool: KV is
        then copied (in place, kv_transfer/in_place_writer.py) as a few strided runs, not block
        by block. The free queue refills in reverse table order, so without sorting a freed
        request's blocks come back descending. Evicts any cached hash the popped blocks carry
        (recording an "evicted" event).
        Raises NoFreeBlocksError, allocating nothing, if fewer than `n` blocks are free.
        """
        if n < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({n})")
        if n > len(self._free):
            raise NoFreeBlocksError(f"need {n} blocks but only {len(self._free)} of {self.num_blocks} are free")
        block_ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block_hash = self._block_to_hash.pop(block_id, None)
            if block_hash is not None:
                del self._hash_to_block[block_hash]
                self._evicted.append(block_hash)
            self._refs[block_id] = 1
            block_ids.append(block_id)
        block_ids.sort()
        return block_ids

    def free(self, block_ids: Iterable[int]) -> None:
        """Decrement ref counts in order; blocks reaching 0 join the free-queue tail, keeping their hash.

        Raises ValueError, changing nothing, if a block would drop below 0 (a double free).
        """
        block_ids = list(block_ids)
        for block_id, count in Counter(block_ids).items():
            if count > self._refs[block_id]:
                raise ValueError(f"double free of block {block_id} (ref count {self._refs[block_id]})")
        for block_id in block_ids:
            self._refs[block_id] -= 1
            if self._refs[block_id] == 0:
                self._free[block_id] = None

    def touch(self, block_ids: Iterable[int]) -> None:
        """Increment ref counts (a prefix hit), taking blocks at ref 0 out of the free queue."""
        for block_id in block_ids:
            if self._refs[block_id] == 0:
                del self._free[block_id]
            self._refs[block_id] += 1

    def cache_block(self, block_id: int, block_hash: int) -> None:
        """Map `block_hash` to `block_id`, recording a "stored" event.

        No-op when prefix caching is off, when the block already holds this hash, or when the
        hash already maps to another block (the first mapping wins; this block stays uncached).
        Raises ValueError if the block already holds a different hash.
        """
        if not self.enable_prefix_caching:
            return
        current = self._block_to_hash.get(block_id)
        if current is not None:
            if current != block_hash:
                raise ValueError(f"block {block_id} already cached under hash {current:#x}, not {block_hash:#x}")
            return
        if block_hash in self._hash_to_block:
            return
        self._hash_to_block[block_hash] = block_id
        self._block_to_hash[block_id] = block_hash
        self._stored.append(block_hash)

    def lookup(self, block_hash: int) -> int | None:
        """The block cached under `block_hash`, or None."""
        return self._hash_to_block.get(block_hash)

    def pop_events(self) -> tuple[list[int], list[int]]:
        """Return and clear the (stored, evicted) hashes recorded since the last call."""
        stored, evicted = self._stored, self._evicted
        self._stored, self._evicted = [], []
        return stored, evicted

    def check_integrity(self) -> None:
        """Raise AssertionError unless ref counts, the free queue and the hash maps agree."""
        for block_id, ref in enumerate(self._refs):
            assert ref >= 0, f"block {block_id} has negative ref count {ref}"
            in_free = block_id in self._free
            assert in_free == (ref == 0), f"block {block_id}: ref count {ref} but in free queue = {in_free}"
        assert len(self._free) == len(set(self._free)), "duplicate ids in the free queue"
        assert all(0 <= b < self.num_blocks for b in self._free), "free queue holds an out-of-range block id"
        assert len(self._hash_to_block) == len(self._block_to_hash), "hash maps differ in size"
        for block_hash, block_id in self._hash_to_block.items():
            assert self._block_to_hash.get(block_id) == block_hash, f"hash {block_hash:#x} -> {block_id} not inverse"
