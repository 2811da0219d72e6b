"""The prefix-block index in Redis: which worker holds which KV blocks, by chained block hash
(engine/block_pool.py), so the router can send a prompt where most of it is cached.

    tandem:{ns}:blocks:{id}     set    KV block hashes (decimal strings) held by worker `id`
    tandem:{ns}:block_workers   set    ids that have published blocks
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import cast

from cluster.state_store import StateStore, unavailable_as_state_error


class PrefixIndex(StateStore):
    """ClusterState's part that publishes and looks up cached blocks."""

    @unavailable_as_state_error
    def add_blocks(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Record that `worker_id` holds the KV blocks with these hashes."""
        if not hashes:
            return
        pipe = self._r.pipeline(transaction=True)
        pipe.sadd(self.key("blocks", worker_id), *(str(h) for h in hashes))
        pipe.sadd(self.key("block_workers"), worker_id)
        pipe.execute()

    @unavailable_as_state_error
    def remove_blocks(self, worker_id: str, hashes: Sequence[int]) -> None:
        """Forget these hashes for `worker_id` (evicted blocks). Unknown hashes are ignored."""
        if hashes:
            self._r.srem(self.key("blocks", worker_id), *(str(h) for h in hashes))

    @unavailable_as_state_error
    def drop_worker_blocks(self, worker_id: str) -> None:
        """Forget every block of `worker_id` (it restarted or cleared its cache)."""
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(self.key("blocks", worker_id))
        pipe.srem(self.key("block_workers"), worker_id)
        pipe.execute()

    @unavailable_as_state_error
    def longest_prefix(self, hashes: Sequence[int], workers: Sequence[str] | None = None) -> dict[str, int]:
        """For each worker, how many leading hashes of the chain `hashes` it holds (stops at the first miss).

        `workers=None` means every live worker that has published blocks; an explicit list
        is answered as given, zeros included, without a liveness check. Two round trips
        at most, whatever the chain length: SMISMEMBER for every worker in one pipeline.
        """
        members = [str(h) for h in hashes]
        live_check = workers is None
        if workers is None:
            workers = sorted(cast(set[str], self._r.smembers(self.key("block_workers"))))
        if not workers:
            return {}
        if not members and not live_check:
            return dict.fromkeys(workers, 0)
        pipe = self._r.pipeline(transaction=False)
        for worker_id in workers:
            if live_check:
                pipe.exists(self.key("worker", worker_id))
            if members:
                pipe.smismember(self.key("blocks", worker_id), members)
        replies = iter(pipe.execute())
        result: dict[str, int] = {}
        for worker_id in workers:
            alive = bool(next(replies)) if live_check else True
            hits = cast(list[int], next(replies)) if members else []
            if alive:
                result[worker_id] = next((i for i, hit in enumerate(hits) if not hit), len(hits))
        return result
