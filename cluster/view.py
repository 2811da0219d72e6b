"""The request path's picture of the cluster: refreshed in the background, read without a lock.

    refresher thread, every interval_s:   registry <- Redis (short timeout, no retries)
                                          handles  <- pool manager (Ray call, bounded)
                                          view = ClusterView(...)    # one reference swap
    request path:                         view.current()             # never waits on either

When Redis or the pool manager does not answer, the last known part is kept: serving goes on
from it (streams in flight, and new requests too) and `state_ok` says the store is away.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

log = logging.getLogger(__name__)

_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True)
class ClusterView:
    """Workers that are up (a handle from the pool manager) with their last heartbeat info."""

    registry: Mapping[str, Mapping[str, Any]] = field(default_factory=lambda: _EMPTY)
    handles: Mapping[str, Any] = field(default_factory=lambda: _EMPTY)
    at: float = 0.0
    state_ok: bool = True

    def live(self) -> dict[str, Mapping[str, Any]]:
        """Heartbeat info of every worker that is both registered and has a handle."""
        return {w: info for w, info in self.registry.items() if w in self.handles}


class ViewRefresher:
    """Keeps a ClusterView fresh on its own thread. `current()` is a plain attribute read."""

    def __init__(
        self,
        read_registry: Callable[[], Mapping[str, Mapping[str, Any]]],
        read_handles: Callable[[], Mapping[str, Any]],
        interval_s: float = 0.25,
        on_refresh: Callable[[ClusterView], object] | None = None,
    ) -> None:
        self._read_registry = read_registry
        self._read_handles = read_handles
        self._on_refresh = on_refresh
        self.interval_s = interval_s
        self._view = ClusterView()
        self._handles_ok = True
        self._refreshing = threading.Lock()  # one refresh at a time; readers never take it
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cluster-view", daemon=True)

    def start(self) -> ViewRefresher:
        self.refresh()
        self._thread.start()
        return self

    def current(self) -> ClusterView:
        return self._view

    def refresh(self) -> ClusterView:
        """Read both sources now (each bounded by its own timeout) and publish the result."""
        with self._refreshing:
            old = self._view
            registry, state_ok = old.registry, True
            try:
                registry = MappingProxyType(dict(self._read_registry()))
            except Exception as e:
                state_ok = False
                if old.state_ok:
                    log.warning("cluster state store unreachable; routing on the last known registry: %s", e)
            handles, handles_ok = old.handles, True
            try:
                handles = MappingProxyType(dict(self._read_handles()))
            except Exception as e:
                handles_ok = False
                if self._handles_ok:
                    log.warning("pool manager did not answer; routing on the last known workers: %s", e)
            self._handles_ok = handles_ok
            self._view = view = ClusterView(registry, handles, time.monotonic(), state_ok)
        if self._on_refresh is not None and handles_ok:
            self._on_refresh(view)
        return view

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.refresh()
