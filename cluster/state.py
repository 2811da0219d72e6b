"""The cluster's shared state in Redis: worker registry, desired pool sizes, prefix-block index, events.

Every key lives under `tandem:{namespace}:`, so several clusters can share one Redis:

    tandem:{ns}:worker:{id}     hash   worker info, one JSON value per field; PEXPIRE = heartbeat TTL
    tandem:{ns}:workers         set    ids ever registered (expired ones are pruned lazily by `workers()`)
    tandem:{ns}:desired         hash   role -> desired replica count
    tandem:{ns}:blocks:{id}     set    KV block hashes (decimal strings) held by worker `id`
    tandem:{ns}:block_workers   set    ids that have published blocks
    tandem:{ns}:events          stream capped at ~10,000 entries
    tandem:{ns}:autoscale:*     the routers' autoscalers (cluster/autoscale_store.py)

Redis is run without persistence by default, so after a Redis restart the state is
empty: a worker whose `heartbeat()` returns False must `register_worker()` again and
re-publish its blocks. The client reconnects by itself with exponential backoff.

Every method but `ping()` raises StateUnavailable when Redis cannot be reached or does not
answer in time, so a caller handles one exception (the router answers 503 with it). The
prefix-block index is cluster/prefix_index.py, the autoscalers' lease and windows
cluster/autoscale_store.py, the client and its errors cluster/state_store.py.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from typing import Any, cast

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from cluster.autoscale_store import AutoscaleStore
from cluster.prefix_index import PrefixIndex
from cluster.state_store import StateUnavailable, unavailable_as_state_error
from engine.roles import ROLES

__all__ = ["ClusterState", "StateUnavailable"]

EVENTS_MAXLEN = 10_000
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.-]+$")

# KEYS[1] = worker hash; ARGV = ttl_ms, field1, value1, ...  -> 1 if the worker was alive, else 0.
_HEARTBEAT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
for i = 2, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return 1
"""

# KEYS = workers set, block_workers set, then (worker hash, blocks set) per id; ARGV = ids.
# Atomic, so a worker that re-registers while it is being pruned is left alone.
_PRUNE_LUA = """
local pruned = 0
for i = 1, #ARGV do
    if redis.call('EXISTS', KEYS[1 + 2 * i]) == 0 then
        redis.call('SREM', KEYS[1], ARGV[i])
        redis.call('SREM', KEYS[2], ARGV[i])
        redis.call('DEL', KEYS[2 + 2 * i])
        pruned = pruned + 1
    end
end
return pruned
"""


def _ttl_ms(ttl_s: float) -> int:
    if not ttl_s > 0:
        raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
    return max(1, round(ttl_s * 1000))


def _encode_info(info: dict[str, Any]) -> dict[Any, str]:
    return {str(k): json.dumps(v) for k, v in info.items()}


