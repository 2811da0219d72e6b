"""engine.torch_threads: a function run on a thread that exits, its result or its error."""

from __future__ import annotations

import threading

import pytest

from engine.torch_threads import on_spent_thread


def test_returns_the_result_from_a_thread_that_has_exited() -> None:
    seen: list[threading.Thread] = []

    def work() -> int:
        seen.append(threading.current_thread())
        return 42

    assert on_spent_thread(work) == 42
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()


def test_reraises_what_the_function_raised() -> None:
    def boom() -> None:
        raise ValueError("no model here")

    with pytest.raises(ValueError, match="no model here"):
        on_spent_thread(boom)
