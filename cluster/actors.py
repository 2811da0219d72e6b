"""The Ray actors: the plain workers, plus a control lane and registration in Redis (cluster.registration).

Actors are threaded, with three lanes (Ray concurrency groups), so that no control call ever
waits behind generation:

    default  max 64   start / prefill / reserve / write-back: one thread per call, held for its length
    health   max 4    ping, drain: touch no lock, answer within milliseconds however busy
    control  max 16   idle, abort, release, stats, check_integrity: wait for one engine step at most
    feed     max 8    take_outputs: a router's long poll for its requests' outputs (engine/outbox.py)

They ask for 0 CPUs and one slot of their role's custom resource, so placement follows the
`prefill` / `decode` / `colocated` slots nodes advertise.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from typing import Any, TypeVar, cast

import ray

from cluster.registration import PublishesBlocks, Registered
from decode_workers.colocated import ColocatedWorker
from decode_workers.worker import DecodeWorker
from engine.config import EngineConfig
from engine.messages import TokenOutput
from engine.outbox import Item
from engine.outputs import RequestOutput
from engine.worker_base import WorkerBase
from kv_transfer.security import KVTLSConfig
from kv_transfer.write_back import WriteBackResult, WriteBackTicket
from prefill_workers.worker import PrefillResult, PrefillWorker

MAX_STREAMS = 64
# A write-back's calls to its target: they wait for one engine step at most (the lock is fair),
# so this only bounds a frozen target.
WRITE_BACK_CALL_S = 30.0
log = logging.getLogger(__name__)
HEALTH, CONTROL, FEED = "health", "control", "feed"
CONCURRENCY_GROUPS = {HEALTH: 4, CONTROL: 16, FEED: 8}

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

    @_lane(FEED)
    def take_outputs(self, subscriber: str, wait_s: float) -> list[Item]:
        return super().take_outputs(subscriber, wait_s)

    def start(self, *args: Any, **kwargs: Any) -> None:
        with self.serving():
            super().start(*args, **kwargs)

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
        PrefillWorker.__init__(self, worker_id, model_path, config, transport, tls=tls, host=_bind_host())
        self._register(state_url, namespace)

    def prefill(self, *args: Any, **kwargs: Any) -> PrefillResult:
        with self.serving():
            try:
                return super().prefill(*args, **kwargs)
            finally:
                self.publish_soon()

    def adopt_write_back(self, request_id: str, token_ids: list[int]) -> None:
        try:
            super().adopt_write_back(request_id, token_ids)
        finally:
            self.publish_soon()  # the next turn, perhaps sent already, looks these blocks up


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
        DecodeWorker.__init__(self, worker_id, model_path, config, host=_bind_host(), tls=tls)
        self._register(state_url, namespace)
        # a request's end publishes its answer's blocks at once: a next turn may follow right away
        self.loop.on_outputs.append(self._publish_on_finish)

    def _publish_on_finish(self, outs: list[RequestOutput]) -> None:
        if any(o.finished for o in outs):
            self.publish_soon()

    def start_decode(self, *args: Any, **kwargs: Any) -> None:
        with self.serving():
            super().start_decode(*args, **kwargs)

    def write_back(self, request_id: str, token_ids: list[int], target: Any) -> WriteBackResult | None:
        """DecodeWorker.send_write_back to `target`, a prefill actor. Best effort, after a turn: a
        failure is logged, never raised (the next turn then prefills the answer again)."""

        def reserve(tokens: list[int]) -> WriteBackTicket | None:
            ticket: WriteBackTicket | None = ray.get(
                target.reserve_write_back.remote(request_id, tokens), timeout=WRITE_BACK_CALL_S
            )
            return ticket

        def adopt(tokens: list[int]) -> None:
            ray.get(target.adopt_write_back.remote(request_id, tokens), timeout=WRITE_BACK_CALL_S)

        try:
            with self.serving():
                return self.send_write_back(request_id, token_ids, reserve, adopt)
        except Exception as e:
            log.warning("write-back %s failed: %s: %s", request_id, type(e).__name__, e)
            return None

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


def _bind_host() -> str:
    """The KV endpoint other nodes dial; loopback unless the deployment names this node's address."""
    return os.environ.get("TANDEM_BIND_HOST", "127.0.0.1")


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
