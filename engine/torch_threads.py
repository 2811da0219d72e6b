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

import ctypes
import functools
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import torch

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


def oversubscribed(threads: int, workers: int, cores: int) -> str | None:
    """What to tell an operator who gave `workers` workers of one host `threads` threads each,
    more than its `cores` (threads_per_worker's measure of the cost), or None."""
    if threads * workers <= cores:
        return None
    return (f"--threads {threads} x {workers} worker(s) = {threads * workers} threads on this host's {cores} "
            "cores: their OpenMP threads will contend (leave --threads out to split the cores)")  # fmt: skip


def set_team_size(n: int) -> None:
    """This thread's OpenMP team for torch's ops from now on (torch.get_num_threads() reads it, and
    so do the native kernels), leaving torch's process-wide count as it was. torch.set_num_threads
    sets both, and a thread that runs its first parallel op later starts its team from that count:
    a decode worker's KV receiver threads would then take teams of 2 from a loop lent 2 threads,
    and two teams on 2 cores stop libgomp's spinning (above). Where torch runs on no libgomp,
    torch.set_num_threads."""
    omp_set_num_threads = _libgomp_setter()
    if omp_set_num_threads is None:
        torch.set_num_threads(n)
        return
    torch.get_num_threads()  # this thread's first use sets its team from torch's count: before, not after
    omp_set_num_threads(n)


@functools.cache
def _libgomp_setter() -> Callable[[int], None] | None:
    """omp_set_num_threads of the libgomp torch loaded (torch's wheel bundles its own), or None."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps.splitlines() if "libgomp" in line and "/" in line}
    torch_dir = str(Path(torch.__file__).parent)
    for path in sorted(paths, key=lambda p: not p.startswith(torch_dir)):  # torch's own first
        try:
            fn = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], None
        return fn  # type: ignore[no-any-return]
    return None
