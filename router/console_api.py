"""The operator console at /console: static files (router/console/, no build step, no CDN) and one
read-only state call the page polls. Admin actions go to the /admin API with the token the
operator typed, which the page keeps in sessionStorage; without it the page is read-only.

    GET /console/              the page
    GET /console/api/state     pools and workers, live figures, recent events, last requests
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI
from fastapi.responses import RedirectResponse
from fastapi.staticfiles import StaticFiles

from router.admin import pools
from router.backend import Backend
from router.dispatch import Dispatcher
from router.errors import admin_error
from router.recent import as_json

STATIC = Path(__file__).with_name("console")
LAST_REQUESTS = 30
LAST_EVENTS = 20


def _event(event_id: str, fields: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {"id": event_id}
    for k, v in fields.items():
        try:
            out[k] = json.loads(v) if k not in ("kind", "ts") and v[:1] in "[{" else v
        except ValueError:
            out[k] = v
    return out


def install(app: FastAPI, d: Dispatcher, backend: Backend) -> None:
    api = APIRouter()

    @api.get("/console", include_in_schema=False)
    async def console() -> RedirectResponse:
        return RedirectResponse("/console/")

    @api.get("/console/api/state")
    async def state() -> dict[str, Any]:
        try:
            status, events = await asyncio.gather(
                asyncio.to_thread(backend.status), asyncio.to_thread(backend.events, "", LAST_EVENTS)
            )
        except Exception as e:
            raise admin_error(e, d.settings.retry_after_s) from e
        return {
            "pools": pools(status),
            "load": {
                "running": d.admission.running,
                "waiting": d.admission.waiting,
                "max_running": d.settings.running_bound(backend.serving_workers()),
                **d.recent.summary(),
            },
            "events": [_event(i, f) for i, f in events],
            "requests": [as_json(r) for r in d.recent.last(LAST_REQUESTS)],
            "admin": d.settings.admin_token is not None,
        }

    app.include_router(api)
    app.mount("/console", StaticFiles(directory=STATIC, html=True), name="console")
