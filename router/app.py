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
from opentelemetry.sdk.trace import TracerProvider
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers, MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from router import admin, console_api, errors, openai_api, tokenize_api, tracing
from router.backend import Backend
from router.dispatch import Dispatcher
from router.metrics import Metrics
from router.settings import RouterSettings

log = logging.getLogger("tandem.router")
_CLIENT_ID = re.compile(r"^[A-Za-z0-9._:/=+-]{1,128}$")


class RequestIdMiddleware:
    """Every response carries `x-request-id`: the client's (when sane) or a new one; handlers
    read it as `request.state.request_id`, log lines as `errors.REQUEST_ID`. An exception no
    handler took becomes a 500 in OpenAI's shape (the detail goes to the log, not the client)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"x-request-id", b"").decode("latin-1")
        rid = given if _CLIENT_ID.match(given) else uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                MutableHeaders(scope=message)["x-request-id"] = rid
            await send(message)

        token = errors.REQUEST_ID.set(rid)
        try:
            await self.app(scope, receive, send_with_id)
        except Exception as e:
            log.exception("request %s failed with an unhandled error", rid)
            if started:
                raise  # too late for an error answer: the server drops the connection
            await errors.internal_error(e).response()(scope, receive, send_with_id)
        finally:
            errors.REQUEST_ID.reset(token)


class BodyLimitMiddleware:
    """413 for a request body over `max_bytes`, before it is read: at once when Content-Length
    says so, else as soon as the bytes received pass the limit (a chunked body)."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = Headers(scope=scope).get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await errors.BodyTooLarge(self.max_bytes).api_error().response()(scope, receive, send)
            return
        received = 0

        async def counted() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise errors.BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, counted, send)


def create_app(
    backend: Backend, settings: RouterSettings | None = None, tracer_provider: TracerProvider | None = None
) -> FastAPI:
    """`tracer_provider`: where requests' spans go (router.tracing); default: OTLP when the
    OTEL_EXPORTER_OTLP_* variables are set, else none."""
    settings = settings or RouterSettings()
    metrics = Metrics()
    provider = tracer_provider or tracing.provider_from_env()
    dispatcher = Dispatcher(backend, settings, metrics, tracing.RequestTracer(provider) if provider else None)
    app = FastAPI(title="Tandem router", docs_url=None, redoc_url=None)
    errors.install(app, settings.retry_after_s)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    app.add_middleware(RequestIdMiddleware)  # added last: outermost, so every answer above carries the id
    app.include_router(openai_api.build(dispatcher))
    app.include_router(tokenize_api.build(backend.model, settings))
    app.include_router(admin.build(backend, settings))
    console_api.install(app, dispatcher, backend)
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
