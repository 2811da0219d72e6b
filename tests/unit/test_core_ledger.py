"""engine.core_ledger: the workers of a host lend their cores while idle; the engine loop sizes
each step's team from the ledger."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from engine.config import EngineConfig
from engine.core_ledger import _SLOT, SLOTS, CoreLedger, ledger_path
from engine.engine import Engine
from engine.loop import EngineLoop
from engine.model import LlamaModel
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_an_idle_worker_lends_its_threads_to_a_busy_one(tmp_path: Path) -> None:
    path = tmp_path / "cores"
    p, d = CoreLedger(path, 1, cores=2), CoreLedger(path, 1, cores=2)  # 1P+1D x 1 thread on 2 cores
    assert p.slot != d.slot
    assert d.claim() == 2  # the prefill worker is idle: decode steps on both cores
    assert p.claim() == 1  # both busy: the split
    assert d.claim() == 1
    assert (d.lent_steps, p.lent_steps) == (1, 0)
    p.release()
    assert d.claim() == 2
    d.release()
    assert p.claim() == 2
    for ledger in (p, d):
        ledger.check_integrity()


def test_three_workers_on_two_cores_never_take_more_than_the_host_has(tmp_path: Path) -> None:
    path = tmp_path / "cores"
    a, b, c = (CoreLedger(path, 1, cores=2) for _ in range(3))  # threads_per_worker(2, 3) = 1 each
    assert a.claim() == 2
    assert b.claim() == 1 and a.claim() == 1
    assert c.claim() == 1  # 3 busy on 2 cores: never below the base
    b.release()
    c.release()
    assert a.claim() == 2


def test_unequal_bases_share_the_idle_cores_in_proportion(tmp_path: Path) -> None:
    path = tmp_path / "cores"
    big, small, idle = CoreLedger(path, 4, cores=8), CoreLedger(path, 2, cores=8), CoreLedger(path, 2, cores=8)
    assert big.claim() == 8
    assert small.claim() == 2 and big.claim() == 5  # 8 x 4 // 6; small: 8 x 2 // 6 = 2
    idle.check_integrity()


def test_a_worker_with_every_core_gets_no_more(tmp_path: Path) -> None:
    alone = CoreLedger(tmp_path / "cores", 2, cores=2)
    assert alone.claim() == 2
    alone.release()
    assert alone.claim() == 2


def test_a_dead_workers_busy_slot_lends_its_cores_and_is_taken_over(tmp_path: Path) -> None:
    path = tmp_path / "cores"
    d = CoreLedger(path, 1, cores=2)
    with open(path, "r+b") as f:  # a worker killed mid-step: its slot says busy
        f.seek(((d.slot + 1) % SLOTS) * _SLOT.size)
        f.write(_SLOT.pack(dead_pid(), 1, 1))
    assert d.claim() == 2  # its flag is not believed
    newcomer = CoreLedger(path, 1, cores=2)
    assert newcomer.slot == (d.slot + 1) % SLOTS  # the replacement takes the dead worker's slot
    assert newcomer.claim() == 1 and d.claim() == 1


def test_close_frees_the_slot_and_the_last_removes_the_file(tmp_path: Path) -> None:
    path = tmp_path / "cores"
    a, b = CoreLedger(path, 1, cores=2), CoreLedger(path, 1, cores=2)
    a.claim()
    assert b.claim() == 1
    a.close()
    assert a.claim() == 1  # closed: its base, and no read of an unmapped file
    a.release()
    assert b.claim() == 1  # a worker that left takes its cores with it: the split was for it too
    assert path.exists()
    b.close()
    b.close()  # twice is harmless
    assert not path.exists()
    assert CoreLedger(path, 1, cores=2).claim() == 1  # a new one starts the file again


def test_a_full_ledger_and_a_bad_base_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "cores"
    held = [CoreLedger(path, 1) for _ in range(SLOTS)]
    with pytest.raises(RuntimeError, match="slots are taken"):
        CoreLedger(path, 1)
    for ledger in held:
        ledger.close()
    with pytest.raises(ValueError, match="base threads"):
        CoreLedger(path, 0)


def test_check_integrity_finds_a_slot_another_process_overwrote(tmp_path: Path) -> None:
    path = tmp_path / "cores"
    a = CoreLedger(path, 1, cores=2)
    with open(path, "r+b") as f:
        f.seek(a.slot * _SLOT.size)
        f.write(_SLOT.pack(a.pid + 1, 1, 0))
    with pytest.raises(AssertionError, match="holds pid"):
        a.check_integrity()


def test_the_ledger_name_is_one_file_per_namespace() -> None:
    assert ledger_path("bench/x y").name == "tandem-cores-bench_x_y"
    assert ledger_path("a") != ledger_path("b")


class RecordingShare:
    """A CoreShare that records the loop's calls and lends `threads` to each step."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self.calls: list[str] = []
        self.step_threads: list[int] = []

    def claim(self) -> int:
        self.calls.append("claim")
        return self.threads

    def release(self) -> None:
        self.calls.append("release")


class ThreadsSeen(Engine):
    """The engine, noting the team size each step runs with."""

    seen: list[int]

    def step(self) -> list[RequestOutput]:
        self.seen.append(torch.get_num_threads())
        return super().step()


def test_the_loop_claims_before_each_step_and_releases_when_idle(tiny_model: LlamaModel) -> None:
    engine = ThreadsSeen(tiny_model, None, EngineConfig(dtype="fp32", block_size=4, num_blocks=64))
    engine.seen = []
    lent = torch.get_num_threads() + 1  # not what the loop's thread starts with
    share = RecordingShare(lent)
    loop = EngineLoop(engine)
    loop.cores = share
    loop.start()
    try:
        params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
        stream = loop.open("r", lambda: engine.add_request("r", [1, 2, 3], params))
        list(stream.iterate(timeout=5))
        end = time.monotonic() + 5
        while share.calls[-1] != "release" and time.monotonic() < end:
            time.sleep(0.01)
        loop.check_integrity()
    finally:
        loop.stop()
    assert loop.steps >= 3 and share.calls.count("claim") == loop.steps
    runs = [c for i, c in enumerate(share.calls) if i == 0 or c != share.calls[i - 1]]
    assert runs == ["release", "claim", "release"]  # idle, every step of the request, idle again
    assert engine.seen == [lent] * loop.steps  # each step ran on the team the share lent
    assert torch.get_num_threads() == lent - 1  # on the loop's thread only
