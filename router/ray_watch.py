"""Whether the Ray this router runs on is still there: its GCS and this host's raylet.

- `ray down`, or a head node that dies, takes the GCS away. Ray's client in this process then
  retries for a minute (`gcs_rpc_server_reconnect_timeout_s`) and aborts the process; every Ray
  call meanwhile blocks rather than fails.
- A raylet that dies takes its node with it: the GCS marks the node's actors dead (the pool
  manager, the workers), so nothing replaces them, while their processes live on, orphaned,
  and heartbeat into Redis: `/ready` said 200 and every request got a 503, for as long as
  `tandem serve` ran (the raylet it started stays a zombie until it exits, and a Ray worker
  only leaves once its raylet's pid is gone).

So the watch does not ask Ray: it opens a TCP connection to the GCS's port and the raylet's,
which a stopped process refuses at once and a dead host lets time out. Either unreachable for
GONE_AFTER_S in a row, serving stops, and `tandem serve` exits 1 (a supervisor restarts it).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable

GONE_AFTER_S = 10.0  # a GCS back within this (restarted in place) stops nothing; Ray itself gives up at 60 s
INTERVAL_S = 2.0
CONNECT_S = 1.0


def port_open(address: str, timeout_s: float = CONNECT_S) -> bool:
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
        gcs: str | None = None,
    ) -> None:
        self._reachable = reachable
        self._gone_after_s = gone_after_s
        self._interval_s = interval_s
        self._gcs = gcs
        self.gone = threading.Event()

    def gcs_refuses(self) -> bool:
        """Whether the GCS refuses a connection now: every Ray call would block (a stop needs no
        GONE_AFTER_S to know that; a GCS that is only slow to answer still counts as there)."""
        return self._gcs is not None and not port_open(self._gcs)

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


def ray_addresses() -> tuple[str, str | None]:
    """This process's GCS and its node's raylet, as "host:port" (the raylet None where Ray lists
    no node of this driver's)."""
    import ray

    context = ray.get_runtime_context()
    node_id = context.get_node_id()
    nodes = [n for n in ray.nodes() if n.get("NodeID") == node_id]  # type: ignore[no-untyped-call]
    raylet = f"{nodes[0]['NodeManagerAddress']}:{nodes[0]['NodeManagerPort']}" if nodes else None
    return context.gcs_address, raylet


def watch_ray(stop: threading.Event, on_gone: Callable[[str], None]) -> RayWatch:
    """Start a RayWatch over this process's GCS and raylet; `on_gone` gets what is gone, in words."""
    gcs, raylet = ray_addresses()

    def reachable() -> bool:
        return port_open(gcs) and (raylet is None or port_open(raylet))

    def gone() -> None:
        node = "this host's Ray node is gone (its raylet stopped)"
        on_gone("the Ray cluster is gone" if not port_open(gcs) else node)

    return RayWatch(reachable, gcs=gcs).start(stop, gone)
