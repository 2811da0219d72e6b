"""Waiting on conditions, not sleeps: the one helper every integration test uses."""

from __future__ import annotations

import time
from collections.abc import Callable


def until(cond: Callable[[], bool], timeout: float, what: str, every: float = 0.1) -> None:
    """Return once `cond()` holds; AssertionError naming `what` after `timeout` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if cond():
            return
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
