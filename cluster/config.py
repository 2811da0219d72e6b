"""What a cluster is asked to be: its pools, engine, transport, waits, and the workers' environment."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from cluster.liveness import Waits
from engine.config import EngineConfig
from engine.roles import Role
from kv_transfer.security import KVTLSConfig

log = logging.getLogger(__name__)


@dataclass
class ClusterConfig:
    model_path: str = ""
    namespace: str = "default"
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    engine: EngineConfig = field(default_factory=lambda: EngineConfig(num_blocks=512))
    transport: str = "grpc"  # how prefill workers ship KV: grpc (any hosts), shm (same host), auto (by placement)
    kv_tls: KVTLSConfig | None = None  # TLS on the KV channel between prefill and decode workers
    waits: Waits = field(default_factory=Waits)
    max_migrations: int = 2  # mid-stream replays of one request on another pair
    write_back: bool = False  # after a P/D turn, copy the answer's KV to the prefill worker (cluster.handoff)
    # whether stopping this router leaves the pools (pool manager, workers, their Redis state) to
    # the cluster and its other routers: None = when it shares them (joined Ray, a Redis not its own)
    keep_pools: bool | None = None
    # the worker processes' environment on top of Ray's: by default the OTEL_* variables of the
    # process that connects, so that workers export their spans where the router does
    worker_env: dict[str, str] = field(default_factory=lambda: otel_env(os.environ))

    def __post_init__(self) -> None:
        for role in ("prefill", "decode", "colocated"):
            n = getattr(self, role)
            if not isinstance(n, int) or n < 0:
                raise ValueError(f"{role} must be a number of workers >= 0, got {n!r}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")


def bind_host() -> str:
    """The address this node's endpoints (decode workers' KV servers, the router's feed
    listener) bind and advertise: loopback unless the deployment names this node's address."""
    return os.environ.get("TANDEM_BIND_HOST", "127.0.0.1")


def otel_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The OpenTelemetry SDK's variables in `environ` (OTEL_EXPORTER_OTLP_ENDPOINT, ...), but the
    service name: workers name themselves."""
    return {k: v for k, v in environ.items() if k.startswith("OTEL_") and k != "OTEL_SERVICE_NAME"}


WORKER_NICENESS = "RAY_worker_niceness"  # read by the raylet when it starts


def ray_env() -> None:
    """What Ray needs set on this machine before it starts (or joins)."""
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # A Ray started here prestarts no idle Python worker for this driver: every actor gets a
    # process of its own (the workers' runtime env differs), so it sat idle at ~1% of a core,
    # on the cores the engine uses. Startup is no slower (measured: ready in 11.3 s vs 12.0 s).
    os.environ.setdefault("RAY_prestart_worker_first_driver", "0")
    # Ray starts its workers at nice 15, so that its own daemons stay responsive under them; but
    # here the workers are the engines. At nice 15 any busy nice-0 process on the host (another
    # tenant, a backup, the router itself) takes ~97% of a contended core from them.
    os.environ.setdefault(WORKER_NICENESS, "0")


def start_ray(init: Callable[..., Any], shutdown: Callable[[], None], **kwargs: Any) -> None:
    """`init(**kwargs)` (ray.init) for a Ray of this process's own, once more after a start whose
    GCS did not write its port within Ray's own wait (30 s): a clean-clone CI run met that once
    in ~10, at a module's cluster start right after another's had stopped, and all 9 tests of the
    module errored. Another failure, or the same one twice, is raised."""
    try:
        init(**kwargs)
    except RuntimeError as e:
        if "Timed out waiting for file" not in str(e):
            raise
        log.warning("Ray did not start (%s); starting it once more", e)
        shutdown()
        init(**kwargs)


def role_config(base: EngineConfig, role: Role) -> EngineConfig:
    """`base` for a worker of `role`."""
    return replace(base, role=role)
