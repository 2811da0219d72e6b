"""Per-request block tables and prefix caching on top of the BlockPool (engine/block_pool.py
draws the layout and the hash chain). No torch."""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from engine.block_pool import BlockPool, hash_block_tokens, prefix_hashes
from engine.errors import NoFreeBlocksError, UnknownRequestError

__all__ = ["BlockPool", "KVCacheManager", "hash_block_tokens", "prefix_hashes"]


class KVCacheManager:
    """Owns per-request block tables (and their prefix hashes) on top of a BlockPool. The
    `token_ids` it hashes are cache keys (engine/cache_keys.py): token ids, flagged where a decode
    row computed the KV."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, block_size, enable_prefix_caching)
        self._tables: dict[str, list[int]] = {}
        self._hashes: dict[str, list[int]] = {}
        self.prefix_queries = 0
        self.prefix_hits = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks with ref count > 0."""
        return 1.0 - self.pool.num_free_blocks / self.num_blocks

    @property
    def holds_kv(self) -> bool:
        """Whether any block's contents matter: held by a request, or cached for a prefix."""
        return self.pool.num_free_blocks < self.num_blocks or self.pool.num_cached_blocks > 0

    @property
    def num_requests(self) -> int:
        return len(self._tables)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._tables

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table. Raises UnknownRequestError."""
        return list(self._table(request_id))

    def block_hashes(self, request_id: str) -> list[int]:
        """A copy of the hashes computed so far for the request's full blocks. Raises UnknownRequestError."""
        self._table(request_id)
        return list(self._hashes[request_id])

    def get_computed_blocks(self, request_id: str, token_ids: Sequence[int]) -> int:
        """Start the request's table with its longest cached prefix; return the cached token count.

        Only full blocks of `token_ids[:-1]` are looked up, so at least one token is left to
        compute. Hit blocks are touched (ref + 1). Returns 0 when prefix caching is off.
        Raises ValueError if the request already holds blocks.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if not self.enable_prefix_caching:
            return 0
        hits, hashes = self._cached_chain(token_ids, max(len(token_ids) - 1, 0) // self.block_size)
        self.pool.touch(hits)
        self._tables[request_id] = hits
        self._hashes[request_id] = hashes
        self.prefix_queries += len(token_ids)
        self.prefix_hits += len(hits) * self.block_size
        return len(hits) * self.block_size

    def _cached_chain(self, token_ids: Sequence[int], num_full: int) -> tuple[list[int], list[int]]:
        """The cached blocks (and their hashes) of the longest cached run of the first `num_full`
        full blocks of `token_ids`."""
        bs = self.block_size
        hits: list[int] = []
        hashes: list[int] = []
        parent: int | None = None
        for i in range(num_full):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            block_id = self.pool.lookup(parent)
            if block_id is None:
                break
            hits.append(block_id)
            hashes.append(parent)
        return hits, hashes

    # ---- write-back: full blocks copied from one engine's cache into another's --------------

    def hold_cached(self, holder_id: str, token_ids: Sequence[int]) -> list[int]:
        """Take a reference, as `holder_id`, on the cached run of `token_ids`' full blocks (all of
        them, the last included), so that none is evicted until `free(holder_id)`; their ids.
        Nothing when prefix caching is off. Raises ValueError if the id already holds blocks."""
        if holder_id in self._tables:
            raise ValueError(f"request {holder_id!r} already holds blocks")
        hits: list[int] = []
        hashes: list[int] = []
        if self.enable_prefix_caching:
            hits, hashes = self._cached_chain(token_ids, len(token_ids) // self.block_size)
        self.pool.touch(hits)
        self._tables[holder_id] = hits
        self._hashes[holder_id] = hashes
        return list(hits)

    def reserve_uncached(self, request_id: str, token_ids: Sequence[int]) -> tuple[int, list[int]]:
        """Hold the cached run of `token_ids`' full blocks and allocate a block for each full block
        after it: (tokens already cached, the new blocks), to be written from outside, then hashed
        by `cache_full_blocks` and freed into the cache. No new block when prefix caching is off
        (there is no cache to write into). Raises NoFreeBlocksError, holding nothing."""
        held = self.hold_cached(request_id, token_ids)
        missing = len(token_ids) // self.block_size - len(held) if self.enable_prefix_caching else 0
        try:
            new = self.pool.allocate(missing)
        except NoFreeBlocksError:
            self.free(request_id)
            raise
        self._tables[request_id].extend(new)
        return len(held) * self.block_size, new

    def allocate_slots(self, request_id: str, num_tokens: int) -> bool:
        """Grow the request's table (creating it if new) to cover `num_tokens` slots in total.

        Returns False, allocating nothing and creating no table, if too few blocks are free.
        """
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        table = self._tables.get(request_id, [])
        needed = -(-num_tokens // self.block_size) - len(table)
        if needed > self.pool.num_free_blocks:
            return False
        if needed > 0:
            table.extend(self.pool.allocate(needed))
        self._tables.setdefault(request_id, table)
        self._hashes.setdefault(request_id, [])
        return True

    def cache_full_blocks(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Hash and register each full block within the first `num_computed_tokens` not yet hashed.

        `token_ids` is the request's full token list. No-op when prefix caching is off.
        Raises UnknownRequestError, or ValueError if the tokens are not covered by the table.
        """
        if not self.enable_prefix_caching:
            return
        table = self._table(request_id)
        hashes = self._hashes[request_id]
        if num_computed_tokens > len(token_ids) or num_computed_tokens > len(table) * self.block_size:
            raise ValueError(
                f"request {request_id!r}: {num_computed_tokens} computed tokens exceed its "
                f"{len(token_ids)} tokens or {len(table)} blocks"
            )
        bs = self.block_size
        parent = hashes[-1] if hashes else None
        for i in range(len(hashes), num_computed_tokens // bs):
            parent = hash_block_tokens(parent, token_ids[i * bs : (i + 1) * bs])
            self.pool.cache_block(table[i], parent)
            hashes.append(parent)

    def reserve(self, request_id: str, num_tokens: int) -> list[int]:
        """Allocate a fresh table (no prefix lookup) covering `num_tokens`; return its block ids.

        For the decode side of disaggregated serving. Raises NoFreeBlocksError if the blocks
        are not free, or ValueError if the request already holds blocks.
        """
        if request_id in self._tables:
            raise ValueError(f"request {request_id!r} already holds blocks")
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        table = self.pool.allocate(-(-num_tokens // self.block_size))
        self._tables[request_id] = table
        self._hashes[request_id] = []
        return list(table)

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free the request's blocks past the first `num_tokens` slots, last first (a rejected
        speculative draft's). Its hashed blocks all lie within them. Raises UnknownRequestError."""
        table = self._table(request_id)
        keep = -(-num_tokens // self.block_size)
        assert len(self._hashes[request_id]) <= keep, f"request {request_id!r}: trimming a hashed block"
        if len(table) > keep:
            self.pool.free(reversed(table[keep:]))
            del table[keep:]

    def free(self, request_id: str) -> None:
        """Release the request's blocks in reverse table order, so tail blocks are evicted first.

        No-op for an unknown request id.
        """
        table = self._tables.pop(request_id, None)
        self._hashes.pop(request_id, None)
        if table is not None:
            self.pool.free(reversed(table))

    def check_integrity(self) -> None:
        """Raise AssertionError unless the pool is consistent and ref counts equal table references."""
        self.pool.check_integrity()
        assert self._tables.keys() == self._hashes.keys(), "block tables and hash lists track different requests"
        refs: Counter[int] = Counter()
        for request_id, table in self._tables.items():
            refs.update(table)
            assert len(self._hashes[request_id]) <= len(table), (
                f"request {request_id!r} hashes more blocks than it holds"
            )
        for block_id in range(self.num_blocks):
            ref = self.pool.ref_count(block_id)
            assert refs[block_id] == ref, f"block {block_id}: {refs[block_id]} table references but ref count {ref}"
        in_free = set(self.pool.free_queue()) & refs.keys()
        assert not in_free, f"block tables reference free blocks {sorted(in_free)}"

    def _table(self, request_id: str) -> list[int]:
        table = self._tables.get(request_id)
        if table is None:
            raise UnknownRequestError(f"unknown request {request_id!r}")
        return table
