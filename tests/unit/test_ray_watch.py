"""router.ray_watch: a router notices its Ray (the GCS, this host's raylet) is gone without asking Ray."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

from router.ray_watch import RayWatch, port_open


def answers(*values: bool) -> Iterator[bool]:
    yield from values
    while True:
        yield values[-1]


def test_a_listening_port_is_reachable_and_a_closed_one_is_not() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        address = f"127.0.0.1:{s.getsockname()[1]}"
        assert port_open(address)
    assert not port_open(address)  # refused at once, as after `ray stop`
    assert not port_open("no port here")


def test_gone_once_unreachable_for_the_whole_window() -> None:
    seq = answers(True, True, False)
    watch = RayWatch(lambda: next(seq), gone_after_s=0.1, interval_s=0.01)
    called = threading.Event()
    t0 = time.monotonic()
    watch.run(threading.Event(), called.set)
    assert called.is_set() and watch.gone.is_set()
    assert time.monotonic() - t0 >= 0.1


def test_a_gcs_that_comes_back_within_the_window_is_not_gone() -> None:
    flaps = answers(*([False] * 5 + [True]) * 6)  # unreachable 0.05 s at a time, then back
    watch = RayWatch(lambda: next(flaps), gone_after_s=0.5, interval_s=0.01)
    stop = threading.Event()
    threading.Timer(1.0, stop.set).start()
    watch.run(stop, lambda: None)
    assert not watch.gone.is_set()


def test_stop_ends_the_watch_without_calling_back() -> None:
    stop = threading.Event()
    watch = RayWatch(lambda: False, gone_after_s=60.0, interval_s=0.01).start(stop, lambda: None)
    stop.set()
    time.sleep(0.05)
    assert not watch.gone.is_set()


def test_a_gcs_that_refuses_is_known_at_once_for_the_stop() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        watch = RayWatch(lambda: True, gcs=f"127.0.0.1:{s.getsockname()[1]}")
        assert not watch.gcs_refuses()
    assert watch.gcs_refuses() and not watch.gone.is_set()  # no GONE_AFTER_S wait for a stop to know it
    assert not RayWatch(lambda: True).gcs_refuses()  # no GCS known: Ray's steps run, bounded
