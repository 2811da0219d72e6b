"""The admin API: pools, scaling, draining, role flips, rebalancing (bearer token; see router.auth).

A scale or rebalance that would take the desired sizes from "can serve" (a prefill and a decode
worker, or a colocated one) to "cannot" is refused with a 400 unless the body says `"force": true`.
Cluster failures answer 503 (the state store's outage with its own message); see router.errors.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from fastapi import APIRouter, Depends
from pydantic import Field

from engine.roles import FLIPPABLE, ROLES
from router.auth import admin_check
from router.backend import Backend
from router.bodies import StrictBody
from router.errors import APIError, admin_error
from router.settings import RouterSettings

T = TypeVar("T")

WORKER_FIELDS = (
    "worker_id", "role", "state", "node", "device", "draining", "running", "waiting", "free_blocks", "num_blocks",
    "kv_usage", "num_preemptions", "reservations",
)  # fmt: skip


class ScaleBody(StrictBody):
    replicas: int = Field(ge=0)
    force: bool = False  # even if it leaves no pool that can serve


class FlipBody(StrictBody):
    role: str
    force: bool = False  # even if it leaves no pool that can serve


class RebalanceBody(StrictBody):
    prefill: int = Field(ge=0)
    decode: int = Field(ge=0)
    force: bool = False


def pools(status: dict[str, Any]) -> dict[str, Any]:
    """The operator's view: desired sizes, per worker its role, node, load, KV usage and state, and
    the roles whose workers keep dying before they start (cluster/start_failures.py), with why."""
    workers = [{k: w.get(k) for k in WORKER_FIELDS} for w in status.get("workers", [])]
    up = {r: sum(1 for w in workers if w["role"] == r and w["state"] == "up") for r in ROLES}
    failures = status.get("start_failures", [])
    return {"desired": status.get("desired", {}), "up": up, "workers": workers, "start_failures": failures}


def can_serve(sizes: Mapping[str, int]) -> bool:
    """P/D needs a prefill and a decode worker; a colocated worker serves alone."""
    return (sizes.get("prefill", 0) > 0 and sizes.get("decode", 0) > 0) or sizes.get("colocated", 0) > 0


_EVENT_ID = re.compile(r"^\d{1,20}-\d{1,20}$")


def build(backend: Backend, settings: RouterSettings) -> APIRouter:
    api = APIRouter(prefix="/admin", dependencies=[Depends(admin_check(settings))])

    async def cluster(call: Callable[..., T], *args: Any) -> T:
        try:
            return await asyncio.to_thread(call, *args)
        except Exception as e:
            raise admin_error(e, settings.retry_after_s) from e

    def check_replicas(role: str, n: int) -> None:
        if role not in ROLES:
            raise APIError(404, f"no pool {role!r}; pools: {', '.join(ROLES)}", param="role", code="unknown_pool")
        if n > settings.max_replicas:
            raise APIError(400, f"replicas must be <= {settings.max_replicas}", param="replicas")

    async def check_still_serves(change: dict[str, int], force: bool, param: str) -> None:
        if force:
            return
        desired: dict[str, int] = dict((await cluster(backend.status)).get("desired", {}))
        after = {**desired, **change}
        if can_serve(desired) and not can_serve(after):
            sizes = ", ".join(f"{r} {after.get(r, 0)}" for r in ROLES)
            message = (
                f"this would leave no pool that can serve requests ({sizes}): P/D needs a prefill and a "
                'decode worker, or a colocated one; send "force": true to do it anyway'
            )
            raise APIError(400, message, param=param, code="would_stop_serving")

    @api.get("/pools")
    async def get_pools() -> dict[str, Any]:
        return pools(await cluster(backend.status))

    @api.post("/pools/{role}")
    async def scale(role: str, body: ScaleBody) -> dict[str, Any]:
        check_replicas(role, body.replicas)
        await check_still_serves({role: body.replicas}, body.force, "replicas")
        await cluster(backend.scale, {role: body.replicas})
        return {"role": role, "replicas": body.replicas}

    @api.post("/workers/{worker_id}/drain")
    async def drain(worker_id: str) -> dict[str, Any]:
        if not await cluster(backend.drain, worker_id):
            raise APIError(404, f"no worker {worker_id!r}", param="worker_id", code="unknown_worker")
        return {"worker_id": worker_id, "state": "draining"}

    @api.post("/workers/{worker_id}/role")
    async def flip(worker_id: str, body: FlipBody) -> dict[str, Any]:
        """Turn a prefill worker into a decode worker or back, in place: it drains, then switches
        role with its weights and cache kept. The pool sizes move with it."""
        if body.role not in FLIPPABLE:
            raise APIError(400, f"a worker flips between {' and '.join(FLIPPABLE)}", param="role", code="bad_role")
        status = await cluster(backend.status)
        w = next((w for w in status.get("workers", []) if w.get("worker_id") == worker_id), None)
        if w is None:
            raise APIError(404, f"no worker {worker_id!r}", param="worker_id", code="unknown_worker")
        if w.get("role") == body.role:
            return {"worker_id": worker_id, "role": body.role, "state": w.get("state")}
        if w.get("role") not in FLIPPABLE or w.get("state") != "up":
            message = (
                f"worker {worker_id!r} is {w.get('role')}, {w.get('state')}: only an up prefill or decode worker flips"
            )
            raise APIError(409, message, param="worker_id", code="cannot_flip")
        desired: dict[str, int] = dict(status.get("desired", {}))
        was = str(w["role"])
        change = {was: max(0, desired.get(was, 0) - 1), body.role: desired.get(body.role, 0) + 1}
        await check_still_serves(change, body.force, "role")
        if not await cluster(backend.flip, worker_id, body.role):
            raise APIError(409, f"worker {worker_id!r} changed meanwhile; look again", code="cannot_flip")
        return {"worker_id": worker_id, "role": body.role, "state": "flipping"}

    @api.get("/events")
    async def events(since: str = "0-0", count: int = 100) -> dict[str, Any]:
        """The cluster's events after id `since` (empty: the newest `count`), oldest first: scaled,
        autoscale (with its reasons), worker died or replaced, ... Page on with the last id as `since`."""
        if since and not _EVENT_ID.match(since):
            raise APIError(400, "since must be an event id (digits-digits), or empty for the newest", param="since")
        if not 1 <= count <= 1000:
            raise APIError(400, "count must be in 1..1000", param="count")
        found = await cluster(backend.events, since, count)
        return {"events": [{"id": event_id, **fields} for event_id, fields in found]}

    @api.post("/rebalance")
    async def rebalance(body: RebalanceBody) -> dict[str, Any]:
        check_replicas("prefill", body.prefill)
        check_replicas("decode", body.decode)
        change = {"prefill": body.prefill, "decode": body.decode}
        await check_still_serves(change, body.force, "decode" if body.prefill else "prefill")
        await cluster(backend.scale, change)  # one write: a worker of the long pool flips to the short one
        return {"prefill": body.prefill, "decode": body.decode}

    return api
