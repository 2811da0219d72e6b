"""How the receiver's recent transfers ended: committed (with their stats) or failed (with why),
and `wait` for one to end. Bounded: the last MAX_KEPT of each are kept."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

from kv_transfer.errors import KVTransferError, TransferTimeout
from kv_transfer.stats import TransferStats

MAX_KEPT = 1024


class Outcomes:
    """Guarded by the receiver's condition `cond`: `forget`, `fail` and `commit` are called with
    it held (and notify its waiters); `wait` takes it."""

    def __init__(self, cond: threading.Condition) -> None:
        self._cond = cond
        self._failed: OrderedDict[str, str] = OrderedDict()
        self._done: OrderedDict[str, TransferStats] = OrderedDict()

    def forget(self, request_id: str) -> None:
        """A new reservation under an id: what an earlier one under it came to no longer counts."""
        self._failed.pop(request_id, None)
        self._done.pop(request_id, None)

    def fail(self, request_id: str, reason: str) -> None:
        self._failed[request_id] = reason
        while len(self._failed) > MAX_KEPT:
            self._failed.popitem(last=False)
        self._cond.notify_all()

    def commit(self, stats: TransferStats) -> None:
        self._done[stats.request_id] = stats
        while len(self._done) > MAX_KEPT:
            self._done.popitem(last=False)
        self._cond.notify_all()

    def wait(self, request_id: str, timeout: float) -> TransferStats:
        """Block until the transfer commits. Raises KVTransferError if it failed, TransferTimeout."""
        end = time.monotonic() + timeout
        with self._cond:
            while True:
                if request_id in self._done:
                    return self._done[request_id]
                if request_id in self._failed:
                    raise KVTransferError(f"transfer of {request_id!r} failed: {self._failed[request_id]}")
                left = end - time.monotonic()
                if left <= 0:
                    raise TransferTimeout(f"transfer of {request_id!r} not complete after {timeout:.1f} s")
                self._cond.wait(left)
