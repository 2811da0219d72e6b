"""Leases on decode-side blocks, from Reserve to admission. Bookkeeping only: no torch, no I/O.

    RESERVED --chunk--> RECEIVING --commit ok--> COMPLETE --admit--> (gone, engine owns it)
        \\__________________\\________________________\\__ release / reject / expiry --> (gone, blocks freed)

Every state but "gone" holds the blocks; the lease deadline applies in all of them, so a
sender that dies, or a caller that never admits, cannot strand blocks. Each accepted chunk
renews the lease (never shortening it), so a long prefill that keeps sending never expires,
while one that stops for a whole lease does.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum


class State(Enum):
    RESERVED = "reserved"
    RECEIVING = "receiving"
    COMPLETE = "complete"


@dataclass
class Reservation:
    request_id: str
    token: str
    block_ids: list[int]
    num_tokens: int
    deadline: float
    state: State = State.RESERVED
    received: dict[int, set[int]] = field(default_factory=dict)  # layer -> destination blocks written
    bytes: int = 0
    chunks: int = 0
    started: float = 0.0
    finished: float = 0.0
    network_wait_s: float = 0.0
    holder: str = ""  # the lock of a sender that may write the blocks in place (kv_transfer/in_place.py)
    owner: str = ""  # the router it was made for (its feed subscriber), if it said

    def blocks_needed(self, block_size: int, num_tokens: int) -> list[int]:
        return self.block_ids[: -(-num_tokens // block_size)]

    def missing_layers(self, num_layers: int, block_size: int, num_tokens: int) -> list[int]:
        """The layers of which some block `num_tokens` tokens need has not arrived (every layer
        if `num_tokens` is out of range)."""
        ok = 0 < num_tokens <= self.num_tokens
        needed = set(self.blocks_needed(block_size, num_tokens))
        return [i for i in range(num_layers) if not ok or not needed <= self.received.get(i, set())]


class ReservationTable:
    """request id -> Reservation, with lease deadlines. Not thread-safe: the receiver locks."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._by_id: dict[str, Reservation] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._by_id

    def add(
        self, request_id: str, block_ids: list[int], num_tokens: int, lease_s: float, owner: str = ""
    ) -> Reservation:
        if request_id in self._by_id:
            raise ValueError(f"request {request_id!r} already has a reservation")
        deadline = self.clock() + lease_s
        r = Reservation(request_id, secrets.token_hex(16), list(block_ids), num_tokens, deadline, owner=owner)
        self._by_id[request_id] = r
        return r

    def renew(self, r: Reservation, lease_s: float) -> None:
        """Push the deadline to at least `lease_s` from now."""
        r.deadline = max(r.deadline, self.clock() + lease_s)

    def get(self, request_id: str) -> Reservation | None:
        return self._by_id.get(request_id)

    def pop(self, request_id: str) -> Reservation | None:
        return self._by_id.pop(request_id, None)

    def expired(self) -> list[Reservation]:
        now = self.clock()
        return [r for r in self._by_id.values() if r.deadline <= now]

    def ids(self) -> list[str]:
        return list(self._by_id)

    def owned_by(self, owner: str) -> list[Reservation]:
        return [r for r in self._by_id.values() if owner and r.owner == owner]

    def check_integrity(self) -> None:
        """Raise AssertionError if two reservations share a block or a state is inconsistent."""
        seen: set[int] = set()
        for r in self._by_id.values():
            dup = seen.intersection(r.block_ids)
            assert not dup, f"blocks {sorted(dup)} reserved twice"
            seen.update(r.block_ids)
            written = set().union(*r.received.values()) if r.received else set()
            assert written <= set(r.block_ids), f"{r.request_id} wrote outside its blocks"
            assert r.state is not State.RESERVED or not r.received, f"{r.request_id} received data while RESERVED"
