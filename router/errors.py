"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and how exceptions map onto them.

InvalidRequestError / pydantic validation / malformed JSON   400
bad or missing API key / admin token                         401
admin API disabled                                           403
unknown model, route or worker                               404
PromptTooLongError                                           413
admission queue full (Saturated)                             429 + Retry-After
no worker up / workers failing (after retries)               503 + Retry-After
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from engine.errors import InvalidRequestError, PromptTooLongError

log = logging.getLogger("tandem.router")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


class APIError(Exception):
    """An error answer; raise it anywhere in a handler."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _TYPES.get(status, "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


class Saturated(Exception):
    """The admission queue is full (or the wait timed out)."""


def as_api_error(e: BaseException, retry_after_s: int = 1) -> APIError:
    """The answer for an exception raised while serving a request."""
    from cluster.cluster import NoWorkerError

    if isinstance(e, APIError):
        return e
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(e, PromptTooLongError):
        return APIError(413, str(e), param=e.param or "messages", code="context_length_exceeded")
    if isinstance(e, InvalidRequestError):
        return APIError(400, str(e), param=e.param)
    if isinstance(e, Saturated):
        return APIError(429, f"the server is at capacity: {e}; retry later", code="rate_limit_exceeded", headers=retry)
    if isinstance(e, NoWorkerError):
        return APIError(503, str(e), code="no_worker", headers=retry)
    log.exception("request failed", exc_info=e)
    message = f"the request failed on the workers: {type(e).__name__}: {e}"
    return APIError(503, message, code="worker_error", headers=retry)


def _param(loc: Sequence[Any]) -> str | None:
    parts = [p for p in loc if p not in ("body", "query", "path", "header")]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = list(exc.errors())
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return APIError(400, "we could not parse the JSON body of your request", code="invalid_json")
    param = _param(first.get("loc", ()))
    if first.get("type") == "missing" and param is None:
        return APIError(400, "the request body is missing", code="invalid_body")
    message = f"{param}: {first.get('msg')}" if param else str(first.get("msg"))
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    return APIError(400, message, param=param, code="invalid_value")


def install(app: FastAPI) -> None:
    """Answer every error in OpenAI's shape (FastAPI's 422 becomes 400)."""

    async def on_api_error(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc).response()

    async def on_http(_: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, StarletteHTTPException)
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
