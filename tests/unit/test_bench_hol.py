"""`tandem bench hol` on a tiny engine: every length and cap measured, the engine left clean
(no speed is asserted)."""

from __future__ import annotations

import random

from bench.hol_bench import SHORT, measure, prompts
from cli.main import BENCHES
from engine.model import LlamaModel
from tests.unit.tiny import make_engine


def test_each_length_is_measured_capped_and_not(tiny_model: LlamaModel) -> None:
    assert BENCHES["hol"] == "bench.hol_bench"
    e = make_engine(tiny_model, num_blocks=256, enable_prefix_caching=False)
    got = measure(e, [40, 90], [0, 8], rounds=2)
    assert set(got) == {"40/0", "40/8", "90/0", "90/8"}
    assert all(set(v) == {"alone", "short", "long"} and min(v.values()) > 0 for v in got.values())
    e.check_integrity()
    assert e.kv.num_free_blocks == e.config.num_blocks


def test_the_prompts_are_a_long_one_alone_another_and_a_short_one() -> None:
    alone, long, short = prompts(random.Random(0), 128, 40)
    assert (len(alone), len(long), len(short)) == (40, 40, SHORT)
