"""Errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and how exceptions map onto them.

InvalidRequestError / pydantic validation / malformed JSON   400
  tokenizer or chat template failure, stop over the caps     400
  scale or rebalance that would leave nothing to serve on    400 (unless the call says `force`)
bad or missing API key / admin token                         401
admin API disabled                                           403
unknown model, route or worker                               404
PromptTooLongError / request body over max_body_bytes        413
admission queue full (Saturated)                             429 + Retry-After
an unexpected error in the router                            500
the engine failed on the request (engine/containment.py)     500
no worker up / workers failing (after retries)               503 + Retry-After
cluster state store (Redis) unavailable                      503 + Retry-After

A 5xx message never carries an exception's name, text or traceback: those go to the log,
under the request's `x-request-id`, and the client gets a short sentence from `client_message`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from typing import Any

from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException as StarletteHTTPException

from cluster.state import StateUnavailable
from engine.errors import InvalidRequestError, PromptTooLongError

log = logging.getLogger("tandem.router")

# The `x-request-id` of the request being served, set by the app's request-id middleware, so that
# log lines about a failure can name the request wherever the failure is turned into an answer.
REQUEST_ID: ContextVar[str] = ContextVar("tandem_request_id", default="-")

STATE_OUTAGE = (StateUnavailable, RedisConnectionError, RedisTimeoutError)

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


_WORKER_GONE = frozenset({"WorkerDiedError", "RayActorError", "ActorDiedError", "ActorUnavailableError",
                          "WorkerCrashedError", "NodeDiedError", "OwnerDiedError", "ObjectLostError"})  # fmt: skip
# The sentence a 5xx answer gives for an exception whose class (or a base of it: Ray's
# RayTaskError(Cause) included) has one of these names; the first match wins.
_SENTENCES: tuple[tuple[frozenset[str], str], ...] = (
    (frozenset({"GetTimeoutError", "TimeoutError"}), "the workers did not answer in time; retry later"),
    (
        frozenset({"EngineFailedError"}),
        "the engine failed on this request; the server log has the details under this response's x-request-id",
    ),
    (_WORKER_GONE, "a worker stopped or stopped answering while serving this request; retry later"),
    (frozenset({"WorkerDraining"}), "the worker is draining; retry later"),
    (frozenset({"KVTransferError"}), "moving the prompt's KV cache between workers failed; retry later"),
    (frozenset({"StreamEndedError"}), "the worker's token stream ended before the request finished; retry later"),
)
WORKERS_FAILED = "the workers could not complete this request; retry later"
NO_WORKER = "no worker is up with room for this request; retry later"
STATE_DOWN = "cluster state store unavailable (Redis is not answering); retry later"
INTERNAL = "internal server error; the server log has the details under this response's x-request-id"
MAX_MESSAGE = 200
_INTERNALS = ("Traceback", "ray::", 'File "')  # marks of a traceback or of Ray's task dump


def client_message(exc: BaseException, default: str = WORKERS_FAILED) -> str:
    """The message of a 5xx answer to `exc`: one line of at most MAX_MESSAGE characters, safe
    to show. A sentence chosen by the exception's type, or `default`; only texts written for
    clients (an APIError's, a NoWorkerError's) are passed on, and then only their first line,
    unless they look like a traceback. The caller logs `exc` itself."""
    if isinstance(exc, APIError):
        return _one_line(exc.message, default)
    if isinstance(exc, StarletteHTTPException):
        return _one_line(str(exc.detail), default)
    if isinstance(exc, STATE_OUTAGE):
        return STATE_DOWN
    names = {c.__name__ for c in type(exc).__mro__}
    if "NoWorkerError" in names:  # Ray's RayTaskError(NoWorkerError) keeps the original as `cause`
        cause = getattr(exc, "cause", None)
        return _one_line(str(cause if isinstance(cause, BaseException) else exc), NO_WORKER)
    return next((sentence for kinds, sentence in _SENTENCES if kinds & names), default)


def _one_line(text: str, fallback: str) -> str:
    lines = text.strip().splitlines()
    if not lines or any(mark in text for mark in _INTERNALS):
        return fallback
    line = lines[0].strip()
    if not line.isprintable():  # terminal escapes (Ray colours its dumps)
        return fallback
    return line if len(line) <= MAX_MESSAGE else line[: MAX_MESSAGE - 3].rstrip() + "..."


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
        if status >= 500:  # whoever builds one, a 5xx message is one safe line (see client_message)
            message = _one_line(message, INTERNAL)
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
        return _AsciiJSONResponse(self.body(), status_code=self.status, headers=self.headers)


class _AsciiJSONResponse(JSONResponse):
    # A message that quotes the client's input may hold lone surrogates, which cannot be encoded
    # as UTF-8: escaped to ASCII they can (JSONResponse's own rendering would fail with a 500).
    def render(self, content: Any) -> bytes:
        return json.dumps(content, separators=(",", ":")).encode("ascii")


class Saturated(Exception):
    """The admission queue is full (or the wait timed out)."""


class BodyTooLarge(StarletteHTTPException):
    """The request body is over the router's limit. An HTTPException because FastAPI passes those
    through unchanged when they are raised while it reads the body."""

    def __init__(self, limit: int) -> None:
        super().__init__(413, f"the request body is larger than this server's limit of {limit} bytes")

    def api_error(self) -> APIError:
        return APIError(413, self.detail, code="request_too_large")


def internal_error(e: BaseException) -> APIError:
    """The answer for an exception nothing else handled (the caller logs it)."""
    return APIError(500, client_message(e, INTERNAL), code="internal_error")


def state_unavailable(e: BaseException, retry_after_s: int) -> APIError:
    log.warning("request %s: cluster state store unavailable: %r", REQUEST_ID.get(), e)
    return APIError(503, client_message(e), code="state_unavailable", headers={"Retry-After": str(retry_after_s)})


def as_api_error(e: BaseException, retry_after_s: int = 1) -> APIError:
    """The answer for an exception raised while serving a request."""
    from cluster.cluster import NoWorkerError
    from cluster.request_run import WorkerDiedError

    if isinstance(e, APIError):
        return e
    retry = {"Retry-After": str(retry_after_s)}
    if isinstance(e, InvalidRequestError):  # a worker's refusal comes as RayTaskError(Cause), whose text is Ray's dump
        cause = getattr(e, "cause", None)
        own = cause if isinstance(cause, InvalidRequestError) else e
        if isinstance(own, PromptTooLongError):
            return APIError(413, str(own), param=own.param or "messages", code="context_length_exceeded")
        return APIError(400, str(own), param=own.param)
    if isinstance(e, Saturated):
        return APIError(429, f"the server is at capacity: {e}; retry later", code="rate_limit_exceeded", headers=retry)
    if isinstance(e, STATE_OUTAGE):
        return state_unavailable(e, retry_after_s)
    if isinstance(e, NoWorkerError):  # no traceback to log: routing found nothing
        log.warning("request %s: no worker: %s", REQUEST_ID.get(), e)
        return APIError(503, client_message(e), code="no_worker", headers=retry)
    if isinstance(e, WorkerDiedError):  # its text says which worker and how; the router's stack adds nothing
        log.error("request %s failed on the workers: %s: %s", REQUEST_ID.get(), type(e).__name__, e)
    else:
        log.error("request %s failed on the workers", REQUEST_ID.get(), exc_info=e)
    if "EngineFailedError" in {c.__name__ for c in type(e).__mro__}:  # a bug, likely again on a retry
        return APIError(500, client_message(e), code="engine_error")
    return APIError(503, client_message(e), code="worker_error", headers=retry)


def admin_error(e: BaseException, retry_after_s: int) -> APIError:
    """The answer for an exception raised by the cluster during an admin call."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, STATE_OUTAGE):
        return state_unavailable(e, retry_after_s)
    log.error("request %s: the admin call failed in the cluster", REQUEST_ID.get(), exc_info=e)
    message = client_message(e, "the cluster could not carry out this admin call; retry later")
    return APIError(503, message, code="cluster_error", headers={"Retry-After": str(retry_after_s)})


