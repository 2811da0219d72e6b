"""create_app(backend, settings): the router's FastAPI app.

/v1/models, /v1/chat/completions, /v1/completions   OpenAI API (router.openai_api)
/admin/...                                          pools, scale, drain, rebalance (router.admin)
/health  /ready  /metrics                           liveness, readiness, Prometheus text
"""

from __future__ import annotations

import asyncio
import logging
import re
import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router import admin, errors, openai_api
from router.backend import Backend
from router.dispatch import Dispatcher
from router.metrics import Metrics
from router.settings import RouterSettings

log = logging.getLogger("tandem.router")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:/=+-]{1,128}$")


class RequestIdMiddleware:
    """Every response carries `x-request-id`: the client's (when sane) or a new one; handlers
    read it as `request.state.request_id`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _CLIENT_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid

        async def send_with_id(message: Message) -> None:
            if message["type"] == "http.response.start":
                MutableHeaders(scope=message)["x-request-id"] = rid
            await send(message)

        await self.app(scope, receive, send_with_id)


def create_app(backend: Backend, settings: RouterSettings | None = None) -> FastAPI:
    settings = settings or RouterSettings()
    metrics = Metrics()
    dispatcher = Dispatcher(backend, settings, metrics)
    app = FastAPI(title="Tandem router", docs_url=None, redoc_url=None)
    errors.install(app)
    app.add_middleware(RequestIdMiddleware)
    app.include_router(openai_api.build(dispatcher))
    app.include_router(admin.build(backend, settings))
    app.state.dispatcher = dispatcher  # for operators' introspection; handlers use closures

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        try:
            ok = await asyncio.to_thread(backend.ready)
        except Exception as e:
            log.warning("readiness check failed: %r", e)
            ok = False
        return JSONResponse({"ready": ok}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        try:
            metrics.set_workers((await asyncio.to_thread(backend.status)).get("workers", []))
        except Exception as e:  # still serve the router's own figures
            log.warning("worker status for /metrics failed: %r", e)
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    return app
