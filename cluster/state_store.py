"""What every part of the cluster's state shares: one namespace's keys in Redis, and Redis
outages raised as StateUnavailable (cluster/state.py has the layout)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Concatenate, ParamSpec, TypeVar

import redis

from engine.errors import EngineError


class StateUnavailable(EngineError):
    """The cluster's state store (Redis) did not answer in time. Serving goes on from the last
    known state; what needs the store (admin calls, scaling) fails with this until it is back."""


class StateStore:
    """A Redis client for one namespace: `key()` names a key under `tandem:{namespace}:`."""

    _r: redis.Redis
    _prefix: str
    address: str

    def key(self, *parts: str) -> str:
        return self._prefix + ":".join(parts)


_S = TypeVar("_S", bound=StateStore)
_P = ParamSpec("_P")
_R = TypeVar("_R")


def unavailable_as_state_error(method: Callable[Concatenate[_S, _P], _R]) -> Callable[Concatenate[_S, _P], _R]:
    """Raise Redis connection and timeout errors (after the client's retries) as StateUnavailable.

    A refused password is a configuration error, not an outage: it propagates as it is."""

    @functools.wraps(method)
    def call(self: _S, /, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        try:
            return method(self, *args, **kwargs)
        except redis.AuthenticationError:
            raise
        except (redis.ConnectionError, redis.TimeoutError) as e:
            raise StateUnavailable(f"cluster state store at {self.address} unavailable: {e}") from e

    return call
