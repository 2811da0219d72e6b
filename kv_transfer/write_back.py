"""Write-back: a finished turn's KV, copied from the decode worker that wrote it into the prefix
cache of the prefill worker that served the turn's prompt.

A conversation's next turn is its history, the answer and a new message. The decode worker holds
the KV of all of it; the prefill worker only the history. After a turn ends, the decode worker
sends what the prefill worker lacks (the answer's full blocks, and the prompt's last, partial
block made full by it), so the next turn's prefill computes only the new message:

    decode worker (source)                          prefill worker (target)
    hold the cached run of prompt + answer
                      ── reserve_uncached(tokens) ──▶  hold its own cached run (k blocks),
                                                       reserve a block for each one after it
    gather blocks k.. (serial), push, commit ───────▶  checked like any transfer
    release the hold  ── adopt(tokens) ─────────────▶  blocks hashed into its prefix cache and
                                                       freed: cached, evicted in LRU order

Nothing is hashed before the transfer is committed (every layer of every block verified), so
the prefix cache never holds unverified KV. A failure anywhere frees both sides: the source's
hold in `finally`, the target's reservation by the push's abort, or by its lease.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

from engine.engine import Engine
from kv_transfer.errors import KVTransferError
from kv_transfer.receiver import KVReceiver
from kv_transfer.sender import KVClients
from protos.gen import kv_transfer_pb2 as pb


@dataclass(frozen=True)
class WriteBackTicket:
    """The target's answer to a reserve: `reservation` (a serialized ReserveResponse) holds a
    block for each full block after the first `cached_tokens` tokens, which it has already."""

    reservation: bytes
    cached_tokens: int


@dataclass(frozen=True)
class WriteBackResult:
    """What one write-back moved: blocks, payload bytes, and its time from hold to adopt."""

    blocks: int
    bytes: int
    seconds: float


# the calls to the target a source makes: its reserve_uncached and adopt, given the cache keys
Reserve = Callable[[list[int]], WriteBackTicket | None]
Adopt = Callable[[list[int]], None]


# ---- the target (a prefill worker) -----------------------------------------------------------


def reserve_uncached(
    receiver: KVReceiver, request_id: str, keys: Sequence[int], lease_s: float | None = None
) -> WriteBackTicket | None:
    """Reserve what the target's cache lacks of `keys`' full blocks; None when it lacks
    nothing. Raises NoFreeBlocksError, KVTransferError."""
    receiver.check_unreserved(request_id)
    with receiver.engine_lock:
        cached, blocks = receiver.engine.reserve_uncached(request_id, keys)
        if not blocks:
            receiver.engine.release(request_id)
            return None
    res = receiver.lease(request_id, blocks, len(blocks) * receiver.layout.block_size, lease_s)
    return WriteBackTicket(res.SerializeToString(), cached)


def adopt(receiver: KVReceiver, request_id: str, keys: Sequence[int]) -> None:
    """A committed write-back into the target's prefix cache. `keys`: as reserved."""
    receiver.hand_over(request_id, lambda _: receiver.engine.adopt(request_id, keys))


# ---- the source (a decode worker) ------------------------------------------------------------


class WriteBackSource:
    """Sends a finished turn's KV from `engine` (its lock: `lock`) to targets over `clients`."""

    def __init__(self, engine: Engine, lock: AbstractContextManager[Any], clients: KVClients) -> None:
        self.engine = engine
        self.lock = lock
        self.clients = clients

    def push(self, request_id: str, keys: Sequence[int], reserve: Reserve, adopt: Adopt) -> WriteBackResult | None:
        """Copy the KV of `keys` (a turn's prompt and answer as the prefix cache hashes them,
        engine/cache_keys.py) that this engine holds and the target lacks. `reserve` and
        `adopt` call the target (its `reserve_uncached` and `adopt` under `request_id`). None when
        there was nothing to send. Raises KVTransferError, or what `reserve` and `adopt` raise."""
        t0 = time.monotonic()
        bs = self.engine.config.block_size
        hold = f"{request_id}.hold"
        with self.lock:
            held = self.engine.hold_cached(hold, keys)
        try:
            sent = list(keys[: len(held) * bs])
            ticket = reserve(sent) if held else None
            if ticket is None:
                return None
            res = pb.ReserveResponse.FromString(ticket.reservation)
            first = ticket.cached_tokens // bs
            src = held[first : first + len(res.block_ids)]
            if len(src) != len(res.block_ids):
                raise KVTransferError(f"the target reserved {len(res.block_ids)} blocks, {len(src)} are left to send")
            # held blocks are full and cached: nothing writes them, so they are read without the lock
            data = self.engine.cache.read_blocks_serial(src)
            push = self.clients.get(res.endpoint).push(request_id, res)
            try:
                push.send(0, self.engine.cache.num_layers, list(range(len(src))), data)
                stats = push.commit(len(src) * bs)
            except BaseException as e:
                push.abort(f"write-back failed: {type(e).__name__}")
                raise
            adopt(sent)
            return WriteBackResult(len(src), stats.bytes, time.monotonic() - t0)
        finally:
            with self.lock:
                self.engine.release(hold)
