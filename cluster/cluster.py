"""Cluster: connect to (or start) Ray, Redis and the pool manager; scale, drain, status, generate.

Cluster.connect()            local Ray + embedded redis-server + 1 prefill + 1 decode worker
                             (or the pools already running in its namespace: another router's)
cluster.route(ids, p)        where a request would run (cluster.placer: the view and the ledger)
cluster.generate(ids, p)     prefill -> KV transfer -> decode (or the whole request on one worker:
                             a local or colocated route), as a RequestRun of outputs
                             (cluster.handoff owns one attempt; cluster.request_run the failover)
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import uuid
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, cast

import ray

from cluster import manager_link, readiness
from cluster.config import ClusterConfig, ray_env, start_ray
from cluster.feeds import Feeds
from cluster.handoff import Attempt, Seam
from cluster.inflight import InflightLedger
from cluster.inventory import node_resources
from cluster.placer import NoRoomError, NoWorkerError, Placer
from cluster.redis_server import EmbeddedRedis
from cluster.request_run import RequestRun, WorkerDiedError
from cluster.routing import Route, RoutingPolicy
from cluster.shutdown import Outcome, Step, run_steps
from cluster.state import ClusterState
from cluster.view import ViewRefresher
from cluster.worker_actors import kill_workers
from engine.core_ledger import ledger_path
from engine.sampling_params import SamplingParams
from kv_transfer import shm_files

if TYPE_CHECKING:
    from cluster.manager_link import ManagerStatus

log = logging.getLogger(__name__)

__all__ = ["Cluster", "ClusterConfig", "NoRoomError", "NoWorkerError", "WorkerDiedError"]


class Cluster:
    def __init__(
        self,
        config: ClusterConfig,
        state_url: str,
        redis: EmbeddedRedis | None,
        own_ray: bool,
        joined_ray: bool,
        manager: Any,
        joined_pools: bool,
    ) -> None:
        self.config = config
        self.state_url = state_url
        self.state = ClusterState(state_url, config.namespace)
        # the request path's own client: it answers in a quarter second or not at all
        self._fast_state = ClusterState(state_url, config.namespace, socket_timeout_s=0.25, retries=0)
        self._redis = redis
        self.owns_ray = own_ray  # this Cluster called ray.init (and disconnects at shutdown)
        self.joined_ray = joined_ray  # to a Ray cluster that was there before (RAY_ADDRESS)
        self.joined_pools = joined_pools  # running before it: another router's, or this one's before a restart
        # on a shared cluster the pools outlive any one router; a Redis of its own never outlives it
        self.keeps_pools = (joined_ray if config.keep_pools is None else config.keep_pools) and redis is None
        self.manager = manager
        self.ledger = InflightLedger()
        self.feeds = Feeds()
        # workers that left stop counting in the ledger (their streams fail over on their own)
        self.view = ViewRefresher(
            self._fast_state.workers, self._manager_handles, on_refresh=lambda v: self.ledger.reconcile(v.handles)
        ).start()
        self.placer = Placer(self.view, self.ledger, self._fast_state, config.engine.block_size)

    @classmethod
    def connect(
        cls,
        config: ClusterConfig | None = None,
        on_ray_started: Callable[[], None] | None = None,
        redis_url: str = "",
    ) -> Cluster:
        """Join RAY_ADDRESS / REDIS_URL (or `redis_url`) when set; otherwise start local Ray and an
        embedded Redis. Pools already running in the namespace are joined as they are
        (`joined_pools`): the sizes in Redis stand, and their engine and transport replace the
        config's. Raises CannotJoinError if pools run in the namespace and no Redis URL is
        given (before starting a Redis), or they run another model. `on_ray_started` runs on this thread
        right after ray.init: its core worker has just put in C-level signal handlers of its own
        (SIGTERM: log a stack, abort)."""
        from engine.model_files import default_model_path

        config = config or ClusterConfig()
        if not config.model_path:
            config.model_path = str(default_model_path())
        ray_env()
        own_ray = not ray.is_initialized()
        joined_ray = bool(os.environ.get("RAY_ADDRESS"))
        if own_ray:
            if joined_ray:
                ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
            else:
                start_ray(ray.init, ray.shutdown, resources=node_resources(), include_dashboard=False,
                          log_to_driver=False)  # fmt: skip
            if on_ray_started is not None:
                on_ray_started()
        redis = None
        url = redis_url or os.environ.get("REDIS_URL", "")
        manager_link.check_joinable(config.namespace, shared_state=bool(url))
        if not url:
            redis = EmbeddedRedis().start()
            url = redis.url
        manager, joined_pools = manager_link.start_or_join(config, url)
        if joined_pools:  # serve as the pools run: their engine's limits and block size
            config = manager_link.joined_config(config, manager)
        c = cls(config, url, redis, own_ray, joined_ray, manager, joined_pools)
        if not joined_pools:
            shm_files.sweep()  # what a killed `tandem serve` left in this host's memory (up to 2 GiB a cache)
            for role in ("prefill", "decode", "colocated"):
                c.scale(role, getattr(config, role))
        return c

    # ---- operations ---------------------------------------------------------------------------

    def scale(self, role: str, replicas: int) -> None:
        self.resize({role: replicas})

    def resize(self, sizes: Mapping[str, int]) -> None:
        """Pools' desired sizes in one write: the pool manager sees a rebalance whole (and flips)."""
        self.state.set_desired(sizes)
        for role, replicas in sizes.items():
            self.state.emit("scaled", role=role, replicas=replicas)

    def drain(self, worker_id: str) -> bool:
        done = bool(ray.get(self.manager.drain.remote(worker_id), timeout=10))
        self.view.refresh()  # routing stops at once, not at the worker's next heartbeat
        return done

    def flip(self, worker_id: str, role: str) -> bool:
        """PoolManager.flip: it waits out the round in progress (about a second)."""
        done = bool(ray.get(self.manager.flip.remote(worker_id, role), timeout=30))
        self.view.refresh()
        return done

    def workers(self) -> list[dict[str, Any]]:
        """The pool manager's view merged with each worker's last heartbeat."""
        live = self.state.workers()
        out: list[dict[str, Any]] = []
        snapshot: list[dict[str, Any]] = ray.get(self.manager.snapshot.remote(), timeout=10)
        for w in snapshot:
            out.append({**live.get(w["worker_id"], {}), **w})
        self.view.refresh()  # what an operator was just shown, routing uses from now on
        return out

    def status(self) -> dict[str, Any]:
        """Desired sizes, the workers, and the roles whose workers died before they answered
        (why, how many in a row; [] while the pool manager does not answer within a second)."""
        manager = self.manager_status(timeout_s=1.0)
        failures = [
            {"role": f.role, "count": f.count, "reason": f.reason} for f in (manager.start_failures if manager else ())
        ]
        return {"desired": self.state.desired(), "workers": self.workers(), "start_failures": failures}

    def manager_status(self, timeout_s: float = 5.0) -> ManagerStatus | None:
        """The pool manager's own status; None while it does not answer (dead, or restarting)."""
        try:
            status: object = ray.get(self.manager.status.remote(), timeout=timeout_s)
        except Exception:
            return None
        return cast("ManagerStatus", status)

    def wait_ready(self, timeout: float = 180.0, stop: threading.Event | None = None) -> bool:
        """Block until every desired worker is up and registered (True), or `stop` is set
        (False). Raises WorkersCannotStart where they never can (cluster/readiness.py),
        TimeoutError after `timeout`."""
        return readiness.wait_ready(self, timeout, stop)

    @property
    def embedded_redis(self) -> EmbeddedRedis | None:
        """The redis-server this Cluster started (None when it joined one at REDIS_URL)."""
        return self._redis

    def _manager_handles(self) -> dict[str, Any]:
        return dict(ray.get(self.manager.handles.remote(), timeout=2.0))

    def handles(self) -> dict[str, Any]:
        """Actor handles of the workers that are up, as of the last refresh (a fresh one now)."""
        return dict(self.view.refresh().handles)

    def check_integrity(self) -> None:
        ray.get([h.check_integrity.remote() for h in self.handles().values()], timeout=30)
        self.ledger.check_integrity()
        self.feeds.check_integrity()

    # ---- the request path: reads the view and the ledger, never waits on Redis ---------------

    def route(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        exclude: frozenset[str] = frozenset(),
        policy: RoutingPolicy | None = None,
    ) -> Route:
        """Where a request would run now (see cluster.placer). Raises NoWorkerError."""
        return self.placer.route(prompt_ids, params, exclude, policy)

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        route: Route | None = None,
        traceparent: str | None = None,
    ) -> RequestRun:
        """Prefill on a prefill worker, stream KV to a decode worker, and its outputs (or, for a
        route without prefill, the whole request on a colocated worker, or on a decode worker that
        holds its prefix for a local route), as StreamOutputs.

        The first output carries a Placement (workers, cached prefix, queue / prefill / transfer
        times, bytes moved); the finished one the number of migrations. A dead or
        frozen decode worker after the first token moves the request to another pair (see
        cluster.request_run). `route` defaults to `self.route(...)`. Iterating raises
        WorkerDiedError, InvalidRequestError; route() NoWorkerError. `cancel()` from any thread.
        `traceparent` goes to every worker call, for the workers' spans (engine/spans.py)."""
        rid = request_id or uuid.uuid4().hex
        prompt = list(prompt_ids)
        route = route or self.route(prompt, params)
        attempt = functools.partial(self._attempt, traceparent=traceparent)
        return RequestRun(rid, prompt, params, route, attempt, self.route, self.config.max_migrations)

    def _attempt(
        self,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        route: Route,
        cancel: threading.Event,
        traceparent: str | None = None,
    ) -> Attempt:
        """Start counting one attempt in the ledger; the Attempt takes it back on close()."""
        view = self.view.current()
        blocks, uncached = self.placer.cost(len(prompt), params, route)
        self.ledger.begin(rid, route.decode, route.prefill, blocks, uncached)
        try:
            seam = Seam(self.ledger, self.feeds, self.config.waits, self.config.write_back)
            return Attempt(rid, prompt, params, route, view.handles, seam, cancel, traceparent)
        except BaseException:
            self.ledger.end(rid)
            raise

    def shutdown(self, ray_gone: bool = False, ray_down: Callable[[], bool] = lambda: False) -> Outcome:
        """Stop what this Cluster started: the pool manager and its workers (unless it keeps the
        pools: `keeps_pools`), the embedded Redis, local Ray. Every step is bounded and runs even
        if an earlier one failed (Redis or Ray may already be gone: see cluster.shutdown).
        `ray_gone`: the Ray cluster is known to be gone (a joined one brought down), and with it
        the manager and the workers: no Ray step. `ray_down`: whether Ray is gone now (its GCS
        refuses connections: router.ray_watch), asked before and during each Ray step."""
        steps = [Step("routing view", self.view.stop), Step("token feeds", self.feeds.shutdown)]
        if not self.keeps_pools:
            steps += [
                Step("pool manager", lambda: manager_link.stop(self.manager), 25.0, ray=True),
                Step("pool manager kill", lambda: ray.kill(self.manager), ray=True),
                Step("worker kill", lambda: kill_workers(self.config.namespace), ray=True),  # any the manager left
                Step("namespace flush", lambda: self.state.ping() and self.state.flush_namespace()),
            ]
        steps += [Step("state", self.state.close), Step("fast state", self._fast_state.close)]
        if self._redis is not None:
            steps.append(Step("redis-server", self._redis.stop))
        if self.owns_ray:
            # joined: only this driver leaves; started here: it stops the GCS and the rest
            steps.append(Step("ray", ray.shutdown, ray=True, stops_ray=not self.joined_ray))
        if not self.keeps_pools:
            steps.append(Step("kv caches", shm_files.sweep))  # what this host's killed workers left in /dev/shm
            steps.append(Step("core ledger", lambda: ledger_path(self.config.namespace).unlink(missing_ok=True)))
        return run_steps(steps, ray_gone, ray_down)
