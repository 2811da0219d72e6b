"""A full pool is a queue, not an error. When every worker that could run a request is up but
has no room for it (its KV blocks held by requests in flight), the request waits for room, as
an engine's own queue would, instead of failing at once: a burst of long prompts on one decode
worker answered 10 of 12 with 503 "retry later" while the other two ran. It waits until the
router's queue deadline (`queue_timeout_s` after it arrived, its admission wait included), then
gets the admission queue's answer: 429 with Retry-After. Routing is local (the view and the
ledger), so trying again every ROOM_POLL_S costs little.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from cluster.placer import NoRoomError
from cluster.routing import Route
from router.errors import Saturated

ROOM_POLL_S = 0.1  # room comes back as requests end: seconds apart when every worker is full


def route_when_room(route: Callable[[], Route], deadline: float, cancel: threading.Event) -> Route:
    """`route()`, tried again while it raises NoRoomError, until `deadline` (monotonic; then
    Saturated) or `cancel` (the client left: the NoRoomError)."""
    while True:
        try:
            return route()
        except NoRoomError as e:
            left = deadline - time.monotonic()
            if left <= 0:
                raise Saturated("no worker has had room for this request within the queue's time") from e
            if cancel.wait(min(ROOM_POLL_S, left)):
                raise
