"""The admin API: pools, scaling, draining, rebalancing (bearer token; see router.auth)."""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import APIRouter, Depends

from router.auth import admin_check
from router.backend import ROLES, Backend
from router.errors import APIError
from router.requests import RebalanceBody, ScaleBody
from router.settings import RouterSettings

WORKER_FIELDS = (
    "worker_id", "role", "state", "node", "draining", "running", "waiting", "free_blocks", "num_blocks", "kv_usage",
)  # fmt: skip


def pools(status: dict[str, Any]) -> dict[str, Any]:
    """The operator's view: desired sizes, and per worker its role, node, load, KV usage and state."""
    workers = [{k: w.get(k) for k in WORKER_FIELDS} for w in status.get("workers", [])]
    up = {r: sum(1 for w in workers if w["role"] == r and w["state"] == "up") for r in ROLES}
    return {"desired": status.get("desired", {}), "up": up, "workers": workers}


def build(backend: Backend, settings: RouterSettings) -> APIRouter:
    api = APIRouter(prefix="/admin", dependencies=[Depends(admin_check(settings))])

    def check_replicas(role: str, n: int) -> None:
        if role not in ROLES:
            raise APIError(404, f"no pool {role!r}; pools: {', '.join(ROLES)}", param="role", code="unknown_pool")
        if n > settings.max_replicas:
            raise APIError(400, f"replicas must be <= {settings.max_replicas}", param="replicas")

    @api.get("/pools")
    async def get_pools() -> dict[str, Any]:
        return pools(await asyncio.to_thread(backend.status))

    @api.post("/pools/{role}")
    async def scale(role: str, body: ScaleBody) -> dict[str, Any]:
        check_replicas(role, body.replicas)
        await asyncio.to_thread(backend.scale, role, body.replicas)
        return {"role": role, "replicas": body.replicas}

    @api.post("/workers/{worker_id}/drain")
    async def drain(worker_id: str) -> dict[str, Any]:
        if not await asyncio.to_thread(backend.drain, worker_id):
            raise APIError(404, f"no worker {worker_id!r}", param="worker_id", code="unknown_worker")
        return {"worker_id": worker_id, "state": "draining"}

    @api.post("/rebalance")
    async def rebalance(body: RebalanceBody) -> dict[str, Any]:
        check_replicas("prefill", body.prefill)
        check_replicas("decode", body.decode)
        if body.prefill + body.decode == 0:
            raise APIError(400, "a rebalance must leave at least one worker", param="prefill")
        await asyncio.to_thread(backend.scale, "prefill", body.prefill)
        await asyncio.to_thread(backend.scale, "decode", body.decode)
        return {"prefill": body.prefill, "decode": body.decode}

    return api
