"""ClusterState with no Redis behind it: every call raises StateUnavailable, fast; ping() says False.

No redis-server here: a port with nothing listening (connection refused) and a socket that
accepts and never answers (a hung Redis, the timeout path).
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from cluster.redis_process import free_port
from cluster.state import ClusterState, StateUnavailable

PASSWORD = "s3cret-never-shown"
CALLS: dict[str, Callable[[ClusterState], Any]] = {
    "register_worker": lambda s: s.register_worker("w", {"role": "decode"}, 5),
    "heartbeat": lambda s: s.heartbeat("w", {"load": 1}, 5),
    "workers": lambda s: s.workers(),
    "deregister_worker": lambda s: s.deregister_worker("w"),
    "set_desired": lambda s: s.set_desired("decode", 1),
    "desired": lambda s: s.desired(),
    "add_blocks": lambda s: s.add_blocks("w", [1, 2]),
    "remove_blocks": lambda s: s.remove_blocks("w", [1]),
    "drop_worker_blocks": lambda s: s.drop_worker_blocks("w"),
    "longest_prefix": lambda s: s.longest_prefix([1, 2]),
    "emit": lambda s: s.emit("scaled", role="decode"),
    "events": lambda s: s.events(),
    "flush_namespace": lambda s: s.flush_namespace(),
}


@pytest.fixture
def hung_port() -> Iterator[int]:
    """A listening socket that never accepts or answers: connects succeed, replies never come."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(64)
        yield srv.getsockname()[1]


def fast_state(port: int) -> ClusterState:
    return ClusterState(f"redis://:{PASSWORD}@127.0.0.1:{port}/0", "t", socket_timeout_s=0.25, retries=0)


@pytest.mark.parametrize("call", list(CALLS))
def test_nothing_listening_raises_state_unavailable_at_once(call: str) -> None:
    port = free_port()
    with fast_state(port) as st:
        t = time.monotonic()
        with pytest.raises(StateUnavailable) as err:
            CALLS[call](st)
        assert time.monotonic() - t < 1.0
    assert f"127.0.0.1:{port}" in str(err.value) and PASSWORD not in str(err.value)


@pytest.mark.parametrize("call", ["desired", "heartbeat", "longest_prefix", "emit"])
def test_a_hung_redis_raises_state_unavailable_after_the_socket_timeout(hung_port: int, call: str) -> None:
    with fast_state(hung_port) as st:
        t = time.monotonic()
        with pytest.raises(StateUnavailable):
            CALLS[call](st)
        assert 0.2 < time.monotonic() - t < 1.5


def test_ping_says_false_instead_of_raising(hung_port: int) -> None:
    for port in (free_port(), hung_port):
        with fast_state(port) as st:
            t = time.monotonic()
            assert st.ping() is False
            assert time.monotonic() - t < 1.5


def test_retries_are_bounded_then_state_unavailable() -> None:
    with ClusterState(f"redis://127.0.0.1:{free_port()}/0", "t", socket_timeout_s=0.25, retries=2) as st:
        t = time.monotonic()
        with pytest.raises(StateUnavailable):
            st.desired()
        assert time.monotonic() - t < 2.0


def test_bad_input_is_still_value_error_not_an_outage() -> None:
    with fast_state(free_port()) as st, pytest.raises(ValueError):
        st.set_desired("gpu", 1)
