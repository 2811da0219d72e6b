"""The pool manager from a router's side: start it, or find it running (another router's, or
this one's before a restart), and stop it. One per namespace, named and detached: it outlives
the router that started it, and Ray restarts it if it dies (it then adopts the running workers,
cluster/worker_actors.py).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import ray

from cluster.config import ClusterConfig, role_config
from cluster.start_failures import StartFailure
from engine.config import EngineConfig
from engine.roles import ROLES

MANAGER = "tandem-pool-manager"
MANAGER_PING_S = 2.0  # its ping answers in milliseconds, on its own thread, even mid-round
MANAGER_START_S = 120.0  # a new manager's start (2-4 s here), awaited before the routing view's first read


class CannotJoinError(RuntimeError):
    """Pools run in the namespace, and this router cannot serve them: their state is in a Redis
    it was not given, or they run another model than its own."""


@dataclass(frozen=True)
class ManagerStatus:
    """PoolManager.status."""

    rounds: int  # reconcile rounds completed
    state_ok: bool  # the last round reached Redis
    desired: dict[str, int] | None  # the sizes it works to (None: never read); a copy
    pid: int = 0  # its process
    adopted: tuple[str, ...] = ()  # workers it found running when it started (after a restart)
    start_failures: tuple[StartFailure, ...] = ()  # roles whose workers died before answering, and why


@dataclass(frozen=True)
class PoolSpec:
    """What the pools were started with (PoolManager.spec): a router that joins them serves with
    the same engine settings (its request limits and block counts come from them)."""

    model_path: str
    engine: EngineConfig  # the colocated role's: every role's config is it with its own role
    transport: str


def running(namespace: str) -> bool:
    """Whether the namespace's pool manager is there (alive, or being restarted by Ray)."""
    try:
        ray.get_actor(MANAGER, namespace=f"tandem-{namespace}")
    except ValueError:
        return False
    return True


def check_joinable(namespace: str, shared_state: bool) -> None:
    """Before a router starts a Redis of its own: raise CannotJoinError if pools already run
    in `namespace` (a new Redis cannot be theirs)."""
    if not shared_state and running(namespace):
        raise CannotJoinError(
            f"pools already run in namespace {namespace!r} with their state in a Redis this router was not "
            "given: set REDIS_URL to that Redis (or pick another --namespace)"
        )


def start_or_join(config: ClusterConfig, state_url: str) -> tuple[Any, bool]:
    """The namespace's pool manager, and whether it was running already (its workers, engine
    config and transport are then the ones it was started with, not `config`'s)."""
    from cluster.pool_manager import PoolManager

    ns = f"tandem-{config.namespace}"
    was_running = running(config.namespace)
    configs = {role: role_config(config.engine, role) for role in ROLES}
    manager: Any = ray.remote(PoolManager).options(  # type: ignore[attr-defined]
        name=MANAGER, namespace=ns, lifetime="detached", get_if_exists=True, num_cpus=0, max_concurrency=8,
        max_restarts=-1,  # it adopts the running workers (cluster/worker_actors.py): no stream is lost
    ).remote(
        state_url, config.namespace, config.model_path, configs, config.transport, kv_tls=config.kv_tls,
        worker_env=config.worker_env,
    )  # fmt: skip
    ray.get(manager.__ray_ready__.remote(), timeout=MANAGER_START_S)
    return manager, was_running


def joined_config(config: ClusterConfig, manager: Any) -> ClusterConfig:
    """`config` with the running pools' engine and transport. Raises CannotJoinError if they run
    another model (by file name: the path may differ from host to host)."""
    spec: PoolSpec = ray.get(manager.spec.remote(), timeout=MANAGER_PING_S * 15)
    if Path(spec.model_path).name != Path(config.model_path).name:
        raise CannotJoinError(
            f"the pools in namespace {config.namespace!r} run {Path(spec.model_path).name}, not "
            f"{Path(config.model_path).name}: give this router their model (or pick another --namespace)"
        )
    return replace(config, engine=spec.engine, transport=spec.transport)


def stop(manager: Any) -> None:
    """The pool manager's own shutdown (it kills its workers), once it answers a ping. A frozen
    one raises here after MANAGER_PING_S, and the caller's kill steps take it and its workers
    down instead (its shutdown call alone would wait 20 s)."""
    ray.get(manager.ping.remote(), timeout=MANAGER_PING_S)
    ray.get(manager.shutdown.remote(), timeout=20)
