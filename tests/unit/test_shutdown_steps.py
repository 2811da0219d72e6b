"""cluster.shutdown.run_steps: every step bounded, a failing one logged and passed, and once a
Ray step has not answered (or Ray is known gone), the Ray steps after it skipped (nothing
answers them either)."""

from __future__ import annotations

import threading
import time

import pytest

from cluster.shutdown import LOOK_S, Outcome, Step, run_steps


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


def test_ray_down_now_skips_the_ray_steps_and_a_waiting_one_gives_up_when_ray_goes(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`ray_down` (Ray's GCS refuses connections): asked before each Ray step, and while one waits,
    so a GCS that dies beside the caller (a whole process group SIGTERMed) costs ~LOOK_S, not the
    step's 10 s bound."""
    ran: list[str] = []
    outcome = run_steps(
        [Step("kill", lambda: ran.append("kill"), ray=True), Step("redis", lambda: None)], ray_down=lambda: True
    )
    assert ran == [] and outcome == Outcome(done=("redis",), left_behind=(), skipped=("kill",), ray_answered=False)

    hung, down_at = threading.Event(), time.monotonic() + 0.3
    try:
        t0 = time.monotonic()
        outcome = run_steps(
            [Step("kill", hung.wait, bound_s=10.0, ray=True), Step("ray", lambda: ran.append("ray"), ray=True)],
            ray_down=lambda: time.monotonic() >= down_at,
        )
        took = time.monotonic() - t0
    finally:
        hung.set()
    assert outcome == Outcome(done=(), left_behind=("kill",), skipped=("ray",), ray_answered=False)
    assert ran == [] and took < 0.3 + 2 * LOOK_S + 0.5, took
    assert "kill left behind: Ray's GCS refuses connections now" in caplog.text


def test_a_ray_step_that_returns_is_not_cut_short_by_a_ray_that_answers() -> None:
    slow = threading.Event()
    threading.Timer(0.6, slow.set).start()
    outcome = run_steps([Step("kill", slow.wait, bound_s=5.0, ray=True)], ray_down=lambda: False)
    assert outcome == Outcome(done=("kill",), left_behind=(), skipped=(), ray_answered=True)


def test_ray_shutdown_that_stops_the_gcs_itself_is_not_cut_short() -> None:
    """A normal stop: ray.shutdown takes the GCS down first, then the rest; `ray_down` turning
    true meanwhile is its own doing, not a hang."""
    gcs_up = threading.Event()
    gcs_up.set()

    def shutdown() -> None:
        gcs_up.clear()
        time.sleep(3 * LOOK_S)

    outcome = run_steps([Step("ray", shutdown, ray=True, stops_ray=True)], ray_down=lambda: not gcs_up.is_set())
    assert outcome == Outcome(done=("ray",), left_behind=(), skipped=(), ray_answered=True)
