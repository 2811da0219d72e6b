"""The boundary between the router and the cluster: the `Backend` protocol and its real adapter.

Every Backend method blocks (Ray, Redis); the router calls them on worker threads. Unit tests
pass a fake Backend to `create_app`; the service passes `ClusterBackend(Cluster.connect(...))`.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from cluster.outputs import StreamOutput
from cluster.routing import Route, RoutingPolicy
from engine.gguf_file import GGUFFile
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from cluster.cluster import Cluster


@dataclass(frozen=True)
class ModelInfo:
    """The one model a backend serves. max_model_len: prompt + output tokens one request may use."""

    name: str
    tokenizer: Tokenizer
    max_model_len: int
    created: int = 0


class Backend(Protocol):
    """What the router needs of a cluster."""

    model: ModelInfo

    def route(self, prompt_ids: Sequence[int], params: SamplingParams, exclude: frozenset[str]) -> Route:
        """Where the request would run now, avoiding `exclude`. Raises cluster.cluster.NoWorkerError."""
        ...

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        route: Route,
        traceparent: str | None = None,
    ) -> Iterator[StreamOutput]:
        """Run the request on `route`; outputs as `Cluster.generate` yields them (the first with
        its Placement). Closing the iterator aborts the request and frees its KV on every worker it
        touched; an iterator with `cancel()` is cancelled from any thread when its client leaves.
        `traceparent`: the request's root span (router.tracing), for the workers' own spans."""
        ...

    def status(self) -> dict[str, Any]:
        """{"desired": {role: n}, "workers": [{worker_id, role, state, node, running, waiting,
        free_blocks, num_blocks, kv_usage, draining, ...}]}."""
        ...

    def scale(self, sizes: Mapping[str, int]) -> None:
        """Set these pools' desired sizes together (one write: no round sees half of a change)."""
        ...

    def drain(self, worker_id: str) -> bool:
        """Drain one worker; False if no such worker."""
        ...

    def flip(self, worker_id: str, role: str) -> bool:
        """Turn an up prefill or decode worker into `role` in place; False if no such worker is up."""
        ...

    def ready(self) -> bool:
        """True when a request could be served: a prefill and a decode worker up, or a colocated one."""
        ...

    def serving_workers(self) -> int:
        """The workers up that run streams (decode and colocated, not draining): what the
        router's running bound scales with (router/settings.py)."""
        ...

    def emit(self, kind: str, **fields: Any) -> None:
        """Record a cluster event (scaled, autoscale, worker died, ...)."""
        ...

    def events(self, since: str = "0-0", count: int = 100) -> list[tuple[str, dict[str, str]]]:
        """Up to `count` events after the event id `since` ("": the newest), oldest first: (id, {kind, ts, ...})."""
        ...


def is_up(worker: dict[str, Any]) -> bool:
    return worker.get("state") == "up" and "free_blocks" in worker and not worker.get("draining", False)


def ready_from(workers: Sequence[dict[str, Any]]) -> bool:
    roles = {w.get("role") for w in workers if is_up(w)}
    return {"prefill", "decode"} <= roles or "colocated" in roles


def serving_from(workers: Sequence[dict[str, Any]]) -> int:
    return sum(w.get("role") in ("decode", "colocated") for w in workers if is_up(w))


def context_length(path: str | Path) -> int:
    """The checkpoint's trained context (GGUF `{arch}.context_length` or config.json)."""
    path = Path(path)
    if path.is_dir():
        return int(json.loads((path / "config.json").read_text())["max_position_embeddings"])
    fields = GGUFFile(path).fields
    return int(fields[f"{fields['general.architecture']}.context_length"])


def model_name(path: str | Path) -> str:
    """`SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct`; a directory -> its name."""
    path = Path(path)
    return path.name if path.is_dir() else path.name.split(".")[0]


class ClusterBackend:
    """Backend over a live `Cluster`."""

    def __init__(self, cluster: Cluster, policy: RoutingPolicy | None = None, name: str = "") -> None:
        self.cluster = cluster
        self.policy = policy or RoutingPolicy()
        path = cluster.config.model_path
        engine = cluster.config.engine
        # A decode worker must hold prompt + output: its whole cache bounds one request too
        # (a cache sized from memory, num_blocks None, holds at least one full context).
        limit = context_length(path)
        if engine.num_blocks is not None:
            limit = min(limit, engine.num_blocks * engine.block_size)
        if engine.max_model_len:
            limit = min(limit, engine.max_model_len)
        self.model = ModelInfo(name or model_name(path), Tokenizer.load(path), limit, int(time.time()))

    def route(self, prompt_ids: Sequence[int], params: SamplingParams, exclude: frozenset[str]) -> Route:
        return self.cluster.route(prompt_ids, params, exclude, self.policy)

    def generate(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        request_id: str,
        route: Route,
        traceparent: str | None = None,
    ) -> Iterator[StreamOutput]:
        return self.cluster.generate(prompt_ids, params, request_id, route, traceparent)

    def status(self) -> dict[str, Any]:
        return self.cluster.status()

    def scale(self, sizes: Mapping[str, int]) -> None:
        self.cluster.resize(sizes)

    def drain(self, worker_id: str) -> bool:
        return self.cluster.drain(worker_id)

    def flip(self, worker_id: str, role: str) -> bool:
        return self.cluster.flip(worker_id, role)

    def emit(self, kind: str, **fields: Any) -> None:
        self.cluster.state.emit(kind, **fields)

    def events(self, since: str = "0-0", count: int = 100) -> list[tuple[str, dict[str, str]]]:
        return self.cluster.state.events(since, count)

    def ready(self) -> bool:
        """From the request path's view: still true while Redis is away, as serving is."""
        return ready_from(self._live())

    def serving_workers(self) -> int:
        return serving_from(self._live())

    def _live(self) -> list[dict[str, Any]]:
        return [{**info, "state": "up"} for info in self.cluster.view.current().live().values()]
