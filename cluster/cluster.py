"""Cluster: connect to (or start) Ray, Redis and the pool manager; scale, drain, status, generate.

Cluster.connect()            local Ray + embedded redis-server + 1 prefill + 1 decode worker
cluster.generate(ids, p)     prefill -> KV transfer -> decode, as a stream of outputs
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from cluster.inventory import node_resources
from cluster.redis_server import EmbeddedRedis
from cluster.routing import WorkerView, pick_decode, pick_prefill
from cluster.state import ClusterState
from engine.config import EngineConfig
from engine.errors import EngineError
from engine.kv_cache import prefix_hashes
from engine.sampling_params import SamplingParams

MANAGER = "tandem-pool-manager"


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
        self._own_ray = own_ray
        self.manager = ray.get_actor(MANAGER, namespace=f"tandem-{config.namespace}")

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
        ).remote(url, config.namespace, config.model_path, configs)
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
        return dict(ray.get(self.manager.handles.remote(), timeout=10))

    def check_integrity(self) -> None:
        ray.get([h.check_integrity.remote() for h in self.handles().values()], timeout=30)

    # ---- the request path -----------------------------------------------------------------------

    def generate(
        self, prompt_ids: Sequence[int], params: SamplingParams, request_id: str | None = None
    ) -> Iterator[dict[str, Any]]:
        """Prefill on a prefill worker, stream KV to a decode worker, yield its outputs.

        Each output: token_ids, text, finished, finish_reason, ... The first one also has
        "timing" (queue / prefill / transfer) and "transfer" (bytes, seconds, GB/s).
        Raises NoWorkerError, WorkerDiedError, KVTransferError, InvalidRequestError."""
        rid = request_id or uuid.uuid4().hex
        prompt = list(prompt_ids)
        handles = self.handles()
        views = [WorkerView.of(wid, info) for wid, info in self.state.workers().items() if wid in handles]
        bs = self.config.engine.block_size
        decode_id = pick_decode(views, -(-(len(prompt) + params.max_tokens) // bs))
        if decode_id is None:
            raise NoWorkerError("no decode worker is up with room for this request")
        decode = handles[decode_id]
        hashes = prefix_hashes(prompt, bs)
        prefill_ids = [v.worker_id for v in views if v.role == "prefill"]
        cached = self.state.longest_prefix(hashes, prefill_ids) if hashes and prefill_ids else {}
        prefill_id = pick_prefill(views, cached)
        if prefill_id is None:
            raise NoWorkerError("no prefill worker is up")
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
        if first["finish_reason"] is not None:  # ended at its first token (EOS, max_tokens=1)
            decode.release.remote(rid)
            yield {
                "token_ids": [first["first_token"]],
                "text": "",
                "finished": True,
                "finish_reason": first["finish_reason"],
                **meta,
            }
            return
        gen = decode.generate.options(num_returns="streaming").remote(
            rid, prompt, first["first_token"], params, self.config.transfer_timeout_s
        )
        try:
            for i, ref in enumerate(gen):
                out = dict(ray.get(ref, timeout=60))
                if i == 0:
                    out.update(meta)
                yield out
        except ray.exceptions.RayActorError as e:
            raise WorkerDiedError(f"decode worker {decode_id} died mid-stream") from e
        except ray.exceptions.RayTaskError as e:
            raise e.as_instanceof_cause() from None  # type: ignore[no-untyped-call]
        finally:
            decode.abort.remote(rid)

    def shutdown(self, kill_manager: bool = True) -> None:
        if kill_manager:
            try:
                ray.get(self.manager.shutdown.remote(), timeout=30)
                ray.kill(self.manager)
            except Exception:
                pass
            self.state.flush_namespace()
        self.state.close()
        if self._redis is not None:
            self._redis.stop()
        if self._own_ray:
            ray.shutdown()


def _role_config(base: EngineConfig, role: str) -> EngineConfig:
    from dataclasses import replace

    return replace(base, role={"prefill": "prefill", "decode": "decode"}.get(role, "both"))  # type: ignore[arg-type]
