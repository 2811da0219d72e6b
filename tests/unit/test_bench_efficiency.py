"""`tandem bench efficiency` without Ray or the real model: the ratio arithmetic on known numbers,
the JSON's keys, the arguments, the workload, and the baseline's step classification on a tiny engine."""

from __future__ import annotations

import pytest

from bench.efficiency import engine_wave, main, parser, prompts, request_count
from bench.efficiency_figures import (
    CONCURRENCIES,
    DEFINITIONS,
    MODES,
    NUM_BLOCKS,
    best_of,
    engine_figures,
    mode_report,
    ratio,
    report,
    served_figures,
)
from bench.stats import SLO, RequestResult, summarize
from cli.main import BENCHES
from engine.model import LlamaModel
from tests.unit.tiny import make_engine


def engine_at(tok_s: float, step_s: float) -> dict[str, object]:
    return {"output_tok_s": tok_s, "step_p50_s": step_s}


def served_at(tok_s: float, tpot_s: float | None) -> dict[str, object]:
    return {"output_tok_s": tok_s, "tpot_p50_s": tpot_s, "failed": 0}


ENGINE = {1: engine_at(50.0, 0.02), 8: engine_at(200.0, 0.025), 32: engine_at(400.0, 0.05)}


def test_efficiency_and_tpot_over_step_are_ratios_to_the_engine_at_the_same_c() -> None:
    served = {1: served_at(40.0, 0.025), 8: served_at(180.0, 0.030), 32: served_at(320.0, 0.070)}
    r = mode_report(served, ENGINE)
    assert r["efficiency_c8"] == pytest.approx(0.9)
    assert r["efficiency_c32"] == pytest.approx(0.8)
    assert r["tpot_over_step_c8"] == pytest.approx(1.2)
    assert r["tpot_over_step_c32"] == pytest.approx(1.4)
    assert list(r["by_concurrency"]) == ["1", "8", "32"]
    c1 = r["by_concurrency"]["1"]
    assert c1["efficiency"] == pytest.approx(0.8) and c1["tpot_over_step"] == pytest.approx(1.25)
    assert c1["engine_output_tok_s"] == 50.0 and c1["engine_step_p50_s"] == 0.02 and c1["failed"] == 0
    assert r["meets_targets"] is False  # C=32: 0.8 < 0.85


def test_serving_efficiency_is_against_the_engine_run_with_the_cluster_up() -> None:
    """The second baseline splits the loss: the cluster's standing cost, then serving's own."""
    served = {8: {**served_at(180.0, 0.030), "engine_cluster_up_tok_s": 190.0}, 32: served_at(320.0, 0.070)}
    r = mode_report(served, ENGINE)
    assert r["efficiency_c8"] == pytest.approx(0.9)  # the headline stays against the engine alone
    assert r["serving_efficiency_c8"] == pytest.approx(180.0 / 190.0)
    assert r["by_concurrency"]["8"]["serving_efficiency"] == pytest.approx(180.0 / 190.0)
    assert r["serving_efficiency_c32"] is None  # no such run: no ratio
    assert r["meets_targets"] is False


def test_meets_targets_only_when_every_headline_ratio_does() -> None:
    good = {8: served_at(170.0, 0.030), 32: served_at(340.0, 0.060)}  # 0.85, 0.85; 1.2, 1.2
    assert mode_report(good, ENGINE)["meets_targets"] is True
    slow_tpot = {8: served_at(170.0, 0.031), 32: served_at(340.0, 0.060)}
    assert mode_report(slow_tpot, ENGINE)["meets_targets"] is False
    dropped = {**good, 1: {**served_at(50.0, 0.02), "failed": 1}}
    assert mode_report(dropped, ENGINE)["meets_targets"] is False
    missing = mode_report({8: served_at(170.0, 0.030)}, ENGINE)
    assert missing["efficiency_c32"] is None and missing["meets_targets"] is False


def test_a_ratio_without_a_baseline_or_a_figure_is_none() -> None:
    assert ratio(3.0, 2.0) == 1.5
    assert ratio(None, 2.0) is None and ratio(1.0, None) is None and ratio(1.0, 0.0) is None
    r = mode_report({8: served_at(100.0, None)}, {8: engine_at(200.0, None)})  # type: ignore[arg-type]
    assert r["efficiency_c8"] == 0.5 and r["tpot_over_step_c8"] is None


def test_engine_figures_from_tokens_seconds_and_steady_steps() -> None:
    f = engine_figures(640, 4.0, [0.03, 0.01, 0.02])
    assert f == {"output_tokens": 640, "seconds": 4.0, "output_tok_s": 160.0, "step_p50_s": pytest.approx(0.02),
                 "step_mean_s": pytest.approx(0.02), "steady_steps": 3}  # fmt: skip
    none = engine_figures(0, 0.0, [])
    assert none["output_tok_s"] == 0.0 and none["step_p50_s"] is None and none["steady_steps"] == 0


