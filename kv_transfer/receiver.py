"""The decode side of a transfer: leases, validation, writes into the paged cache, admission.

A chunk is checked completely before a byte is written: reservation, token, deadline,
layer range, destination blocks, dtype, shape, size and checksum. A bad chunk from the
token holder fails the transfer (its blocks are freed at once); a chunk with a wrong or stale
token is refused and the reservation is left alone. Each accepted chunk renews the lease, and
so does the router (`renew`) while it watches a live prefill for it.

With `in_place`, the engine's cache moves to /dev/shm and a same-host sender that Claims a reservation
writes its blocks itself; its chunks are headers, and its blocks are fenced until it stops (in_place.py).

A chunk carries at most `max_chunk_bytes` of payload: by default one layer of the largest
reservation this engine can grant (`max_blocks` blocks), so the server can refuse a larger
message before buffering it and a sender never needs more than one message per layer.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from typing import Any

from engine.engine import Engine
from engine.sampling_params import SamplingParams
from kv_transfer.chunk_checks import check_place, check_written, read_payload
from kv_transfer.errors import ChunkRejected, KVTransferError
from kv_transfer.in_place import Fence, SharedCache, is_holder
from kv_transfer.outcomes import Outcomes
from kv_transfer.payload import InbandReader, PayloadReader, ShmReader
from kv_transfer.reservations import Reservation, ReservationTable, State
from kv_transfer.security import same_secret
from kv_transfer.stats import TransferStats
from kv_transfer.wire import layout_of
from protos.gen import kv_transfer_pb2 as pb


class KVReceiver:
    """Owns the reservations of one decode engine. Thread-safe; `engine_lock` guards the engine.

    Lock order: `engine_lock` before the receiver's own lock, never the other way (the engine
    loop holds `engine_lock` when it admits). Blocks of a dropped reservation are therefore
    handed back to the engine after the receiver's lock is released (`_free_dropped`)."""

    def __init__(
        self,
        engine: Engine,
        engine_lock: AbstractContextManager[Any],
        endpoint: str = "",
        lease_s: float = 10.0,
        max_chunk_bytes: int | None = None,
        in_place: bool = False,
    ) -> None:
        self.engine = engine
        self.engine_lock = engine_lock
        self.endpoint = endpoint
        self.lease_s = lease_s
        self.layout = layout_of(engine.cache)
        cache = engine.cache
        self.max_blocks = min(-(-engine.max_model_len // cache.block_size), cache.num_blocks)
        layer_block_bytes = cache.bytes_per_block // cache.num_layers  # one layer of one block, K and V
        self.max_chunk_bytes = max_chunk_bytes or self.max_blocks * layer_block_bytes
        if self.max_chunk_bytes < layer_block_bytes:
            raise ValueError(f"max_chunk_bytes {self.max_chunk_bytes} is under one layer of one block")
        self.table = ReservationTable()
        self.readers: dict[str, PayloadReader] = {"grpc": InbandReader(), "shm": ShmReader()}
        self._cond = threading.Condition()
        self.outcomes = Outcomes(self._cond)
        self._dropped: list[str] = []
        self.fence = Fence()
        with engine_lock:  # a flipped worker's engine loop runs already: it must not step meanwhile
            self.shared = SharedCache.share(engine.cache, engine.kv.holds_kv) if in_place else None

    # ---- control ----------------------------------------------------------------------------

    def reserve(
        self, request_id: str, num_tokens: int, lease_s: float | None = None, owner: str = ""
    ) -> pb.ReserveResponse:
        """Claim blocks for `num_tokens` tokens, for `owner` (a router: `owned_by`). Raises
        NoFreeBlocksError, PromptTooLongError, ..."""
        self.check_unreserved(request_id)
        with self.engine_lock:
            blocks = self.engine.reserve(request_id, num_tokens)  # raises on a duplicate id
        return self.lease(request_id, blocks, num_tokens, lease_s, owner)

    def check_unreserved(self, request_id: str) -> None:
        with self._cond:
            if request_id in self.table:
                raise KVTransferError(f"request {request_id!r} already has a reservation")

    def lease(
        self, request_id: str, blocks: list[int], num_tokens: int, lease_s: float | None, owner: str = ""
    ) -> pb.ReserveResponse:
        """Lease `blocks`, which the engine holds for `request_id`, to the one sender holding the
        response's token, for `lease_s` (default: the receiver's) until the first chunk."""
        lease = lease_s if lease_s else self.lease_s
        with self._cond:
            r = self.table.add(request_id, blocks, num_tokens, lease, owner)
            self.outcomes.forget(request_id)
        return pb.ReserveResponse(
            block_ids=r.block_ids,
            transfer_token=r.token,
            endpoint=self.endpoint,
            layout=self.layout,
            lease_ms=int(lease * 1000),
            max_chunk_bytes=self.max_chunk_bytes,
            cache_shm_name=self.shared.name if self.shared else "",
            cache_num_blocks=self.engine.cache.num_blocks,
            node=socket.gethostname(),
        )

    def release(self, request_id: str, token: str | None, reason: str, writer_stopped: bool = False) -> bool:
        """Drop a reservation and free its blocks. With a token, it must match (None: the
        in-process owner releases without one; over gRPC a token is always required).
        `writer_stopped`: the sender's own Release, so it writes in place no more: its blocks
        are freed even if fenced; otherwise a claimed reservation's blocks stay fenced."""
        try:
            with self._cond:
                r = self.table.get(request_id)
                if r is None:
                    if writer_stopped and token is not None and self.fence.lift(request_id, token):
                        self._dropped.append(request_id)
                        return True
                    return False
                if token is not None and not same_secret(token, r.token):
                    return False
                if writer_stopped:
                    r.holder = ""
                self._drop(r, reason)
                return True
        finally:
            self._free_dropped()

    def renew(self, request_id: str, lease_s: float) -> bool:
        """Push a held reservation's lease to at least `lease_s` from now: its caller still watches
        a live sender (cluster.handoff). False if it is gone."""
        with self._cond:
            r = self.table.get(request_id)
            if r is not None:
                self.table.renew(r, lease_s)
            return r is not None

    def claim(self, request_id: str, token: str, holder: str) -> None:
        """Let the token's holder write the reservation's blocks in place from now on (`holder`:
        the lock its process holds while it lives). Raises ChunkRejected."""
        with self._cond:
            r = self._authorised(pb.KVChunkHeader(request_id=request_id, transfer_token=token))
            if self.shared is None or not is_holder(holder) or r.holder not in ("", holder):
                why = "not shared" if self.shared is None else f"claimed by {r.holder or holder!r}"
                raise ChunkRejected("bad_transport", f"no in-place writes into {request_id!r}: cache {why}")
            r.holder = holder

    def owned_by(self, owner: str) -> list[str]:
        """The reservations made for `owner` (a router: one that is gone has them released)."""
        with self._cond:
            return [r.request_id for r in self.table.owned_by(owner)]

    def expire(self) -> list[str]:
        """Free every reservation whose lease has run out; returns their ids."""
        try:
            with self._cond:
                gone = self.table.expired()
                for r in gone:
                    self._drop(r, "lease expired")
                self._dropped.extend(self.fence.lift_dead())
                return [r.request_id for r in gone]
        finally:
            self._free_dropped()

    def _drop(self, r: Reservation, reason: str) -> None:
        """Caller holds the receiver lock; the blocks go back in `_free_dropped`, or to the fence
        while a sender may still write them in place."""
        self.table.pop(r.request_id)
        if r.holder:
            self.fence.hold(r.request_id, r.token, r.holder)
        else:
            self._dropped.append(r.request_id)
        self.outcomes.fail(r.request_id, reason)

    def _free_dropped(self) -> None:
        with self._cond:
            ids, self._dropped = self._dropped, []
        if ids:
            with self.engine_lock:
                for rid in ids:
                    self.engine.release(rid)

    # ---- data -------------------------------------------------------------------------------

    def accept(self, header: pb.KVChunkHeader, inband: memoryview) -> int:
        """Validate one chunk and write it into the cache; returns the payload size.

        Raises ChunkRejected (nothing written)."""
        try:
            return self._accept(header, inband)
        finally:
            self._free_dropped()

    def _accept(self, header: pb.KVChunkHeader, inband: memoryview) -> int:
        with self._cond:
            r = self._authorised(header)
            layers = slice(header.layer_start, header.layer_end)
            try:
                blocks, shape = check_place(self.layout, self.max_chunk_bytes, r.block_ids, header)
                data = None if header.transport == "in_place" else read_payload(self.readers, header, inband, shape)
                if data is None:  # the sender wrote the blocks itself
                    if not r.holder:
                        raise ChunkRejected("bad_transport", "an in-place chunk without a claim")
                    check_written(header, self.engine.cache, blocks)
            except ChunkRejected as e:
                self._drop(r, f"rejected chunk: {e}")
                raise
            if data is not None:
                self.engine.cache.write_blocks(blocks, data, layers)
            if r.state is State.RESERVED:
                r.state, r.started = State.RECEIVING, time.monotonic()
            self.table.renew(r, self.lease_s)
            for layer in range(header.layer_start, header.layer_end):
                r.received.setdefault(layer, set()).update(blocks)
            r.bytes += header.payload_bytes
            r.chunks += 1
            return int(header.payload_bytes)

    def commit(self, header: pb.KVChunkHeader, network_wait_s: float = 0.0) -> TransferStats:
        """Verify that every layer of every needed block arrived; mark the transfer complete."""
        try:
            return self._commit(header, network_wait_s)
        finally:
            self._free_dropped()

    def _commit(self, header: pb.KVChunkHeader, network_wait_s: float) -> TransferStats:
        with self._cond:
            r = self._authorised(header)
            n = header.num_tokens
            if missing := r.missing_layers(self.layout.num_layers, self.layout.block_size, n):
                reason = f"commit of {n} tokens with layers {missing[:4]}... incomplete"
                self._drop(r, reason)
                raise ChunkRejected("incomplete", reason)
            r.state, r.finished = State.COMPLETE, time.monotonic()
            r.holder = ""  # every in-place write came before the commit
            r.network_wait_s = network_wait_s
            stats = TransferStats(
                r.request_id, r.bytes, r.chunks, r.finished - (r.started or r.finished), network_wait_s
            )
            self.outcomes.commit(stats)
            return stats

    def _authorised(self, header: pb.KVChunkHeader) -> Reservation:
        r = self.table.get(header.request_id)
        if r is None:
            raise ChunkRejected("unknown_request", f"no reservation for {header.request_id!r} (unknown or expired)")
        if not same_secret(header.transfer_token, r.token):
            raise ChunkRejected("bad_token", "wrong or reused transfer token")
        if r.deadline <= self.table.clock():
            self._drop(r, "lease expired")
            raise ChunkRejected("expired", f"the reservation of {header.request_id!r} expired")
        if r.state is State.COMPLETE:
            raise ChunkRejected("complete", "the transfer is already committed")
        return r

    # ---- completion and admission ----------------------------------------------------------

    def wait(self, request_id: str, timeout: float) -> TransferStats:
        """Block until the transfer commits. Raises KVTransferError if it failed, TransferTimeout."""
        return self.outcomes.wait(request_id, timeout)

    def admit(
        self, request_id: str, prompt_token_ids: Sequence[int], first_token_id: int, params: SamplingParams
    ) -> None:
        """Hand a complete transfer to the engine as a running request."""
        self.engine.prepare(params)

        def start(r: Reservation) -> None:
            if len(prompt_token_ids) > r.num_tokens:
                self.engine.release(request_id)
                raise KVTransferError(f"{len(prompt_token_ids)} prompt tokens, {r.num_tokens} reserved")
            self.engine.add_prefilled_request(request_id, prompt_token_ids, first_token_id, params)

        self.hand_over(request_id, start)

    def hand_over(self, request_id: str, use: Callable[[Reservation], None]) -> None:
        """Take a committed transfer out of the table and give its blocks, which the engine holds
        as a reservation, to `use(reservation)` (under the engine lock): it admits them, caches
        them or releases them. Raises KVTransferError, or what `use` raises."""
        with self.engine_lock, self._cond:
            r = self.table.get(request_id)
            if r is None or r.state is not State.COMPLETE:
                raise KVTransferError(f"request {request_id!r} has no complete transfer to hand over")
            self.table.pop(request_id)
            use(r)

    def check_integrity(self) -> None:
        """Raise AssertionError if leases and the engine's blocks disagree."""
        with self.engine_lock, self._cond:
            self.table.check_integrity()
            for rid in self.table.ids():
                assert self.engine.kv.has_request(rid), f"reservation {rid} holds no engine blocks"
            for rid in self.fence.ids():
                assert rid not in self.table, f"{rid} is both fenced and reserved"
                assert self.engine.kv.has_request(rid), f"fenced {rid} holds no engine blocks"
            self.engine.check_integrity()
