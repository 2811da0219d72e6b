"""Workers outlive their pool manager: a manager that Ray restarts after a crash adopts them.

Worker actors are detached (cluster/actors.py, start_worker), so they do not share the fate of
the manager that started them; the manager itself is restarted by Ray (Cluster.connect). On
its way up, the new manager finds its namespace's workers by name and asks each what it is:

    named tandem-<ns>-<worker id>, alive  ── stats() within ADOPT_WAIT_S ──▶ up, or draining if it says so
                                          ── no answer ────────────────────▶ starting (still loading, or
                                                                             frozen: the rounds decide)

Nothing is restarted and no stream is lost: routers talk to the workers directly, and keep
their last view of the pools while the manager is away (cluster/view.py).
"""

from __future__ import annotations

import contextlib
import re
from typing import Any

import ray

from cluster.pool_plan import State
from cluster.worker_table import WorkerRecord

ADOPT_WAIT_S = 5.0
_WORKER_ID = re.compile(r"[pdc]\d+-\d+")  # PoolManager._start's ids: role initial, count, clock


def worker_actors(namespace: str) -> dict[str, Any]:
    """worker id -> handle of every live worker actor of the cluster `namespace`."""
    ns, prefix = f"tandem-{namespace}", f"tandem-{namespace}-"
    found = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        wid = a["name"].removeprefix(prefix)
        if a["namespace"] == ns and a["name"].startswith(prefix) and _WORKER_ID.fullmatch(wid):
            with contextlib.suppress(ValueError):  # gone since it was listed
                found[wid] = ray.get_actor(a["name"], namespace=ns)
    return found


def adopt(namespace: str, wait_s: float = ADOPT_WAIT_S) -> list[WorkerRecord]:
    """Records for the workers a previous manager of `namespace` left running (see above)."""
    handles = worker_actors(namespace)
    asked = {wid: h.stats.remote() for wid, h in handles.items()}
    if asked:
        ray.wait(list(asked.values()), num_returns=len(asked), timeout=wait_s)
    records = []
    for wid, ref in asked.items():
        stats: dict[str, Any] = {}
        with contextlib.suppress(Exception):  # not answered in time, or dead: the rounds decide
            stats = ray.get(ref, timeout=0)
        role = str(stats.get("role") or {"p": "prefill", "d": "decode", "c": "colocated"}[wid[0]])
        state: State = "starting" if not stats else "draining" if stats.get("draining") else "up"
        records.append(WorkerRecord(wid, role, handles[wid], state=state))
    return records


def kill_workers(namespace: str) -> int:
    """Kill every worker actor of `namespace` (what a manager that cannot shut down leaves)."""
    handles = worker_actors(namespace)
    for h in handles.values():
        with contextlib.suppress(Exception):
            ray.kill(h)
    return len(handles)