def test_the_baseline_keeps_per_c_the_faster_of_its_runs() -> None:
    before = {8: engine_figures(1024, 8.0, [0.03]), 32: engine_figures(4096, 10.0, [0.09])}
    after = {8: engine_figures(1024, 4.0, [0.02]), 32: engine_figures(4096, 20.0, [0.30])}
    best = best_of(before, after)
    assert best[8]["output_tok_s"] == 256.0 and best[8]["step_p50_s"] == pytest.approx(0.02)
    assert best[32]["output_tok_s"] == 409.6 and best[32]["step_p50_s"] == pytest.approx(0.09)
    assert best[8]["runs_output_tok_s"] == [128.0, 256.0] and best[32]["runs_output_tok_s"] == [409.6, 204.8]


def test_served_figures_take_output_rate_and_medians_from_the_summary() -> None:
    results = [
        RequestResult(ok=True, start=0.0, ttft=0.5, e2e=0.5 + 63 * 0.04, prompt_tokens=256, output_tokens=64),
        RequestResult(ok=True, start=0.1, ttft=0.7, e2e=0.7 + 63 * 0.06, prompt_tokens=256, output_tokens=64),
        RequestResult(ok=False, start=0.2, error="HTTP 503: busy"),
    ]
    f = served_figures(summarize(results, 4.0, SLO()))
    assert f["output_tok_s"] == pytest.approx(32.0)
    assert f["tpot_p50_s"] == pytest.approx(0.05) and f["ttft_p50_s"] == pytest.approx(0.6)
    assert (f["requests"], f["completed"], f["failed"], f["errors"]) == (3, 2, 1, ["HTTP 503: busy"])
    assert served_figures(summarize([], 0.0, SLO()))["tpot_p50_s"] is None


def test_report_has_the_keys_the_issue_asks_for() -> None:
    served = {m: {c: served_at(100.0, 0.03) for c in CONCURRENCIES} for m in MODES}
    meta = {"colocated": {"dtype": "bf16", "threads": 2}, "pd": {"dtype": "bf16", "threads": 1}}
    res = report({m: ENGINE for m in MODES}, served, meta, quick=True, elapsed_s=12.5)
    assert set(res) == {"colocated", "pd", "engine", "definitions", "quick", "elapsed_s"}
    for mode in ("colocated", "pd"):
        assert {"efficiency_c8", "efficiency_c32", "tpot_over_step_c8", "by_concurrency"} <= set(res[mode])
    assert res["engine"]["pd"]["threads"] == 1 and set(res["engine"]["pd"]["by_concurrency"]) == {"1", "8", "32"}
    assert res["quick"] is True and res["elapsed_s"] == 12.5
    assert {"efficiency", "tpot_over_step", "threads", "workload", "targets"} <= set(res["definitions"])
    assert {"serving_efficiency", "engine_cluster_up_tok_s"} <= set(res["definitions"])
    assert {"serving_efficiency_c8", "serving_efficiency_c32"} <= set(res["colocated"])
    assert res["definitions"] is DEFINITIONS


def test_request_counts_and_prompts() -> None:
    assert [request_count(c, quick=True) for c in CONCURRENCIES] == [8, 16, 64]
    assert [request_count(c, quick=False) for c in CONCURRENCIES] == [48, 48, 128]
    a, b = prompts(4, seed=0, salt=8), prompts(4, seed=0, salt=32)
    assert a == prompts(4, seed=0, salt=8) and len(set(a)) == 4
    assert all(len(p.split()) == 256 for p in a)
    assert all(p.split()[:8] != q.split()[:8] for p in a for q in b)  # no shared prefix


def test_arguments_and_registration() -> None:
    args = parser().parse_args([])
    assert (args.quick, args.json, args.out, args.dtype, args.threads) == (
        False, False, "out/bench/efficiency", "auto", 0)  # fmt: skip
    assert args.num_blocks == NUM_BLOCKS
    args = parser().parse_args(["--quick", "--json", "--out", "x", "--dtype", "int8", "--threads", "1"])
    assert (args.quick, args.json, args.out, args.dtype, args.threads) == (True, True, "x", "int8", 1)
    with pytest.raises(SystemExit):
        parser().parse_args(["--dtype", "fp8"])
    assert BENCHES["efficiency"] == "bench.efficiency"
    assert main(["--threads", "-1"]) == 2  # refused before anything starts


def test_engine_wave_times_only_the_steps_where_the_whole_batch_decodes(tiny_model: LlamaModel) -> None:
    # a budget of 8 tokens admits the three 5-token prompts over three steps (a prompt is not
    # cut before 16 keys while it fits a step's budget: Scheduler._chunk):
    #   step 1  A prefill (first token)               outputs A1        not steady
    #   step 2  A decode + B prefill                  outputs A2 B1     not steady
    #   step 3  A, B decode + C prefill               outputs A3 B2 C1  not steady
    #   steps 4-6  all three decode                   outputs A B C     steady (A ends at 6)
    #   steps 7-9  B, C decode                        outputs B C       not steady
    engine = make_engine(tiny_model, max_num_batched_tokens=8)
    batch = [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10], [11, 12, 13, 14, 15]]
    tokens, steady = engine_wave(engine, batch, max_tokens=6)
    assert tokens == 18 and len(steady) == 3
    assert not engine.has_unfinished()
    engine.check_integrity()
