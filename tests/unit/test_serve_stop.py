"""A signal that stops `tandem serve` lets `run()` return, whatever handler was there before:
the shutdown after it runs, and the process exits 0 (not 15 through Ray's handler, nor with a
KeyboardInterrupt traceback)."""

from __future__ import annotations

import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from router.server import http_server
from router.settings import RouterSettings
from router.stopping import StartSignals
from tests.ports import free_port


async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": []})
    await send({"type": "http.response.body", "body": b"ok"})


def ray_like_handler(signum: int, frame: object) -> None:
    sys.exit(signum)  # what ray.init() installs for SIGTERM in the driver


@pytest.fixture
def restore_handlers() -> Iterator[None]:
    saved = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    yield
    for sig, handler in saved.items():
        signal.signal(sig, handler)


def signal_once_serving(port: int, sig: int) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            time.sleep(0.05)
    os.kill(os.getpid(), sig)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_stop_signal_returns_from_run_past_the_handler_found(restore_handlers: None, sig: int) -> None:
    signal.signal(signal.SIGTERM, ray_like_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    port = free_port()
    server = http_server(app, RouterSettings(port=port))
    threading.Thread(target=signal_once_serving, args=(port, sig), daemon=True).start()
    signals = StartSignals()
    signals.listen()  # as tandem serve does from its start on
    server.run()  # with the handlers found: SystemExit(15), or KeyboardInterrupt
    assert server.started
    assert signals.requested.is_set()  # uvicorn raised it again on its way out


def test_a_stop_signal_while_starting_is_recorded_not_raised(restore_handlers: None) -> None:
    signals = StartSignals()
    signals.listen()
    os.kill(os.getpid(), signal.SIGTERM)
    assert signals.requested.wait(5)  # and nothing was raised here, nor inside a Ray call
