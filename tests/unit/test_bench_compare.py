"""`tandem bench compare` without Ray: the interference mix's classes, per-class SLOs from each class's
latency alone on colocated serving, goodput counted against each request's own class, and the report."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from bench.compare import COLOCATED_1X2, COLOCATED_2X1, FULL, PD, QUICK, System, base_rate, engine_config, static_cores
from bench.compare_report import MixRun, class_slo, evaluate, print_report, write_plots
from bench.stats import SLO, ClassSLO, RequestResult, attainment, goodput
from bench.sweep import Point, Unloaded
from bench.workloads import MIXES, LengthDist, make_items

INTERFERENCE = MIXES["interference"]


def test_interference_is_one_long_prompt_in_four() -> None:
    assert [(share, shape.name) for share, shape in INTERFERENCE.classes] == [(0.75, "chat"), (0.25, "long-prompt")]
    items = make_items(INTERFERENCE, 400, seed=0)
    long = [i for i in items if i.cls == "long-prompt"]
    chat = [i for i in items if i.cls == "chat"]
    assert len(long) == 100 and len(chat) == 300
    assert all(1920 <= i.new_tokens <= 2176 and 16 <= i.max_tokens <= 32 for i in long)
    assert all(24 <= i.new_tokens <= 160 and i.max_tokens == 128 for i in chat)
    assert all(len(i.messages[-1][1].split()) == i.new_tokens for i in items)
    # every sweep point has the exact share, even a quick one of 4 or 8 requests, in seeded random order
    for n, k in ((4, 1), (8, 2), (12, 3), (32, 8)):
        assert all(sum(i.cls == "long-prompt" for i in make_items(INTERFERENCE, n, seed=s)) == k for s in range(10))
    where = {
        next(p for p, i in enumerate(make_items(INTERFERENCE, 4, seed=s)) if i.cls == "long-prompt") for s in range(20)
    }
    assert where == {0, 1, 2, 3}


def test_mixing_is_single_turn_with_shares_below_one() -> None:
    code, summarize = MIXES["code"], MIXES["summarize"]
    with pytest.raises(ValueError, match="shares"):
        replace(code, mixed_in=((1.0, summarize),))
    with pytest.raises(ValueError, match="single-turn"):
        replace(MIXES["multiturn"], mixed_in=((0.5, summarize),))
    with pytest.raises(ValueError, match="single-turn"):
        replace(code, mixed_in=((0.5, MIXES["multiturn"]),))
    assert code.classes == ((1.0, code),)  # a plain mix is one class, named after it
    assert {i.cls for i in make_items(MIXES["multiturn"], 20)} == {"multiturn"}
    assert INTERFERENCE.scaled(input=0.5).classes[1][1].input == LengthDist(1024, 0.03, 960, 1088)


def test_slos_are_scales_of_each_class_alone_on_the_best_colocated() -> None:
    one = {"chat": Unloaded(0.2, 0.02, 2.8), "long-prompt": Unloaded(2.0, 0.03, 2.7)}
    two = {"chat": Unloaded(0.3, 0.015, 2.5), "long-prompt": Unloaded(1.5, 0.04, 2.4)}
    assert class_slo([one, two], 5.0, 2.0).by_class == {"chat": SLO(1.0, 0.03), "long-prompt": SLO(7.5, 0.06)}
    assert base_rate(INTERFERENCE, one) == pytest.approx(1 / (0.75 * 2.8 + 0.25 * 2.7))


def result(cls: str, ttft: float, tpot: float, tokens: int = 11) -> RequestResult:
    return RequestResult(ok=True, start=0.0, ttft=ttft, e2e=ttft + tpot * (tokens - 1), output_tokens=tokens, cls=cls)


def test_each_request_is_held_to_its_own_class_slo() -> None:
    slo = ClassSLO({"chat": SLO(1.0, 0.05), "long-prompt": SLO(8.0, 0.1)})
    results = [
        result("chat", 0.5, 0.04),  # meets its SLO
        result("chat", 2.0, 0.04),  # a TTFT fine for a long prompt, not for a chat
        result("chat", 0.5, 0.08),  # a decode stalled behind a prefill
        result("long-prompt", 6.0, 0.08),  # meets its SLO
        result("long-prompt", 9.0, 0.05),  # too slow even for a long prompt
        RequestResult(ok=False, start=0.0, error="HTTP 503", cls="long-prompt"),
    ]
    assert [slo.met(r) for r in results] == [True, False, False, True, False, False]
    assert attainment(results, slo) == pytest.approx(2 / 6)
    assert goodput(results, slo, duration_s=4.0) == pytest.approx(0.5)
    with pytest.raises(KeyError):  # a class without an SLO is a bug, not a miss
        slo.met(result("code", 0.1, 0.01))


def test_every_plan_compares_equal_cores() -> None:
    for plan in (FULL, QUICK):
        assert {s.cores for s in plan.systems} == {2}
        assert list(plan.mixes) == ["prefill_heavy", "decode_heavy", "interference"]
    assert PD.cores == COLOCATED_1X2.cores == COLOCATED_2X1.cores == 2
    with pytest.raises(ValueError, match="equal cores"):
        replace(QUICK, systems=(COLOCATED_1X2, System("P/D 2t", 1, 1, 0, 2)))
    for bad in ({"requests": 0}, {"max_seconds": 0.0}):
        with pytest.raises(ValueError, match="--requests must be >= 1 and --max-seconds > 0"):
            replace(FULL, **bad)


def test_each_worker_runs_the_systems_threads_and_the_plans_speculation() -> None:
    config = engine_config(PD, QUICK)
    assert (config.num_threads, config.num_blocks, config.lend_cores, config.speculative) == (1, 512, True, "")
    assert not engine_config(static_cores(PD), QUICK).lend_cores
    assert engine_config(COLOCATED_1X2, replace(FULL, speculative="suffix")).speculative == "suffix"


def point(rate: float, chat_ttft: float) -> Point:
    """3 chats (128 tokens at 30 ms) and a long prompt (24 tokens at 50 ms), over 8 s."""
    results = [result("chat", chat_ttft, 0.03, tokens=128) for _ in range(3)]
    return Point(rate, [*results, result("long-prompt", 3.0, 0.05, tokens=24)], duration_s=8.0)


def test_report_has_the_goodput_ratio_and_the_slos_per_class(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    plan = replace(QUICK, mixes={"interference": INTERFERENCE})
    colocated = MixRun(
        {"chat": Unloaded(0.2, 0.02, 2.7), "long-prompt": Unloaded(2.0, 0.03, 2.7)},
        [point(0.2, 0.5), point(0.4, 2.0)],  # at 0.4 req/s the chats wait behind the long prefills
    )
    pd = MixRun(
        {"chat": Unloaded(0.1, 0.025, 3.3), "long-prompt": Unloaded(3.0, 0.04, 4.0)},  # P/D alone: not a reference
        [point(0.2, 0.5), point(0.4, 0.5)],
    )
    measured = {COLOCATED_1X2.name: {"interference": colocated}, PD.name: {"interference": pd}}
    res = evaluate(measured, plan, (5.0, 2.0))
    r = json.loads(json.dumps(res))["interference"]
    assert r["slo"]["classes"] == {
        "chat": {"ttft_s": 1.0, "tpot_s": 0.04},
        "long-prompt": {"ttft_s": 10.0, "tpot_s": 0.06},
    }
    assert (r["slo"]["ttft_scale"], r["slo"]["tpot_scale"], r["slo"]["target"]) == (5.0, 2.0, 0.9)
    colo_points = r["systems"][COLOCATED_1X2.name]["points"]
    assert [p["attainment"] for p in colo_points] == [1.0, 0.25]
    assert colo_points[1]["classes"]["chat"]["attainment"] == 0.0
    assert colo_points[1]["classes"]["long-prompt"]["attainment"] == 1.0
    assert colo_points[0]["goodput_rps"] == pytest.approx(0.5) and colo_points[1]["classes"]["chat"]["requests"] == 3
    colo = 0.2 + 0.2 * (1.0 - 0.9) / (1.0 - 0.25)  # where attainment crosses 90% between the two rates
    assert r["colocated_goodput_rps"] == pytest.approx(colo) and r["pd_goodput_rps"] == 0.4
    assert r["goodput_ratio"] == pytest.approx(0.4 / colo) and r["colocated_system"] == COLOCATED_1X2.name
    assert r["workload"]["classes"]["long-prompt"]["share"] == 0.25
    assert r["systems"][PD.name]["unloaded"]["chat"] == {"ttft_s": 0.1, "tpot_s": 0.025, "e2e_s": 3.3}
    meta = {"systems": [{"name": s.name, "cores": s.cores} for s in plan.systems]}
    print_report(res, meta)
    out = capsys.readouterr().out
    assert "equal cores on every system (workers x threads): colocated 1x2t 2, P/D 1P+1D 1t 2" in out
    assert "long-prompt (25%): SLO TTFT 10.000 s, TPOT 0.0600 s" in out and "goodput: 1.76x" in out
    files = write_plots(res, measured, tmp_path)
    names = ["compare_attainment.png", "compare_cdf_interference_chat.png", "compare_cdf_interference_long-prompt.png"]
    assert files == [str(tmp_path / n) for n in names]
