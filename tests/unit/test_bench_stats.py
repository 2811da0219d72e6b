"""Benchmark arithmetic on synthetic latencies with known answers, and the shapes of the workload mixes."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from bench.stats import (
    SLO,
    RequestResult,
    attainment,
    breakdown,
    distribution,
    goodput,
    hit_rate,
    max_rate_meeting,
    percentile,
    summarize,
)
from bench.workloads import MIXES, WORDS, LengthDist, load_jsonl, make_items


def ok(ttft: float, e2e: float, tokens: int, **kw: object) -> RequestResult:
    return RequestResult(ok=True, start=0.0, ttft=ttft, e2e=e2e, output_tokens=tokens, **kw)  # type: ignore[arg-type]


def test_percentiles_interpolate_like_numpy() -> None:
    xs = [float(i) for i in range(1, 11)]  # 1..10, shuffled order must not matter
    assert percentile(list(reversed(xs)), 50) == pytest.approx(5.5)
    assert percentile(xs, 90) == pytest.approx(9.1)
    assert percentile(xs, 99) == pytest.approx(9.91)
    assert percentile(xs, 0) == 1.0 and percentile(xs, 100) == 10.0
    assert percentile([3.0], 99) == 3.0
    assert distribution([1.0, 2.0, 3.0, 4.0]) == pytest.approx({"mean": 2.5, "p50": 2.5, "p90": 3.7, "p99": 3.97})
    assert distribution([]) is None
    with pytest.raises(ValueError):
        percentile([], 50)


def test_tpot_is_decode_time_per_token_after_the_first() -> None:
    assert ok(0.5, 2.0, 16).tpot == pytest.approx(0.1)
    assert ok(0.5, 0.5, 1).tpot is None  # one token: no inter-token time
    assert RequestResult(ok=False, start=0.0, e2e=1.0, output_tokens=5).tpot is None


def test_slo_attainment_and_goodput_count_every_request_sent() -> None:
    slo = SLO(ttft_s=1.0, tpot_s=0.1)
    results = [
        ok(0.5, 0.5 + 9 * 0.05, 10),  # meets both
        ok(1.0, 1.0 + 9 * 0.1, 10),  # exactly on both bounds: meets
        ok(0.2, 0.2, 1),  # one token: only TTFT applies
        ok(1.5, 1.6, 10),  # TTFT too slow
        ok(0.1, 0.1 + 9 * 0.2, 10),  # TPOT too slow
        RequestResult(ok=False, start=0.0, error="HTTP 503"),  # failed: a miss
    ]
    assert [slo.met(r) for r in results] == [True, True, True, False, False, False]
    assert attainment(results, slo) == pytest.approx(0.5)
    assert goodput(results, slo, duration_s=2.0) == pytest.approx(1.5)
    assert attainment(results, SLO()) == pytest.approx(5 / 6)  # no bounds: success rate
    assert SLO(0.5, None).scaled(4) == SLO(2.0, None)
    s = summarize(results, 2.0, slo)
    assert s["completed"] == 5 and s["failed"] == 1 and s["errors"] == ["HTTP 503"]
    assert s["throughput_rps"] == pytest.approx(2.5) and s["output_tok_s"] == pytest.approx(41 / 2)
    assert s["goodput_rps"] == pytest.approx(1.5) and s["slo_attainment"] == pytest.approx(0.5)
    assert s["ttft_s"]["p50"] == pytest.approx(0.5)


def test_highest_rate_meeting_the_target() -> None:
    # passes at 1 and 2, fails at 3: attainment crosses 0.9 halfway from 2 (0.95) to 3 (0.85)
    assert max_rate_meeting([(3.0, 0.85), (1.0, 1.0), (2.0, 0.95)]) == pytest.approx(2.5)
    assert max_rate_meeting([(1.0, 0.8), (2.0, 0.95)]) == 0.0  # the lowest rate already fails
    assert max_rate_meeting([(1.0, 1.0), (2.0, 0.9)]) == 2.0  # none fails: the highest, a lower bound
    # a lucky point past the first failure does not count
    assert max_rate_meeting([(1.0, 1.0), (2.0, 0.8), (3.0, 0.95)]) == pytest.approx(1.5)
    assert max_rate_meeting([]) == 0.0


def test_server_breakdown_and_hit_rate() -> None:
    t = {"queue_s": 0.1, "prefill_s": 0.2, "transfer_s": 0.01, "decode_s": 1.0}
    results = [
        ok(0.3, 1.3, 10, prompt_tokens=100, timing={**t, "cached_tokens": 64}),
        ok(0.3, 1.3, 10, prompt_tokens=100, timing={**t, "queue_s": 0.3, "cached_tokens": 0}),
    ]
    b = breakdown(results)
    assert b is not None and b["queue_s"]["mean"] == pytest.approx(0.2) and b["queue_s"]["p90"] == pytest.approx(0.28)
    assert b["transfer_s"] == pytest.approx({"mean": 0.01, "p90": 0.01})
    assert hit_rate(results) == pytest.approx(0.32)
    assert breakdown([ok(0.1, 0.2, 2)]) is None and hit_rate([ok(0.1, 0.2, 2)]) is None


def test_mixes_are_seeded() -> None:
    for mix in MIXES.values():
        a, b = make_items(mix, 30, seed=7), make_items(mix, 30, seed=7)
        assert a == b
        assert a != make_items(mix, 30, seed=8)
        salted = make_items(mix, 30, seed=7, salt=1)
        assert [(i.new_tokens, i.max_tokens) for i in salted] == [(i.new_tokens, i.max_tokens) for i in a]
        assert salted[0].messages != a[0].messages  # same shapes, other text


@pytest.mark.parametrize("name", sorted(MIXES))
def test_mixes_have_their_length_shapes(name: str) -> None:
    mix = MIXES[name]
    items = make_items(mix, 400, seed=0)
    for _, shape in mix.classes:
        ins = [i.new_tokens for i in items if i.cls == shape.name]
        outs = [i.max_tokens for i in items if i.cls == shape.name]
        assert shape.input.lo <= min(ins) and max(ins) <= shape.input.hi
        assert shape.output.lo <= min(outs) and max(outs) <= shape.output.hi
        assert statistics.median(ins) == pytest.approx(shape.input.median, rel=0.15)
        assert statistics.median(outs) == pytest.approx(shape.output.median, rel=0.15)
    assert {i.cls for i in items} == {shape.name for _, shape in mix.classes}
    last = items[0].messages[-1]
    assert last[0] == "user" and len(last[1].split()) == items[0].new_tokens
    assert set(last[1].split()) <= set(WORDS)


def test_mix_shapes_relative_to_each_other() -> None:
    def medians(name: str) -> tuple[float, float]:
        items = make_items(MIXES[name], 300, seed=1)
        return statistics.median(i.new_tokens for i in items), statistics.median(i.max_tokens for i in items)

    chat_in, chat_out = medians("chat")
    sum_in, sum_out = medians("summarize")
    code_in, code_out = medians("code")
    assert sum_in > 10 * sum_out and sum_in > 3 * chat_in  # long in, short out
    assert chat_in < code_in < sum_in and code_out < chat_out  # medium in, short out
    assert 0.5 < chat_in / chat_out < 2  # ShareGPT: answers about as long as questions


def test_multiturn_conversations_grow_a_shared_prefix() -> None:
    mix = MIXES["multiturn"]
    items = make_items(mix, 60, seed=3, active=4)
    assert len(items) == 60
    by_conv: dict[int, list[int]] = {}
    for pos, it in enumerate(items):
        assert it.conv >= 0 and it.messages[0][0] == "system"
        assert it.messages[0] == items[0].messages[0]  # one system prompt for the workload
        assert len(it.messages[0][1].split()) == mix.system
        if it.turn > 0:
            prev = items[by_conv[it.conv][-1]]
            assert prev.turn == it.turn - 1  # the turn before was sent earlier
            assert it.messages[: len(prev.messages)] == prev.messages  # and is a prefix of this one
            assert it.messages[len(prev.messages)][0] == "assistant"
            assert len(it.messages[len(prev.messages)][1].split()) == prev.max_tokens
        by_conv.setdefault(it.conv, []).append(pos)
    assert [it.conv for it in items[:4]] == [0, 1, 2, 3]  # four users' conversations interleave
    full = make_items(mix, 10_000, seed=3)
    turns = [sum(1 for it in full if it.conv == c) for c in {it.conv for it in full}]
    assert min(turns) >= mix.turns[0] and max(turns) <= mix.turns[1]


def test_scaled_mixes_and_length_validation() -> None:
    small = MIXES["summarize"].scaled(input=0.5, output=0.25)
    assert small.input == LengthDist(600, 0.35, 256, 1500) and small.output == LengthDist(16, 0.4, 4, 40)
    with pytest.raises(ValueError):
        LengthDist(10, 0.5, 20, 30)


def test_jsonl_prompts(tmp_path: Path) -> None:
    p = tmp_path / "p.jsonl"
    lines = [{"prompt": "hello", "max_tokens": 5}, {"messages": [{"role": "user", "content": "hi"}]}]
    p.write_text("\n".join(json.dumps(x) for x in lines) + "\n\n")
    a, b = load_jsonl(p, default_max_tokens=7)
    assert (a.chat, a.prompt, a.max_tokens) == (False, "hello", 5)
    assert (b.chat, b.message_dicts(), b.max_tokens) == (True, [{"role": "user", "content": "hi"}], 7)
    p.write_text('{"prompt": "ok"}\n{"text": "no"}\n')
    with pytest.raises(ValueError, match=r"p.jsonl:2"):
        load_jsonl(p)


def test_plots_write_pngs(tmp_path: Path) -> None:
    from bench import plots

    results = [ok(0.1 * i, 0.1 * i + 1.0, 11) for i in range(1, 6)]
    a = plots.latency_cdfs({"x": results, "empty": []}, tmp_path / "cdf.png", SLO(0.3, 0.1), "t")
    b = plots.attainment_vs_rate({"mix": {"s1": [(2.0, 0.5), (1.0, 1.0)], "s2": []}}, tmp_path / "sub" / "a.png")
    for p in (a, b):
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
