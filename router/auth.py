"""Bearer-token checks: API keys for /v1 (when configured) and the admin token for /admin."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable

from fastapi import Request

from router.errors import APIError
from router.settings import RouterSettings

LOOPBACK = frozenset({"127.0.0.1", "::1"})


def _bearer(request: Request) -> str | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip() if scheme.lower() == "bearer" and token.strip() else None


def _matches(token: str | None, secrets: tuple[str, ...]) -> bool:
    ok = False
    for s in secrets:  # no early exit: the time taken does not tell which key came close
        ok |= token is not None and hmac.compare_digest(token.encode(), s.encode())
    return ok


def api_key_check(settings: RouterSettings) -> Callable[[Request], Awaitable[None]]:
    """401 unless the request carries one of `settings.api_keys` (no keys configured: open)."""

    async def check(request: Request) -> None:
        if settings.api_keys and not _matches(_bearer(request), settings.api_keys):
            raise APIError(
                401,
                "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                code="invalid_api_key",
                type="invalid_request_error",
            )

    return check


def admin_check(settings: RouterSettings) -> Callable[[Request], Awaitable[None]]:
    """With an admin token: 401 unless it is presented. Without one: 403, unless
    `allow_loopback_admin` and the caller is on loopback."""

    async def check(request: Request) -> None:
        if settings.admin_token:
            if not _matches(_bearer(request), (settings.admin_token,)):
                raise APIError(
                    401,
                    "admin API: missing or wrong bearer token",
                    code="invalid_admin_token",
                    headers={"WWW-Authenticate": "Bearer"},
                )
            return
        host = request.client.host if request.client else ""
        if not (settings.allow_loopback_admin and host in LOOPBACK):
            raise APIError(403, "the admin API is disabled: set TANDEM_ADMIN_TOKEN", code="admin_disabled")

    return check
