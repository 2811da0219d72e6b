"""Run a real cluster and the router in this process, for the benchmarks and their tests.

    with running_cluster(ClusterConfig(...)) as cluster, serving(cluster) as url:
        ...  # an OpenAI-compatible endpoint at url, uvicorn on a thread, the cluster on Ray

The router is imported lazily (`router.app.create_app(backend, settings)`), so the benchmarks
that do not need it, and this module's importers, work before it exists.
"""

from __future__ import annotations

import contextlib
import importlib
import itertools
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any

from cluster.cluster import Cluster, ClusterConfig


class RouterUnavailableError(RuntimeError):
    """router.app.create_app is not there (yet)."""


def create_app_fn() -> Callable[..., Any]:
    """`router.app.create_app`. Raises RouterUnavailableError with what is missing."""
    try:
        module = importlib.import_module("router.app")
    except ImportError as e:
        raise RouterUnavailableError(
            f"the OpenAI router is not available: `import router.app` failed ({e}). "
            "This benchmark serves the cluster through router.app.create_app; run it once the router has landed."
        ) from None
    fn = getattr(module, "create_app", None)
    if not callable(fn):
        raise RouterUnavailableError("router.app has no create_app(backend, settings)")
    return fn  # type: ignore[no-any-return]


def exit_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, a CI runner) unwind like Ctrl-C, so that `running_cluster` shuts
    the cluster down instead of leaving Ray workers and a detached pool manager behind."""
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(128 + signal.SIGTERM))


def ready_to_serve(prog: str) -> bool:
    """A served benchmark's start: False (with a line on stderr) when the router cannot be
    built; otherwise SIGTERM now unwinds like Ctrl-C (`exit_on_sigterm`)."""
    try:
        create_app_fn()
    except RouterUnavailableError as e:
        print(f"{prog}: {e}", file=sys.stderr)
        return False
    exit_on_sigterm()
    return True


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def uvicorn_thread(app: Any, timeout_s: float = 30.0) -> Iterator[str]:
    """Serve an ASGI app on a free 127.0.0.1 port from a daemon thread; yields its base URL."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", access_log=False, lifespan="auto")
    )
    thread = threading.Thread(target=server.run, name=f"uvicorn-{port}", daemon=True)
    thread.start()
    end = time.monotonic() + timeout_s
    while not server.started:
        if not thread.is_alive() or time.monotonic() > end:
            server.should_exit = True
            raise RuntimeError(f"uvicorn did not start on 127.0.0.1:{port}")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout_s)


@contextlib.contextmanager
def running_cluster(config: ClusterConfig, timeout_s: float = 300.0) -> Iterator[Cluster]:
    """Cluster.connect, wait until every desired worker is up, shut down at the end."""
    cluster = Cluster.connect(config)
    try:
        cluster.wait_ready(timeout_s)
        yield cluster
    finally:
        cluster.shutdown()


def wait_pools(cluster: Cluster, timeout_s: float = 300.0, **sizes: int) -> None:
    """Scale the given pools and wait until exactly that many of each are up. Raises TimeoutError."""
    for role, n in sizes.items():
        cluster.scale(role, n)
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        ws = cluster.workers()
        up = {r: sum(1 for w in ws if w["role"] == r and w["state"] == "up" and "free_blocks" in w) for r in sizes}
        if up == sizes:
            return
        time.sleep(0.25)
    raise TimeoutError(f"pools not at {sizes} after {timeout_s:.0f} s: {cluster.status()}")


class RoundRobinPrefill:
    """A router Backend that sends prefills to the prefill workers in turn, ignoring the prefix
    index: the baseline cache-aware routing is measured against. Decode placement, colocated
    routes and everything else are the wrapped backend's."""

    def __init__(self, inner: Any, cluster: Cluster) -> None:
        self._inner = inner
        self._cluster = cluster
        self._next = itertools.count()
        self._lock = threading.Lock()

    def route(self, prompt_ids: Sequence[int], params: Any, exclude: frozenset[str]) -> Any:
        route = self._inner.route(prompt_ids, params, exclude)
        if route.prefill is None:
            return route
        workers = self._cluster.state.workers()
        ids = sorted(
            w
            for w, info in workers.items()
            if info.get("role") == "prefill" and not info.get("draining") and w not in exclude
        )
        if not ids:
            return route
        with self._lock:
            i = next(self._next)
        return replace(route, prefill=ids[i % len(ids)], cached_tokens=0)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def serving(cluster: Cluster, round_robin: bool = False, **settings: Any) -> Iterator[str]:
    """The router over `cluster` (ClusterBackend; with `round_robin`, wrapped in RoundRobinPrefill),
    served by uvicorn on a thread. `settings` override RouterSettings fields. Yields the base URL.
    Raises RouterUnavailableError before starting anything when the router is not there."""
    create_app = create_app_fn()
    router_settings = importlib.import_module("router.settings").RouterSettings(**settings)
    backend: Any = importlib.import_module("router.backend").ClusterBackend(cluster, router_settings.routing_policy)
    if round_robin:
        backend = RoundRobinPrefill(backend, cluster)
    with uvicorn_thread(create_app(backend, router_settings)) as url:
        yield url


def unique_namespace(prefix: str) -> str:
    """A fresh cluster namespace: a leftover detached pool manager from a killed run is not reused."""
    return f"{prefix}-{int(time.time() * 1000) % 10**9}"
