"""Typed errors the engine raises; the router maps them onto HTTP statuses."""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error the engine raises on purpose."""


class InvalidRequestError(EngineError, ValueError):
    """A request's input is invalid (HTTP 400). `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param

    def __reduce__(self) -> tuple[type[InvalidRequestError], tuple[str, str | None]]:
        return type(self), (str(self), self.param)  # crosses Ray (pickle) with its param


class PromptTooLongError(InvalidRequestError):
    """The prompt (plus at least one generated token) does not fit the context (HTTP 413)."""


class DuplicateRequestError(InvalidRequestError):
    """A request id is already in use."""


class NoFreeBlocksError(EngineError):
    """The block pool cannot satisfy an allocation."""


class UnknownRequestError(EngineError, KeyError):
    """An operation named a request id the engine does not hold."""


class StreamError(EngineError):
    """The request failed inside the engine loop (the message says why): its stream's end."""


class WorkerDraining(EngineError):
    """The worker is draining: it finishes what it has and takes nothing new."""