def _fields(loc: Sequence[Any]) -> list[Any]:
    """`loc` without where the value came from (body, query, ...) and without pydantic's tags
    for union members ("str", "list[TextPart]", a model's class name): the field path a
    client wrote."""
    return [p for p in loc if isinstance(p, int) or not (p in _NOT_FIELDS or "[" in p or p[:1].isupper())]


_NOT_FIELDS = frozenset({"body", "query", "path", "header", "str", "int", "float", "bool", "list", "dict", "none"})


def _param(loc: Sequence[Any]) -> str | None:
    out = ""
    for p in _fields(loc):
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def validation_error(exc: RequestValidationError) -> APIError:
    errors = list(exc.errors())
    first = errors[0] if errors else {"msg": "invalid request", "loc": ()}
    if first.get("type") == "json_invalid":
        return APIError(400, "we could not parse the JSON body of your request", code="invalid_json")
    if first.get("type") == "missing" and _param(first.get("loc", ())) is None:
        return APIError(400, "the request body is missing", code="invalid_body")
    # a value that fits no member of a union fails each member: the one that got deepest into
    # the value says most (a chat content part of type "image_url": its `type`, not "a string")
    first = max(errors, key=lambda e: len(_fields(e.get("loc", ()))))
    param = _param(first.get("loc", ()))
    why = str(first.get("msg")).removeprefix("Value error, ")  # a validator's own words, without pydantic's tag
    message = f"{param}: {why}" if param else why
    if len(errors) > 1:
        message += f" (and {len(errors) - 1} more)"
    return APIError(400, message, param=param, code="invalid_value")


def install(app: FastAPI, retry_after_s: int) -> None:
    """Answer every error in OpenAI's shape (FastAPI's 422 becomes 400; a state store outage 503)."""

    async def on_api_error(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, APIError)
        return exc.response()

    async def on_validation(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, RequestValidationError)
        return validation_error(exc).response()

    async def on_http(_: Request, exc: Exception) -> Response:
        assert isinstance(exc, StarletteHTTPException)
        if isinstance(exc, BodyTooLarge):
            return exc.api_error().response()
        if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not read the body (not UTF-8...)
            return APIError(400, "we could not parse the JSON body of your request", code="invalid_json").response()
        if exc.status_code >= 500:
            log.error("request %s failed: %r", REQUEST_ID.get(), exc)
            return APIError(exc.status_code, client_message(exc, INTERNAL), headers=exc.headers).response()
        return APIError(exc.status_code, str(exc.detail), headers=exc.headers).response()

    async def on_state_outage(_: Request, exc: Exception) -> Response:
        return state_unavailable(exc, retry_after_s).response()

    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(RequestValidationError, on_validation)
    app.add_exception_handler(StarletteHTTPException, on_http)
    for outage in STATE_OUTAGE:
        app.add_exception_handler(outage, on_state_outage)
