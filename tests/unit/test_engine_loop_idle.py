"""An idle EngineLoop sleeps until it is given work: it never polls, and it never misses a wake."""

from __future__ import annotations

import threading
import time

from engine.config import EngineConfig
from engine.engine import Engine
from engine.loop import EngineLoop
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
