"""engine.torch_threads: a function run on a thread that exits, its result or its error."""

from __future__ import annotations

import threading

import pytest
import torch

from engine.torch_threads import on_spent_thread, oversubscribed, set_team_size, threads_per_worker


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


def test_workers_on_one_host_split_its_cores() -> None:
    assert threads_per_worker(2, 2) == 1  # 1P+1D on 2 cores
    assert threads_per_worker(2, 1) == 2  # one colocated worker takes both
    assert threads_per_worker(16, 3) == 5
    assert threads_per_worker(2, 5) == 1  # never 0
    assert threads_per_worker(8, 0) == 8


def test_more_threads_than_the_hosts_cores_are_named() -> None:
    assert oversubscribed(1, 2, 2) is None and oversubscribed(2, 1, 2) is None  # tandem serve's own splits
    assert oversubscribed(64, 2, 2) == (
        "--threads 64 x 2 worker(s) = 128 threads on this host's 2 cores: their OpenMP threads will contend "
        "(leave --threads out to split the cores)"
    )


def test_a_team_size_set_on_one_thread_stays_on_that_thread() -> None:
    """The engine loop's team grows while the host's other workers are idle (engine/core_ledger.py);
    a thread that starts its torch ops later (a KV receiver's) keeps torch's count."""
    start = torch.get_num_threads()
    seen: dict[str, int] = {}

    def later() -> None:
        seen["later"] = torch.get_num_threads()

    def loop() -> None:
        set_team_size(start + 1)
        seen["loop"] = torch.get_num_threads()
        torch.ones(1 << 16).add_(1)  # a parallel op runs on the new team
        t = threading.Thread(target=later)
        t.start()
        t.join()

    t = threading.Thread(target=loop)
    t.start()
    t.join()
    assert seen == {"loop": start + 1, "later": start}
    assert torch.get_num_threads() == start