def _encode_field(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


class ClusterState(PrefixIndex, AutoscaleStore):
    """Client for one namespace of cluster state. Thread-safe (redis-py's connection pool).

    Raises ValueError for a namespace that is empty or has characters outside
    `[A-Za-z0-9_.-]` (a ':' or a glob character would let one namespace see another's keys).
    Connection and timeout errors that outlast the retries raise StateUnavailable (other
    `redis.RedisError`s propagate as they are), except from `ping()`.

    The defaults ride out a Redis restart (each call may take ~4 s while Redis is away). A
    caller that must not wait, the request path or a heartbeat, passes a short
    `socket_timeout_s` (e.g. 0.25) and `retries=0`: then a call fails within about
    `socket_timeout_s` instead.
    """

    def __init__(
        self,
        url: str,
        namespace: str = "default",
        *,
        socket_timeout_s: float = 5.0,
        retries: int = 6,
        default_ttl_s: float = 10.0,
    ) -> None:
        if not _NAMESPACE_RE.match(namespace):
            raise ValueError(f"namespace must match {_NAMESPACE_RE.pattern}, got {namespace!r}")
        self.namespace = namespace
        self.default_ttl_s = default_ttl_s
        self._prefix = f"tandem:{namespace}:"
        self._r: redis.Redis = redis.Redis.from_url(
            url,
            decode_responses=True,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            health_check_interval=30,
            retry_on_timeout=True,
            # Waits 0.1, 0.2, 0.4, 0.8, 1, 1 s between tries: ~3.5 s rides out a Redis restart.
            retry=Retry(ExponentialBackoff(cap=1.0, base=0.05), retries),
            retry_on_error=[redis.ConnectionError, redis.TimeoutError],
        )
        kwargs = self._r.connection_pool.connection_kwargs
        self.address = f"{kwargs.get('host', '?')}:{kwargs.get('port', '?')}"
        self._heartbeat = self._r.register_script(_HEARTBEAT_LUA)
        self._prune = self._r.register_script(_PRUNE_LUA)

    # ---- worker registry -------------------------------------------------

    @unavailable_as_state_error
    def register_worker(self, worker_id: str, info: dict[str, Any], ttl_s: float | None = None) -> None:
        """(Re)create the worker's entry with exactly `info` (JSON-serialisable values) plus `last_seen`.

        The entry disappears unless `heartbeat()` is called within `ttl_s` (default `default_ttl_s`).
        """
        if not worker_id:
            raise ValueError("worker_id must be non-empty")
        ttl_ms = _ttl_ms(ttl_s if ttl_s is not None else self.default_ttl_s)
        key = self.key("worker", worker_id)
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(key)
        pipe.hset(key, mapping=_encode_info({**info, "last_seen": time.time()}))
        pipe.pexpire(key, ttl_ms)
        pipe.sadd(self.key("workers"), worker_id)
        pipe.execute()

    @unavailable_as_state_error
    def heartbeat(self, worker_id: str, info: dict[str, Any] | None = None, ttl_s: float | None = None) -> bool:
        """Extend the worker's TTL and merge `info` into its entry, atomically.

        Returns False, changing nothing, when the entry is gone (TTL expired, deregistered,
        or Redis restarted): the worker must then call `register_worker()` again.
        """
        ttl_ms = _ttl_ms(ttl_s if ttl_s is not None else self.default_ttl_s)
        fields = _encode_info({**(info or {}), "last_seen": time.time()})
        argv: list[str | int] = [ttl_ms]
        for field, value in fields.items():
            argv += [field, value]
        return bool(self._heartbeat(keys=[self.key("worker", worker_id)], args=argv))

    @unavailable_as_state_error
    def workers(self, role: str | None = None) -> dict[str, dict[str, Any]]:
        """Live workers (TTL not expired), optionally only those whose info has `role`.

        Prunes expired ids from the registry and drops their prefix-block index.
        """
        ids = sorted(cast(set[str], self._r.smembers(self.key("workers"))))
        if not ids:
            return {}
        pipe = self._r.pipeline(transaction=False)
        for worker_id in ids:
            pipe.hgetall(self.key("worker", worker_id))
        raw = cast(list[dict[str, str]], pipe.execute())
        live: dict[str, dict[str, Any]] = {}
        dead: list[str] = []
        for worker_id, fields in zip(ids, raw, strict=True):
            if not fields:
                dead.append(worker_id)
                continue
            info = {k: json.loads(v) for k, v in fields.items()}
            if role is None or info.get("role") == role:
                live[worker_id] = info
        if dead:
            keys = [self.key("workers"), self.key("block_workers")]
            for worker_id in dead:
                keys += [self.key("worker", worker_id), self.key("blocks", worker_id)]
            self._prune(keys=keys, args=dead)
        return live

    @unavailable_as_state_error
    def deregister_worker(self, worker_id: str) -> None:
        """Remove the worker's entry and its prefix-block index. Idempotent."""
        pipe = self._r.pipeline(transaction=True)
        pipe.delete(self.key("worker", worker_id), self.key("blocks", worker_id))
        pipe.srem(self.key("workers"), worker_id)
        pipe.srem(self.key("block_workers"), worker_id)
        pipe.execute()

    # ---- desired pool sizes ----------------------------------------------

    @unavailable_as_state_error
    def set_desired(self, role: str | Mapping[str, int], replicas: int = 0) -> None:
        """Set the desired replica count of a pool, or of several in one write ({role: replicas}).
        Raises ValueError for an unknown role or replicas < 0."""
        sizes = dict(role) if isinstance(role, Mapping) else {role: replicas}
        for r, n in sizes.items():
            if r not in ROLES:
                raise ValueError(f"role must be one of {sorted(ROLES)}, got {r!r}")
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise ValueError(f"replicas must be an int >= 0, got {n!r}")
        self._r.hset(self.key("desired"), mapping=cast(dict[Any, Any], sizes))

    @unavailable_as_state_error
    def desired(self) -> dict[str, int]:
        """Desired replicas per role; roles never set are absent."""
        raw = cast(dict[str, str], self._r.hgetall(self.key("desired")))
        return {role: int(n) for role, n in raw.items()}

    # ---- events ----------------------------------------------------------

    @unavailable_as_state_error
    def emit(self, /, kind: str, **fields: Any) -> str:
        """Append an event (`kind`, `ts`, and `fields`; non-str values JSON-encoded); returns its stream id.

        The stream keeps about the last 10,000 events. A retry after a lost reply can
        append an event twice: readers should treat events as at-least-once.
        """
        entry = {"kind": kind, "ts": repr(time.time()), **{k: _encode_field(v) for k, v in fields.items()}}
        event_id = self._r.xadd(self.key("events"), entry, maxlen=EVENTS_MAXLEN, approximate=True)  # type: ignore[arg-type]
        return cast(str, event_id)

    @unavailable_as_state_error
    def events(self, since: str = "0-0", count: int = 100) -> list[tuple[str, dict[str, str]]]:
        """Up to `count` events strictly after stream id `since` (""; the newest), oldest first."""
        Entries = list[tuple[str, dict[str, str]]]
        if not since:
            entries = cast(Entries, self._r.xrevrange(self.key("events"), count=count))[::-1]
        else:  # "(" makes the range exclusive (Redis >= 6.2, which SMISMEMBER needs anyway)
            entries = cast(Entries, self._r.xrange(self.key("events"), min=f"({since}", max="+", count=count))
        return [(event_id, dict(fields)) for event_id, fields in entries]

    # ---- housekeeping ----------------------------------------------------

    def ping(self) -> bool:
        """True if Redis answers (after the client's retries), never raises."""
        try:
            return bool(self._r.ping())
        except redis.RedisError:
            return False

    @unavailable_as_state_error
    def flush_namespace(self) -> int:
        """Delete every key of this namespace (and no other); returns how many were deleted."""
        deleted = 0
        batch: list[str] = []
        for key in self._r.scan_iter(match=self._prefix + "*", count=500):
            batch.append(key)
            if len(batch) >= 500:
                deleted += self._r.unlink(*batch)
                batch.clear()
        if batch:
            deleted += self._r.unlink(*batch)
        return deleted

    def close(self) -> None:
        self._r.close()

    def __enter__(self) -> ClusterState:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
