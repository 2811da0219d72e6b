"""Waiting for a Cluster's pools to come up, and refusing at once where they never can.

Ray keeps a worker it cannot place pending without a word, and a worker whose engine cannot be
built dies in its constructor again on every start (cluster/start_failures.py). Either way a
plain wait would run out its whole timeout. `wait_ready` stops early: before waiting, where the
Ray was not joined (so never grows) and lacks a slot for a desired role or a GPU a worker
claims; while waiting, where a pool's workers keep dying before they answer.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

import ray

from cluster.start_failures import GIVE_UP_AFTER, WorkersCannotStart

if TYPE_CHECKING:
    from cluster.cluster import Cluster


def wait_ready(cluster: Cluster, timeout: float = 180.0, stop: threading.Event | None = None) -> bool:
    """Block until every desired worker is up and registered (True), or `stop` is set (False).
    Raises WorkersCannotStart (see above), TimeoutError after `timeout`."""
    pause = stop or threading.Event()
    end = time.monotonic() + timeout
    checked = 0.0
    check_placement(cluster)
    while time.monotonic() < end:
        desired = cluster.state.desired()
        ws = cluster.workers()
        up = {r: sum(1 for w in ws if w["role"] == r and w["state"] == "up" and "free_blocks" in w) for r in desired}
        if all(up[r] >= n for r, n in desired.items()) and sum(desired.values()) > 0:
            return True
        if time.monotonic() - checked >= 1.0:
            checked = time.monotonic()
            status = cluster.manager_status(timeout_s=2.0)
            for f in status.start_failures if status is not None else ():
                if f.count >= GIVE_UP_AFTER and desired.get(f.role, 0) > 0 and up.get(f.role, 0) == 0:
                    raise WorkersCannotStart(f.role, f.count, f.reason)
        if pause.wait(0.25):
            return False
    raise TimeoutError(f"cluster not ready after {timeout:.0f} s: {cluster.status()}")


def check_placement(cluster: Cluster) -> None:
    """Raises WorkersCannotStart where a worker could never be placed on the cluster's Ray, which
    was not joined (no RAY_ADDRESS) and so never grows: its role has no slot on it (a Ray that
    something else in this process started without Tandem's node resources), or it claims a GPU
    the Ray lacks."""
    if cluster.joined_ray:
        return
    have = ray.cluster_resources()  # type: ignore[no-untyped-call]
    desired = cluster.state.desired()
    for role, n in desired.items():
        if n > 0 and have.get(role, 0) < 1:
            why = "(a Ray started in this process without them: cluster/inventory.py's node_resources)"
            raise WorkersCannotStart(role, 0, f"the Ray here has no {role!r} worker slots {why}")
    needed = cluster.config.engine.num_gpus
    if needed and have.get("GPU", 0) < needed:
        role = next((r for r, n in desired.items() if n > 0), "every")
        why = f"device {cluster.config.engine.device} claims {needed} GPU a worker; the Ray started here has "
        raise WorkersCannotStart(role, 0, f"{why}{have.get('GPU', 0):g} (a CPU-only torch wheel, or no driver)")
