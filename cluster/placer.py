"""Placer: where a request runs now, and what it holds there while it runs.

It reads the routing view (cluster.view, refreshed in the background) and the in-flight ledger
(cluster.inflight), and asks Redis's prefix index only through a client that answers in a
quarter second or not at all: the request path never waits on Redis. Planning a route and
holding its cost in the ledger are one step under a lock, so a burst sees each other's picks.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence

from cluster.inflight import InflightLedger, WorkerLoad
from cluster.routing import Route, RoutingPolicy, plan_route, planned_blocks
from cluster.state import ClusterState
from cluster.view import ClusterView, ViewRefresher
from cluster.worker_view import WorkerView
from engine.cache_keys import cache_keys
from engine.errors import EngineError
from engine.kv_cache import prefix_hashes
from engine.sampling_params import SamplingParams


class NoWorkerError(EngineError):
    """No worker of the needed role is up (or none has room)."""


class NoRoomError(NoWorkerError):
    """Workers that could run the request are up, but none has room for it now (their KV blocks
    are held by requests in flight): room comes back as those finish."""


class Placer:
    def __init__(self, view: ViewRefresher, ledger: InflightLedger, index: ClusterState, block_size: int) -> None:
        self._view = view
        self._ledger = ledger
        self._index = index  # the fast client: the prefix index, or nothing cached
        self._block_size = block_size
        self._lock = threading.Lock()

    def route(
        self,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        exclude: frozenset[str] = frozenset(),
        policy: RoutingPolicy | None = None,
    ) -> Route:
        """Where a request would run now (see cluster.routing.plan_route), its cost held in the
        ledger. Raises NoWorkerError."""
        try:
            return self._route(self._view.current(), prompt_ids, params, exclude, policy)
        except NoRoomError:  # room comes back through the ledger and the background refresh
            raise
        except NoWorkerError:  # a worker that just came up may be missing from a view 0.25 s old
            return self._route(self._view.refresh(), prompt_ids, params, exclude, policy)

    def cost(self, prompt_tokens: int, params: SamplingParams, route: Route) -> tuple[int, int]:
        """Blocks a request on `route` holds on its decode worker, tokens it queues for prefill."""
        blocks = planned_blocks(prompt_tokens, params.max_tokens, self._block_size)
        return blocks, max(prompt_tokens - route.cached_tokens, 1)

    def _route(
        self,
        view: ClusterView,
        prompt_ids: Sequence[int],
        params: SamplingParams,
        exclude: frozenset[str],
        policy: RoutingPolicy | None,
    ) -> Route:
        live = view.live()
        # prefill workers for the P/D route, decode workers for the local one (cluster.routing)
        indexed = [w for w, info in live.items() if info.get("role") in ("prefill", "decode") and w not in exclude]
        cached = self._cached_blocks(prompt_ids, params, indexed, view) if indexed else {}
        with self._lock:  # plan and hold as one step, so that a burst sees each other's picks
            loads = self._ledger.loads(live)
            views = [WorkerView.of(wid, info, loads[wid]) for wid, info in live.items()]
            route = plan_route(views, cached, len(prompt_ids), params.max_tokens, self._block_size, policy, exclude)
            if route is None:
                idle = [dataclasses.replace(v, free_blocks=v.num_blocks, load=WorkerLoad()) for v in views]
                if plan_route(idle, cached, len(prompt_ids), params.max_tokens, self._block_size, policy, exclude):
                    raise NoRoomError("every worker that could run this request is full")
                raise NoWorkerError("no prefill + decode pair (or colocated worker) is up with room for this request")
            blocks, uncached = self.cost(len(prompt_ids), params, route)
            self._ledger.hold(route.decode, route.prefill, blocks, uncached)
        return route

    def _cached_blocks(
        self, prompt_ids: Sequence[int], params: SamplingParams, workers: list[str], view: ClusterView
    ) -> dict[str, int]:
        """The prefix index's answer, or nothing cached if Redis does not answer at once."""
        hashes = prefix_hashes(cache_keys(prompt_ids, len(prompt_ids), params), self._block_size)
        if not hashes or not view.state_ok:
            return {}
        try:
            return self._index.longest_prefix(hashes, workers)
        except Exception:
            return {}
