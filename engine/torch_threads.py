"""Torch's CPU threads: one OpenMP team per worker process, the engine loop's.

libgomp gives every thread that runs a parallel torch op an OpenMP team of its own, kept for
the thread's life. Once two teams exist, libgomp counts more of its threads than there are
cores and stops spinning between parallel regions: every region, in either team, then pays a
futex sleep and wake. Measured on 2 cores (int8 SmolLM2, 8 decodes a step): 24.6 ms a step on
a thread alone, 44.7 ms on a second thread after the first had run the model; an fp32 linear
of 8 x 576 x 1536 went from 187 to 289 us. A worker therefore builds its engine on a thread that
then exits (`on_spent_thread`), so that the loop's thread is the only team left.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def on_spent_thread(fn: Callable[[], T], name: str = "torch-setup") -> T:
    """fn() on a new thread that exits when it returns (taking its OpenMP team with it);
    its result, or what it raised."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn())
        except BaseException as e:
            error.append(e)

    thread = threading.Thread(target=run, name=name)
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def threads_per_worker(cores: int, workers: int) -> int:
    """Torch threads for each of `workers` engine workers sharing `cores`: an even split, at least 1.

    Workers that each took every core would run 2x (or more) as many spinning OpenMP threads
    as there are cores; measured on 2 cores, 1P+1D (int8, C=8): 2 threads each gave TPOT p50
    51 ms, 1 each 45 ms."""
    return max(1, cores // max(1, workers))
