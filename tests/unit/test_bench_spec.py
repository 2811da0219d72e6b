"""`tandem bench spec` without the real model: its workloads, and one measurement on a tiny engine
(the JSON keys the issue names; no speed is asserted)."""

from __future__ import annotations

from dataclasses import replace

from bench.spec_bench import measure, measure_staggered, workloads
from cli.main import BENCHES
from engine.engine import Engine
from engine.model import LlamaModel
from tests.unit.tiny import make_engine


def test_four_workloads_of_sixteen_prompts() -> None:
    assert "spec" in BENCHES
    w = workloads()
    assert list(w) == ["summarize", "code_edit", "agentic", "chat"]
    assert all(len(msgs) == 16 for msgs in w.values())


def test_one_workload_measured_off_and_on(tiny_model: LlamaModel) -> None:
    off = make_engine(tiny_model, num_blocks=512)
    on = Engine(tiny_model, None, replace(off.config, speculative="ngram"))
    prompts = [[(i * 3 + j) % 7 + 1 for j in range(20)] for i in range(16)]  # repetitive: drafts
    r = measure({"off": off, "on": on}, prompts, max_tokens=8)
    assert {"single_speedup", "batch16_speedup", "acceptance_rate", "mean_accepted_len"} <= set(r)
    assert r["off_single_tok_s"] > 0 and r["on_batch16_tok_s"] > 0
    for e in (off, on):
        e.check_integrity()


def test_staggered_arrivals_measured_off_and_on_with_the_same_tokens(tiny_model: LlamaModel) -> None:
    """Prompts arriving while others decode (steps mix prefills, decodes and drafts): the fp32
    tiny model computes a row alike in any step, so every request's greedy tokens match."""
    off = make_engine(tiny_model, num_blocks=512, max_prefill_chunk=8)
    on = Engine(tiny_model, None, replace(off.config, speculative="ngram"))
    prompts = [[(i * 3 + j) % 7 + 1 for j in range(20)] for i in range(6)]
    r = measure_staggered({"off": off, "on": on}, prompts, max_tokens=12, gap_s=0.002)
    assert r["identical"] == r["requests"] == 6 and r["off_tok_s"] > 0 and r["on_latency_s"] > 0
    assert on.speculator is not None and on.speculator.drafted > 0
    for e in (off, on):
        e.check_integrity()
