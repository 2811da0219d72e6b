"""Worker actors in Ray: started under a name in their role's slot, found by that name, adopted
by a pool manager that Ray restarted, killed when a cluster goes.

Workers outlive their pool manager: they are detached, so they do not share the fate of the
manager that started them; the manager itself is restarted by Ray (Cluster.connect). On its
way up, the new manager finds its namespace's workers by name and asks each what it is:

    named tandem-<ns>-<worker id>, alive  ── stats() within ADOPT_WAIT_S ──▶ up, or draining if it says so,
                                                                             or flipping (drained to turn into
                                                                             the role it names): the flip goes on
                                          ── no answer ────────────────────▶ starting (still loading, or
                                                                             frozen: the rounds decide)

Nothing is restarted and no stream is lost: routers talk to the workers directly, and keep
their last view of the pools while the manager is away (cluster/view.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Iterable
from typing import Any

import ray

from cluster.actors import CONCURRENCY_GROUPS, MAX_STREAMS, ColocatedActor, PDActor
from cluster.pool_plan import State
from cluster.worker_table import WorkerRecord
from engine.config import EngineConfig
from engine.roles import FLIPPABLE
from kv_transfer.security import KVTLSConfig

log = logging.getLogger(__name__)
ADOPT_WAIT_S = 5.0
_WORKER_ID = re.compile(r"([pdc])(\d+)-\d+")  # role initial, a count, the clock (new_worker_id)
_INITIALS = {"prefill": "p", "decode": "d", "colocated": "c"}


ACTOR_CLASSES: dict[str, type] = {"prefill": PDActor, "decode": PDActor, "colocated": ColocatedActor}


def new_worker_id(role: str, count: int) -> str:
    """A worker's id: its first role's initial, the manager's count, and the clock (ms, mod 1e5)."""
    return f"{_INITIALS[role]}{count}-{int(time.time() * 1000) % 100000}"


def next_count(worker_ids: Iterable[str]) -> int:
    """The count a manager goes on from, past those of `worker_ids` (workers it adopted)."""
    return max((int(m.group(2)) + 1 for w in worker_ids if (m := _WORKER_ID.fullmatch(w))), default=0)


def actor_name(namespace: str, worker_id: str) -> str:
    return f"tandem-{namespace}-{worker_id}"


def start_worker(
    role: str,
    worker_id: str,
    model_path: str,
    config: EngineConfig,
    state_url: str,
    namespace: str,
    transport: str = "grpc",
    tls: KVTLSConfig | None = None,
    env: dict[str, str] | None = None,
) -> Any:
    """Start one worker actor in its role's slot; returns its handle (it loads asynchronously).

    `transport` is how a prefill worker ships KV (grpc, shm); `tls` secures the KV channel of
    prefill and decode workers; a colocated worker needs neither. `env`: more of the worker
    process's environment (ClusterConfig.worker_env)."""
    # Ray takes concurrency groups only at ray.remote(), never in .options(); its stubs omit the option.
    cls: Any = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(ACTOR_CLASSES[role])  # type: ignore[call-overload]
    env = {**(env or {}), "OMP_NUM_THREADS": str(config.num_threads or os.cpu_count() or 1)}
    if "TANDEM_BIND_HOST" in os.environ:
        env["TANDEM_BIND_HOST"] = os.environ["TANDEM_BIND_HOST"]
    return cls.options(
        name=actor_name(namespace, worker_id),
        namespace=f"tandem-{namespace}",
        resources={role: 1},
        num_cpus=0,
        num_gpus=config.num_gpus,  # Ray then makes that GPU the worker's only visible one
        max_concurrency=MAX_STREAMS,
        max_restarts=0,
        lifetime="detached",  # a restarted pool manager adopts it (cluster/worker_actors.py)
        runtime_env={"env_vars": env},
    ).remote(
        worker_id,
        model_path,
        config,
        state_url,
        namespace,
        **({"transport": transport, "tls": tls} if role != "colocated" else {}),
    )


def worker_actors(namespace: str) -> dict[str, Any]:
    """worker id -> handle of every live worker actor of the cluster `namespace`."""
    ns, prefix = f"tandem-{namespace}", actor_name(namespace, "")
    found = {}
    for a in ray.util.list_named_actors(all_namespaces=True):
        wid = a["name"].removeprefix(prefix)
        if a["namespace"] == ns and a["name"].startswith(prefix) and _WORKER_ID.fullmatch(wid):
            with contextlib.suppress(ValueError):  # gone since it was listed
                found[wid] = ray.get_actor(a["name"], namespace=ns)
    return found


def adopt(namespace: str, wait_s: float = ADOPT_WAIT_S) -> list[WorkerRecord]:
    """Records for the workers a previous manager of `namespace` left running (see above). A
    failure to list them is logged, not raised: a manager that starts is better than none."""
    try:
        handles = worker_actors(namespace)
    except Exception as e:
        log.warning("could not list the workers of %s to adopt them: %s: %s", namespace, type(e).__name__, e)
        return []
    asked = {wid: h.stats.remote() for wid, h in handles.items()}
    if asked:
        ray.wait(list(asked.values()), num_returns=len(asked), timeout=wait_s)
    records = []
    for wid, ref in asked.items():
        stats: dict[str, Any] = {}
        with contextlib.suppress(Exception):  # not answered in time, or dead: the rounds decide
            stats = ray.get(ref, timeout=0)
        records.append(adopted(wid, handles[wid], stats))
    return records


def adopted(worker_id: str, handle: Any, stats: dict[str, Any]) -> WorkerRecord:
    """The record of a running worker that answered `stats` (empty: it did not answer)."""
    role = str(stats.get("role") or {v: k for k, v in _INITIALS.items()}[worker_id[0]])
    state: State = "starting" if not stats else "draining" if stats.get("draining") else "up"
    to = str(stats.get("flip_to") or "")
    if state == "draining" and to in FLIPPABLE and to != role:  # a flip the last manager began
        return WorkerRecord(worker_id, role, handle, state="flipping", flip_to=to, flip_started=time.monotonic())
    return WorkerRecord(worker_id, role, handle, state=state)


def kill_workers(namespace: str) -> int:
    """Kill every worker actor of `namespace` (what a manager that cannot shut down leaves)."""
    handles = worker_actors(namespace)
    for h in handles.values():
        with contextlib.suppress(Exception):
            ray.kill(h)
    return len(handles)
