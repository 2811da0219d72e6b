"""EngineLoop.later: a call queued for the loop's next turn, never waiting for the step in progress."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loop import EngineLoop
from engine.model import LlamaModel


@pytest.fixture
def loop(tiny_model: LlamaModel) -> EngineLoop:
    engine = Engine(tiny_model, None, EngineConfig(dtype="fp32", block_size=4, num_blocks=64))
    return EngineLoop(engine)  # not started: the test drives it


def test_later_does_not_wait_for_the_lock_and_runs_before_the_next_call(loop: EngineLoop) -> None:
    ran: list[str] = []
    with loop.lock:  # a step in progress, on another thread's behalf
        t = time.monotonic()
        done = threading.Event()
        threading.Thread(target=lambda: (loop.later(lambda e: ran.append("later")), done.set())).start()
        assert done.wait(5) and time.monotonic() - t < 1.0  # queued at once, the lock still held
        assert ran == []
    assert loop.call(lambda e: ran.append("call") or "ok") == "ok"
    assert ran == ["later", "call"]  # the queued call first


def test_the_running_loop_runs_later_calls_and_logs_their_failures(
    loop: EngineLoop, caplog: pytest.LogCaptureFixture
) -> None:
    ran = threading.Event()

    def boom(e: Engine) -> None:
        raise RuntimeError("boom")

    loop.start()
    try:
        with caplog.at_level(logging.ERROR, logger="engine.loop"):
            loop.later(boom)
            loop.later(lambda e: ran.set())
            assert ran.wait(5)  # an idle loop wakes for them; a failing one does not stop the next
        assert "a deferred engine call failed" in caplog.text
        loop.check_integrity()
    finally:
        loop.stop()
