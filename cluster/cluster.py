"""Cluster: connect to (or start) Ray, Redis and the pool manager; scale, drain, status, generate.

Cluster.connect()            local Ray + embedded redis-server + 1 prefill + 1 decode worker
cluster.generate(ids, p)     prefill -> KV transfer -> decode, as a stream of outputs
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.inventory import node_resources
from cluster.redis_server import EmbeddedRedis
from cluster.routing import Route, RoutingPolicy, WorkerView, plan_route
from cluster.state import ClusterState
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.kv_cache import prefix_hashes
from engine.sampling_params import SamplingParams

MANAGER = "tandem-pool-manager"
log = logging.getLogger(__name__)
HANDLES_TTL_S = 1.0


class NoWorkerError(EngineError):
    """No worker of the needed role is up (or none has room)."""


class WorkerDiedError(EngineError):
    """A worker died while serving the request."""


@dataclass
class ClusterConfig:
    model_path: str = ""
    namespace: str = "default"
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_blocks=512))
    transport: str = "grpc"  # how prefill workers ship KV: grpc (any hosts) or shm (same host)
    transfer_timeout_s: float = 15.0


def _ray_env() -> None:
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")


class Cluster:
    def __init__(self, config: ClusterConfig, state_url: str, redis: EmbeddedRedis | None, own_ray: bool) -> None:
        self.config = config
        self.state_url = state_url
        self.state = ClusterState(state_url, config.namespace)
        self._redis = redis
        self.owns_ray = own_ray
        self.manager = ray.get_actor(MANAGER, namespace=f"tandem-{config.namespace}")
        self._handles: dict[str, Any] = {}
        self._handles_at = -HANDLES_TTL_S

    @classmethod
    def connect(cls, config: ClusterConfig | None = None) -> Cluster:
        """Join RAY_ADDRESS / REDIS_URL when set; otherwise start local Ray and an embedded Redis."""
        from engine.model_files import default_model_path

        config = config or ClusterConfig()
        if not config.model_path:
            config.model_path = str(default_model_path())
        _ray_env()
        own_ray = not ray.is_initialized()
        if own_ray:
            if os.environ.get("RAY_ADDRESS"):
                ray.init(address=os.environ["RAY_ADDRESS"], log_to_driver=False)
            else:
                ray.init(resources=node_resources(), include_dashboard=False, log_to_driver=False)
        redis = None
        url = os.environ.get("REDIS_URL", "")
        if not url:
            redis = EmbeddedRedis().start()
            url = redis.url
        ns = f"tandem-{config.namespace}"
        from cluster.pool_manager import PoolManager

        configs = {role: _role_config(config.engine, role) for role in ("prefill", "decode", "colocated")}
        ray.remote(PoolManager).options(  # type: ignore[attr-defined]
            name=MANAGER, namespace=ns, lifetime="detached", get_if_exists=True, num_cpus=0, max_concurrency=8
        ).remote(url, config.namespace, config.model_path, configs, config.transport)
        c = cls(config, url, redis, own_ray)
        for role in ("prefill", "decode", "colocated"):
            c.scale(role, getattr(config, role))
        return c

    # ---- operations ---------------------------------------------------------------------------

    def scale(self, role: str, replicas: int) -> None:
        self.state.set_desired(role, replicas)
        self.state.emit("scaled", role=role, replicas=replicas)

    def drain(self, worker_id: str) -> bool:
        return bool(ray.get(self.manager.drain.remote(worker_id), timeout=10))

    def workers(self) -> list[dict[str, Any]]:
        """The pool manager's view merged with each worker's last heartbeat."""
        live = self.state.workers()
        out: list[dict[str, Any]] = []
        snapshot: list[dict[str, Any]] = ray.get(self.manager.snapshot.remote(), timeout=10)
        for w in snapshot:
            out.append({**live.get(w["worker_id"], {}), **w})
        return out

    def status(self) -> dict[str, Any]:
        return {"desired": self.state.desired(), "workers": self.workers()}

    def wait_ready(self, timeout: float = 180.0) -> None:
        """Block until every desired worker is up and registered. Raises TimeoutError."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            desired = self.state.desired()
            ws = self.workers()
            up = {
                r: sum(1 for w in ws if w["role"] == r and w["state"] == "up" and "free_blocks" in w) for r in desired
            }
            if all(up[r] >= n for r, n in desired.items()) and sum(desired.values()) > 0:
                return
            time.sleep(0.25)
        raise TimeoutError(f"cluster not ready after {timeout:.0f} s: {self.status()}")

    def handles(self) -> dict[str, Any]:
        """Actor handles of the workers that are up, asked of the pool manager now."""
        handles: dict[str, Any] = dict(ray.get(self.manager.handles.remote(), timeout=10))
        self._handles, self._handles_at = handles, time.monotonic()
        return handles

    def _recent_handles(self, need: frozenset[str] = frozenset()) -> dict[str, Any]:
        """handles(), reused for up to HANDLES_TTL_S unless a needed worker is missing: the request
        path must not ask the pool manager (whose health checks hold its lock) on every call."""
        if time.monotonic() - self._handles_at > HANDLES_TTL_S or not need <= self._handles.keys():
            return self.handles()
        return self._handles

    def check_integrity(self) -> None:
        ray.get([h.check_integrity.remote() for h in self.handles().values()], timeout=30)

    # ---- the request path -----------------------------------------------------------------------

    def route(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        exclude: frozenset[str] = frozenset(),
        policy: RoutingPolicy | None = None,
    ) -> Route:
        """Where a request would run now (see cluster.routing.plan_route). Raises NoWorkerError."""
        registered = self.state.workers()
        handles = self._recent_handles(frozenset(registered))  # a new worker forces a refresh
        views = [WorkerView.of(wid, info) for wid, info in registered.items() if wid in handles]
        bs = self.config.engine.block_size
        hashes = prefix_hashes(list(prompt_ids), bs)
        prefill_ids = [v.worker_id for v in views if v.role == "prefill" and v.worker_id not in exclude]
        cached = self.state.longest_prefix(hashes, prefill_ids) if hashes and prefill_ids else {}
        route = plan_route(views, cached, len(prompt_ids), params.max_tokens, bs, policy, exclude)
        if route is None:
            raise NoWorkerError("no prefill + decode pair (or colocated worker) is up with room for this request")
        return route

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        route: Route | None = None,
    ) -> Iterator[dict[str, Any]]:
        """Prefill on a prefill worker, stream KV to a decode worker, yield its outputs
        (or, for a route without prefill, run the whole request on a colocated worker).

        Each output: token_ids, text, finished, finish_reason, ... The first one also has
        "timing" (queue / prefill / transfer), "transfer" (bytes, seconds, GB/s), the workers
        and "cached_tokens". `route` defaults to `self.route(...)`.
        Raises NoWorkerError, WorkerDiedError, KVTransferError, InvalidRequestError."""
        rid = request_id or uuid.uuid4().hex
        prompt = list(prompt_ids)
        route = route or self.route(prompt, params)
        handles = self._recent_handles(route.workers)
        if route.decode not in handles or (route.prefill is not None and route.prefill not in handles):
            raise WorkerDiedError(f"a worker of {sorted(route.workers)} is gone")
        if route.prefill is None:
            yield from self._generate_colocated(handles[route.decode], route.decode, rid, prompt, params)
            return
        decode_id, prefill_id = route.decode, route.prefill
        decode = handles[decode_id]
        try:
            reservation = ray.get(decode.reserve.remote(rid, len(prompt)), timeout=10)
            first = ray.get(handles[prefill_id].prefill.remote(rid, prompt, params, reservation), timeout=120)
        except ray.exceptions.RayActorError as e:
            decode.release.remote(rid)
            raise WorkerDiedError(f"a worker died before the first token: {e}") from e
        except ray.exceptions.RayTaskError as e:
            decode.release.remote(rid)
            raise e.as_instanceof_cause() from None  # type: ignore[no-untyped-call]
        meta = {
            "timing": first["timing"],
            "transfer": first["transfer"],
            "prefill_worker": prefill_id,
            "decode_worker": decode_id,
            "cached_tokens": first["cached_tokens"],
        }
        first_logprobs = first.get("logprobs", [])
        if first["finish_reason"] is not None:  # ended at its first token (EOS, max_tokens=1)
            decode.release.remote(rid)
            yield {
                "token_ids": [first["first_token"]],
                "text": first.get("text", ""),
                "finished": True,
                "finish_reason": first["finish_reason"],
                "num_prompt_tokens": len(prompt),
                "num_output_tokens": 1,
                "logprobs": first_logprobs,
                **meta,
            }
            return
        gen = decode.generate.options(num_returns="streaming").remote(
            rid, prompt, first["first_token"], params, self.config.transfer_timeout_s
        )

        def first_extra(out: dict[str, Any]) -> None:
            out.update(meta)
            # the decode side emits the prefill's first token without its logprob
            out["logprobs"] = [*first_logprobs, *out["logprobs"]][: len(out["token_ids"])]

        yield from _stream(gen, decode, rid, f"decode worker {decode_id} died mid-stream", first_extra)

    def _generate_colocated(
        self, handle: Any, worker_id: str, rid: str, prompt: list[int], params: SamplingParams
    ) -> Iterator[dict[str, Any]]:
        t0 = time.monotonic()
        gen = handle.generate.options(num_returns="streaming").remote(rid, prompt, params)

        def first_extra(out: dict[str, Any]) -> None:
            out["timing"] = {"queue_s": 0.0, "prefill_s": time.monotonic() - t0, "transfer_s": 0.0}
            out["transfer"] = {"bytes": 0, "seconds": 0.0, "gbps": 0.0}
            out.update(prefill_worker=worker_id, decode_worker=worker_id, cached_tokens=0)

        yield from _stream(gen, handle, rid, f"colocated worker {worker_id} died", first_extra)

    def shutdown(self, kill_manager: bool = True) -> None:
        """Stop what this Cluster started: the pool manager and its workers (unless only
        joined), the embedded Redis, local Ray. Every step is bounded and runs even if an
        earlier one failed (Redis or Ray may already be gone on Ctrl-C)."""
        steps: list[Callable[[], object]] = []
        if kill_manager:
            steps += [
                lambda: ray.get(self.manager.shutdown.remote(), timeout=20),
                lambda: ray.kill(self.manager),
                lambda: self.state.ping() and self.state.flush_namespace(),
            ]
        steps.append(self.state.close)
        if self._redis is not None:
            steps.append(self._redis.stop)
        if self.owns_ray:
            steps.append(ray.shutdown)
        for step in steps:
            try:
                step()
            except Exception as e:
                log.warning("shutdown step failed: %s", e)


def _stream(
    gen: Any, worker: Any, rid: str, died: str, first_extra: Callable[[dict[str, Any]], None]
) -> Iterator[dict[str, Any]]:
    """Outputs of a worker's streaming generator, typed errors for a dead worker, and an abort on
    the worker however the stream ends (finished, failed, or the caller stopped reading)."""
    try:
        for i, ref in enumerate(gen):
            out = dict(ray.get(ref, timeout=60))
            if i == 0:
                first_extra(out)
            yield out
    except ray.exceptions.RayActorError as e:
        raise WorkerDiedError(died) from e
    except ray.exceptions.RayTaskError as e:
        raise e.as_instanceof_cause() from None  # type: ignore[no-untyped-call]
    finally:
        worker.abort.remote(rid)


def _role_config(base: EngineConfig, role: str) -> EngineConfig:
    from dataclasses import replace

    return replace(base, role={"prefill": "prefill", "decode": "decode"}.get(role, "both"))  # type: ignore[arg-type]
