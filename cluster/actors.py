"""The Ray actors: the plain workers, plus a control lane and registration in Redis (cluster.registration).

Actors are threaded, with three lanes (Ray concurrency groups), so that no control call ever
waits behind generation:

    default  max 64   generate / prefill / reserve: one thread per stream, held for its length
    health   max 4    ping, drain: touch no lock, answer within milliseconds however busy
    control  max 16   idle, abort, release, stats, check_integrity: wait for one engine step at most

They ask for 0 CPUs and one slot of their role's custom resource, so placement follows the
`prefill` / `decode` / `colocated` slots nodes advertise.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import ray

from cluster.registration import PublishesBlocks, Registered
from decode_workers.colocated import ColocatedWorker
from decode_workers.worker import DecodeWorker
from engine.config import EngineConfig
from engine.messages import TokenOutput
from engine.worker_base import WorkerBase
from kv_transfer.security import KVTLSConfig
from prefill_workers.worker import PrefillResult, PrefillWorker

MAX_STREAMS = 64
HEALTH, CONTROL = "health", "control"
CONCURRENCY_GROUPS = {HEALTH: 4, CONTROL: 16}

_F = TypeVar("_F", bound=Callable[..., Any])


def _lane(group: str) -> Callable[[_F], _F]:
    """`ray.method(concurrency_group=group)`, typed as what it is for a local call: the method itself."""

    def tag(fn: _F) -> _F:
        return cast(_F, ray.method(concurrency_group=group)(fn))

    return tag


class _ControlLane(WorkerBase):
    """First among each actor's bases, so these overrides win: the same methods, on their own lanes.
    The request-serving methods stay in the default group, wrapped in `serving()` for idle()."""

    @_lane(HEALTH)
    def ping(self) -> str:
        return super().ping()

    @_lane(HEALTH)
    def drain(self) -> None:
        super().drain()

    @_lane(CONTROL)
    def idle(self) -> bool:
        return super().idle()

    @_lane(CONTROL)
    def abort(self, request_id: str) -> bool:
        return super().abort(request_id)

    @_lane(CONTROL)
    def stats(self) -> dict[str, Any]:
        return super().stats()

    @_lane(CONTROL)
    def check_integrity(self) -> None:
        super().check_integrity()


class PrefillActor(_ControlLane, PrefillWorker, PublishesBlocks):
    def __init__(
        self,
        worker_id: str,
        model_path: str,
        config: EngineConfig,
        state_url: str,
        namespace: str,
        transport: str = "grpc",
        tls: KVTLSConfig | None = None,
    ) -> None:
        PrefillWorker.__init__(self, worker_id, model_path, config, transport, tls=tls)
        self._register(state_url, namespace)

    def prefill(self, *args: Any, **kwargs: Any) -> PrefillResult:
        with self.serving():
            try:
                return super().prefill(*args, **kwargs)
            finally:
                self.publish_soon()


class DecodeActor(_ControlLane, DecodeWorker, PublishesBlocks):
    def __init__(
        self,
        worker_id: str,
        model_path: str,
        config: EngineConfig,
        state_url: str,
        namespace: str,
        tls: KVTLSConfig | None = None,
    ) -> None:
        # The KV endpoint other nodes dial; loopback unless the deployment names this node's address.
        host = os.environ.get("TANDEM_BIND_HOST", "127.0.0.1")
        DecodeWorker.__init__(self, worker_id, model_path, config, host=host, tls=tls)
        self._register(state_url, namespace)

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[TokenOutput]:
        with self.serving():
            try:
                yield from super().generate(*args, **kwargs)
            finally:
                self.publish_soon()

    def generate_local(self, *args: Any, **kwargs: Any) -> Iterator[TokenOutput]:
        with self.serving():
            try:
                yield from super().generate_local(*args, **kwargs)
            finally:
                self.publish_soon()

    @_lane(CONTROL)
    def release(self, request_id: str) -> bool:
        return super().release(request_id)

    @_lane(CONTROL)
    def idle(self) -> bool:
        # A reservation is a request between reserve() and generate(): a drain waits for it too.
        return bool(self.loop.call(lambda e: len(self.receiver.table) == 0)) and super().idle()


class ColocatedActor(_ControlLane, ColocatedWorker, Registered):
    def __init__(self, worker_id: str, model_path: str, config: EngineConfig, state_url: str, namespace: str) -> None:
        super().__init__(worker_id, model_path, config)
        self._register(state_url, namespace)

    def generate(self, *args: Any, **kwargs: Any) -> Iterator[TokenOutput]:
        with self.serving():
            yield from super().generate(*args, **kwargs)


ACTOR_CLASSES: dict[str, type] = {"prefill": PrefillActor, "decode": DecodeActor, "colocated": ColocatedActor}


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
) -> Any:
    """Start one worker actor in its role's slot; returns its handle (it loads asynchronously).

    `transport` is how a prefill worker ships KV (grpc, shm); `tls` secures the KV channel of
    prefill and decode workers; a colocated worker needs neither."""
    # Ray takes concurrency groups only at ray.remote(), never in .options(); its stubs omit the option.
    cls: Any = ray.remote(concurrency_groups=CONCURRENCY_GROUPS)(ACTOR_CLASSES[role])  # type: ignore[call-overload]
    env = {"OMP_NUM_THREADS": str(config.num_threads or os.cpu_count() or 1)}
    if "TANDEM_BIND_HOST" in os.environ:
        env["TANDEM_BIND_HOST"] = os.environ["TANDEM_BIND_HOST"]
    return cls.options(
        name=actor_name(namespace, worker_id),
        namespace=f"tandem-{namespace}",
        resources={role: 1},
        num_cpus=0,
        max_concurrency=MAX_STREAMS,
        max_restarts=0,
        runtime_env={"env_vars": env},
    ).remote(
        worker_id,
        model_path,
        config,
        state_url,
        namespace,
        *([transport] if role == "prefill" else []),
        **({"tls": tls} if role != "colocated" else {}),
    )
