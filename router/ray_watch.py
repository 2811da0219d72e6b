"""In join mode (`tandem serve --join`): whether the Ray cluster is still there.

`ray down`, or a head node that dies, takes the GCS away. Ray's client in this process then
retries for a minute (`gcs_rpc_server_reconnect_timeout_s`) and aborts the process; every Ray
call meanwhile blocks rather than fails. So the watch does not ask Ray: it opens a TCP
connection to the GCS's port, which a stopped GCS refuses at once and a dead host lets time
out. Unreachable for GONE_AFTER_S in a row, the cluster is gone: serving stops cleanly, and the
exit leaves Ray's own exit hook out (it would wait on the GCS again).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

GONE_AFTER_S = 10.0  # a GCS back within this (restarted in place) stops nothing; Ray itself gives up at 60 s
INTERVAL_S = 2.0
CONNECT_S = 1.0


def gcs_reachable(address: str, timeout_s: float = CONNECT_S) -> bool:
    """Whether something accepts a TCP connection at `address` ("host:port") within timeout_s."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host, int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class RayWatch:
    """Calls `on_gone` once `reachable()` has been False for `gone_after_s` (checked every
    `interval_s`), then returns; `gone` is set from then on."""

    def __init__(
        self,
        reachable: Callable[[], bool],
        gone_after_s: float = GONE_AFTER_S,
        interval_s: float = INTERVAL_S,
    ) -> None:
        self._reachable = reachable
        self._gone_after_s = gone_after_s
        self._interval_s = interval_s
        self.gone = threading.Event()

    def run(self, stop: threading.Event, on_gone: Callable[[], None]) -> None:
        last_seen = time.monotonic()
        while not stop.wait(self._interval_s):
            if self._reachable():
                last_seen = time.monotonic()
            elif time.monotonic() - last_seen >= self._gone_after_s:
                self.gone.set()
                on_gone()
                return

    def start(self, stop: threading.Event, on_gone: Callable[[], None]) -> RayWatch:
        threading.Thread(target=self.run, args=(stop, on_gone), name="ray-watch", daemon=True).start()
        return self
