"""cluster.shutdown.run_steps: every step bounded, a failing one logged and passed, and once a
Ray step has not answered (or Ray is known gone), the Ray steps after it skipped (nothing
answers them either)."""

from __future__ import annotations

import threading

import pytest

from cluster.shutdown import Outcome, Step, run_steps


def test_every_step_runs_in_order_and_a_failing_one_does_not_stop_the_rest(caplog: pytest.LogCaptureFixture) -> None:
    ran: list[str] = []

    def fail() -> None:
        ran.append("b")
        raise ConnectionError("redis is gone")

    outcome = run_steps([Step("a", lambda: ran.append("a")), Step("b", fail), Step("c", lambda: ran.append("c"))])
    assert ran == ["a", "b", "c"]
    assert outcome == Outcome(done=("a", "b", "c"), left_behind=(), skipped=(), ray_answered=True)
    assert "shutdown step b failed" in caplog.text and "redis is gone" in caplog.text


def test_a_ray_step_that_does_not_answer_is_left_behind_and_later_ray_steps_are_skipped() -> None:
    hung = threading.Event()
    ran: list[str] = []
    try:
        outcome = run_steps(
            [
                Step("list actors", hung.wait, bound_s=0.2, ray=True),
                Step("kill actors", lambda: ran.append("kill"), ray=True),
                Step("redis-server", lambda: ran.append("redis")),  # not Ray: still runs
                Step("ray", lambda: ran.append("ray"), ray=True),
            ]
        )
    finally:
        hung.set()
    assert ran == ["redis"]
    assert outcome == Outcome(
        done=("redis-server",), left_behind=("list actors",), skipped=("kill actors", "ray"), ray_answered=False
    )


def test_a_slow_step_that_is_not_ray_is_left_behind_without_skipping_anything() -> None:
    hung = threading.Event()
    try:
        outcome = run_steps([Step("view", hung.wait, bound_s=0.2), Step("ray", lambda: None, ray=True)])
    finally:
        hung.set()
    assert outcome == Outcome(done=("ray",), left_behind=("view",), skipped=(), ray_answered=True)


def test_ray_known_gone_skips_every_ray_step_from_the_first() -> None:
    ran: list[str] = []
    outcome = run_steps(
        [Step("kill actors", lambda: ran.append("kill"), ray=True), Step("redis-server", lambda: ran.append("redis"))],
        ray_gone=True,
    )
    assert ran == ["redis"]
    assert outcome == Outcome(done=("redis-server",), left_behind=(), skipped=("kill actors",), ray_answered=False)
