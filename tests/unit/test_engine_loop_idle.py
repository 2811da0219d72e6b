"""An idle EngineLoop sleeps until it is given work: it never polls, and it never misses a wake."""

from __future__ import annotations

import threading
import time

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loop import BLOCKED_POLL_S, EngineLoop
from engine.model import LlamaModel
from engine.sampling_params import SamplingParams


class CountingEngine(Engine):
    """The engine, counting how often the loop looks for work."""

    looks = 0

    def has_unfinished(self) -> bool:
        self.looks += 1
        return super().has_unfinished()


def test_an_idle_loop_does_not_poll_and_wakes_for_each_request(tiny_model: LlamaModel) -> None:
    engine = CountingEngine(tiny_model, None, EngineConfig(dtype="fp32", block_size=4, num_blocks=64))
    loop = EngineLoop(engine).start()
    try:
        time.sleep(0.5)
        assert engine.looks == 1  # one look, then asleep (it polled 20 times a second)
        params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
        for i in range(3):  # each request on an idle loop completes without a poll to find it
            stream = loop.open(f"r{i}", lambda i=i: engine.add_request(f"r{i}", [1, 2, 3, i], params))
            outs = list(stream.iterate(timeout=5))
            assert outs[-1].finished and sum(len(o.new_token_ids) for o in outs) == 4
            loop.check_integrity()
        looks = engine.looks  # the loop may not have taken its look after the last output yet
        time.sleep(0.3)
        assert engine.looks <= looks + 1
        ran = threading.Event()
        loop.later(lambda e: ran.set())
        assert ran.wait(5)
    finally:
        t = time.monotonic()
        loop.stop()
    assert time.monotonic() - t < 1.0  # stop wakes it too


def test_a_request_waiting_for_blocks_held_elsewhere_does_not_spin_the_loop(tiny_model: LlamaModel) -> None:
    """A reservation (or a prefill's hand-offs) holds the blocks a waiting request needs: the
    loop looks again every BLOCKED_POLL_S, not at every turn (it stepped at nothing, 57,747
    times in 0.5 s here, a core's worth, while the transfer that would free them waited for CPU)."""
    engine = Engine(tiny_model, None, EngineConfig(dtype="fp32", block_size=4, num_blocks=8))
    loop = EngineLoop(engine)
    loop.call(lambda e: e.reserve("held", 28))  # 7 of the 8 blocks
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    stream = loop.open("r", lambda: engine.add_request("r", list(range(1, 10)), params))
    loop.start()
    try:
        time.sleep(0.5)
        assert loop.steps <= 0.5 / BLOCKED_POLL_S, f"{loop.steps} steps at nothing in 0.5 s"
        loop.call(lambda e: e.release("held"))
        outs = list(stream.iterate(timeout=10))
        assert outs[-1].finish_reason == "length" and sum(len(o.new_token_ids) for o in outs) == 4
        loop.check_integrity()
    finally:
        loop.stop()
