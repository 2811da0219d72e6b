"""The planner's simulator on tiny traces with hand-computed timelines, its step-cost fit, the
goodput search, and the planner's choices on synthetic costs where the answer is known."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from planner.kinds import parse_nodes
from planner.plan_cli import main as plan_main
from planner.profile import DecodePoint, EngineProfile, PrefillPoint
from planner.search import Handoff, NodeKind, cheapest, colocated, goodput, splits
from planner.simulator import ClusterSpec, WorkerSpec, simulate
from planner.slo import SLO, parse_slo
from planner.step_costs import StepCosts, attention_work
from planner.trace import Trace

# prefill 1 ms a token; decode 10 ms a step plus 10 ms a request in it
COSTS = StepCosts(0.0, 0.001, 0.0, 0.01, 0.0, 0.0)
BATCHED = StepCosts(0.0, 0.001, 0.0, 0.01, 0.01, 0.0)


def approx(xs: tuple[float, ...]) -> object:
    return pytest.approx(xs, abs=1e-9)


def pd(costs: StepCosts, fixed: float = 0.0, kv: int = 2048 * 16) -> ClusterSpec:
    w = WorkerSpec(costs, kv_tokens=kv)
    return ClusterSpec(prefill=(w,), decode=(w,), transfer_fixed_s=fixed)


def test_one_request_on_pd() -> None:
    # prefill 100 x 1 ms = 0.1 (first token); transfer 0.05; two decode steps of 0.01
    out = simulate(pd(COSTS, fixed=0.05), Trace.of([(0.0, 100, 0, 3, "")]))
    assert out.ttft == approx((0.1,))
    assert out.e2e == approx((0.17,))
    assert out.tpot == approx((0.035,))


HALF = StepCosts(0.0, 0.0005, 0.0, 0.005, 0.0, 0.0)  # COSTS on twice the threads


def test_a_worker_busy_alone_on_its_host_steps_on_its_peers_cores_too() -> None:
    # 1P+1D on one host, each at half its costs while the other is idle (engine/core_ledger.py).
    # A: prefill 0-0.05 (decode idle: lent), lands 0.10; B arrives 0.07, prefill lent 0.07-0.115
    # (decode still idle); A decodes 0.10-0.12 at full cost (prefill busy); B lands 0.165 and
    # decodes alone, lent, 0.165-0.175
    w = WorkerSpec(COSTS, host=0, lent=HALF)
    spec = ClusterSpec(prefill=(w,), decode=(w,), transfer_fixed_s=0.05)
    out = simulate(spec, Trace.of([(0.0, 100, 0, 3, "A"), (0.07, 90, 0, 3, "B")]))
    assert out.ttft == approx((0.05, 0.045))
    assert out.e2e == approx((0.12, 0.105))
    apart = replace(w, host=-1)  # each on a host of its own: nothing to borrow, `lent` unused
    out = simulate(ClusterSpec(prefill=(apart,), decode=(apart,), transfer_fixed_s=0.05),
                   Trace.of([(0.0, 100, 0, 3, "A")]))  # fmt: skip
    assert out.ttft == approx((0.1,)) and out.e2e == approx((0.17,))


def test_a_worker_steps_on_its_contended_costs_while_a_peer_on_its_host_is_busy() -> None:
    # 2 colocated workers of one host, each at twice its costs while the other is busy (memory
    # and caches shared). A (to w1) starts alone at 0: prefill 0.1; B (to w2) starts at 0 beside
    # it: prefill 0.2. A's one decode step at 0.1, B still prefilling: 0.02. B's at 0.2, alone: 0.01
    w = WorkerSpec(COSTS, host=0, contended=replace(COSTS, p1=0.002, d0=0.02))
    out = simulate(ClusterSpec(colocated=(w, w)), Trace.of([(0.0, 100, 0, 2, "A"), (0.0, 100, 0, 2, "B")]))
    assert out.ttft == approx((0.1, 0.2)) and out.e2e == approx((0.12, 0.21))
    lending = replace(w, lent=HALF)  # alone, each steps on both cores: A 0.05 + 0.02, B 0.2 + 0.005
    out = simulate(ClusterSpec(colocated=(lending, lending)), Trace.of([(0.0, 100, 0, 2, "A"), (0.0, 100, 0, 2, "B")]))
    assert out.ttft == approx((0.05, 0.2)) and out.e2e == approx((0.07, 0.205))
    apart = replace(w, host=-1)  # hosts of their own: nothing shared
    out = simulate(ClusterSpec(colocated=(apart, apart)), Trace.of([(0.0, 100, 0, 2, "A"), (0.0, 100, 0, 2, "B")]))
    assert out.ttft == approx((0.1, 0.1)) and out.e2e == approx((0.11, 0.11))


def test_prefill_chunks_under_the_token_budget_fifo() -> None:
    # the second request (3,000 tokens) waits for the first's step, then takes 2048 + 952 tokens
    out = simulate(pd(COSTS, fixed=0.05), Trace.of([(0.0, 100, 0, 3, ""), (0.0, 3000, 0, 2, "")]))
    assert out.ttft == approx((0.1, 0.1 + 2.048 + 0.952))
    assert out.e2e == approx((0.17, 3.1 + 0.05 + 0.01))


def test_decode_batches_join_at_step_boundaries() -> None:
    # A: first token 0.01, decodes alone 0.01-0.03 (a step of batch 1: 0.02); B's KV lands at 0.02,
    # mid-step, so it joins at 0.03: batch 2 until 0.06 (B's last), then A alone until 0.08
    out = simulate(pd(BATCHED), Trace.of([(0.0, 10, 0, 4, "A"), (0.0, 10, 0, 2, "B")]))
    assert out.ttft == approx((0.01, 0.02))
    assert out.e2e == approx((0.08, 0.06))
    assert out.tpot == approx(((0.08 - 0.01) / 3, 0.04))


def test_decode_step_reads_the_growing_context() -> None:
    costs = StepCosts(0.0, 0.001, 0.0, 0.0, 0.0, 0.001)  # 1 ms a token of context
    out = simulate(pd(costs), Trace.of([(0.0, 10, 0, 3, "")]))
    assert out.e2e == approx((0.01 + 0.011 + 0.012,))


def test_decode_waits_for_kv_room() -> None:
    # room for 20 tokens: A holds 14 (10 + 4), B needs 12, so B joins when A has finished at 0.07
    out = simulate(pd(BATCHED, kv=20), Trace.of([(0.0, 10, 0, 4, "A"), (0.0, 10, 0, 2, "B")]))
    assert out.e2e == approx((0.07, 0.09))


def test_cached_prompt_tokens_are_not_computed() -> None:
    costs = StepCosts(0.0, 0.001, 1e-6, 0.01, 0.0, 0.0)
    out = simulate(pd(costs), Trace.of([(0.0, 100, 60, 1, "")]))
    assert out.ttft == approx((40 * 0.001 + 1e-6 * attention_work(40, 60),))
    assert out.e2e == out.ttft  # one token: done at the prefill


def test_colocated_steps_mix_decodes_and_chunks() -> None:
    # step 1: A's prefill (0.1). step 2: A decodes + 2047 of B's tokens (0.01 + 2.047). step 3: A's
    # last token + B's last 953 tokens (0.01 + 0.953), B's first token. step 4: B decodes (0.01).
    w = WorkerSpec(COSTS, prefill_chunk=0)  # a prompt's chunk is cut by the budget only
    out = simulate(ClusterSpec(colocated=(w,)), Trace.of([(0.0, 100, 0, 3, ""), (0.0, 3000, 0, 2, "")]))
    assert out.ttft == approx((0.1, 0.1 + 2.057 + 0.963))
    assert out.e2e == approx((3.12, 3.13))


def test_a_short_prompt_behind_a_long_one_waits_one_chunk_not_all_of_it() -> None:
    # A (2,000 tokens) then B (100) arrive at 0 on one prefill worker, 1 ms a token; A's step
    # starts before B is there. Chunks of 512: A's 512 (0.512), A's 512 + B's 100 (1.124: B's
    # first token), A's 512, 464 (2.1). Uncapped: A's 2,000 (2.0), then B's 100 (2.1).
    trace = Trace.of([(0.0, 2000, 0, 1, ""), (0.0, 100, 0, 1, "")])
    for chunk, expect in ((512, (2.1, 1.124)), (0, (2.0, 2.1))):
        w = WorkerSpec(COSTS, prefill_chunk=chunk)
        assert simulate(ClusterSpec(prefill=(w,), decode=(w,)), trace).ttft == approx(expect)


def test_routing_spreads_requests_over_the_least_loaded() -> None:
    w = WorkerSpec(COSTS)
    out = simulate(ClusterSpec(colocated=(w, w)), Trace.of([(0.0, 100, 0, 1, ""), (0.0, 100, 0, 1, "")]))
    assert out.ttft == approx((0.1, 0.1))  # one each, not queued behind each other


def test_a_cluster_is_pd_or_colocated() -> None:
    w = WorkerSpec(COSTS)
    with pytest.raises(ValueError):
        ClusterSpec(prefill=(w,))
    with pytest.raises(ValueError):
        ClusterSpec(prefill=(w,), decode=(w,), colocated=(w,))


def test_fit_recovers_the_costs() -> None:
    truth = StepCosts(0.002, 1e-4, 1e-8, 0.015, 4e-4, 2e-6)
    prefill = [PrefillPoint(u, c, truth.prefill(u, attention_work(u, c))) for u, c in
               ((128, 0), (512, 0), (2048, 0), (128, 2048), (512, 2048))]  # fmt: skip
    decode = [DecodePoint(b, c, truth.decode(b, c)) for b, c in ((1, 136), (4, 544), (16, 2176), (1, 2056), (8, 8256))]
    fit = StepCosts.fit(EngineProfile("x", "measured", "m", "int8", "fp32", tuple(prefill), tuple(decode)))
    for got, want in zip(vars(fit).values(), vars(truth).values(), strict=True):
        assert got == pytest.approx(want, rel=1e-6)


def test_goodput_of_a_known_queue() -> None:
    # one worker, 0.1 s a request, evenly spaced arrivals, TTFT SLO 0.15 s: at up to 10/s none
    # queues; a little past it, the queue grows by (0.1 - 1/rate) a request
    trace = Trace.of([(i * 1.0, 100, 0, 1, "") for i in range(100)])
    g = goodput(colocated(NodeKind("n", WorkerSpec(COSTS)), 1), trace, SLO(0.15, 1.0))
    assert 10.0 <= g <= 10.2


def kind(costs: StepCosts, name: str = "n", price: float = 1.0, available: int | None = None) -> NodeKind:
    return NodeKind(name, WorkerSpec(costs), price, available)


def best_split(costs: StepCosts, trace: Trace, slo: SLO) -> tuple[int, int]:
    options = splits(kind(costs), 4, trace, slo, Handoff(0.0, 0.0))
    assert [o.goodput for o in options] == sorted((o.goodput for o in options), reverse=True)
    best = next(o for o in options if not o.colocated)
    return best.prefill, best.decode


def test_splits_follow_the_heavier_phase() -> None:
    long_prompts = Trace.of([(i * 0.05, 2000, 0, 2, "") for i in range(200)])
    assert best_split(COSTS, long_prompts, SLO(5.0, 1.0)) == (3, 1)
    long_answers = Trace.of([(i * 0.01, 8, 0, 200, "") for i in range(400)])
    slow_decode = StepCosts(0.0, 1e-4, 0.0, 0.005, 0.004, 0.0)
    assert best_split(slow_decode, long_answers, SLO(5.0, 0.02)) == (1, 3)


def test_cheapest_takes_the_cheaper_of_equal_kinds() -> None:
    trace = Trace.of([(i * 0.1, 50, 0, 5, "") for i in range(100)])
    kinds = [kind(COSTS, "dear", price=3.0), kind(COSTS, "cheap", price=1.0)]
    best = cheapest(kinds, trace, SLO(1.0, 0.05), Handoff(0.0, 0.0))[0]
    assert best.label == "cheap x1 colocated" and best.price == 1.0


def test_trace_round_trip_and_bad_lines(tmp_path: Path) -> None:
    t = Trace.of([(0.0, 10, 2, 3, "a"), (0.5, 20, 0, 1, "b")])
    t.save(tmp_path / "t.jsonl")
    assert Trace.load(tmp_path / "t.jsonl") == t
    assert t.at_rate(2.0).arrival == (0.0, 0.25)
    (tmp_path / "bad.jsonl").write_text('{"arrival": 0, "prompt": 5}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        Trace.load(tmp_path / "bad.jsonl")
    with pytest.raises(ValueError):
        Trace.of([(0.0, 5, 5, 1, "")])  # cached must leave a token to compute
    with pytest.raises(ValueError):
        Trace.of([(1.0, 5, 0, 1, ""), (0.0, 5, 0, 1, "")])


def test_cli_arguments_are_checked(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_slo("ttft=2,tpot=50ms") == SLO(2.0, 0.05)
    assert parse_nodes("H100-SXM=500@12.5,local=2")[0].price == 12.5
    for bad in ("ttft=2", "ttft=x,tpot=1", "ttft=0,tpot=1"):
        with pytest.raises(ValueError):
            parse_slo(bad)
    for bad in ("H100", "H100=0", "H100=2@-1", "=3"):
        with pytest.raises(ValueError):
            parse_nodes(bad)
    assert plan_main(["--synthetic", "chat:1:10", "--slo", "ttft=1,tpot=1", "--nodes", "nowhere=2"]) == 2
    assert "nowhere" in capsys.readouterr().err


def test_cli_plans_a_profiled_node(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    prefill = tuple(PrefillPoint(u, 0, 0.001 * u) for u in (64, 256, 1024))
    decode = tuple(DecodePoint(b, 100 * b, 0.01 + 0.002 * b) for b in (1, 4, 16))
    EngineProfile("toy", "measured", "m", "fp32", "fp32", prefill, decode).save(tmp_path / "p.json")
    args = ["--synthetic", "chat:2:60", "--slo", "ttft=2,tpot=100ms", "--nodes", "toy=3@1", "--json",
            "--profile", str(tmp_path / "p.json"), "--model", "llama-3.1-8b"]  # fmt: skip
    assert plan_main(args) == 0
    import json

    report = json.loads(capsys.readouterr().out)
    labels = {o["label"] for o in report["splits"]["toy"]}
    assert labels == {"3C", "1P+2D", "2P+1D"}
    assert report["cheapest"][0]["price"] <= 3


def test_disaggregation_wins_on_interference() -> None:
    # Poisson arrivals, 1 in 4 a 2,000-token prompt (0.8 s of prefill): colocated, a chat whose
    # worker takes up such a prompt decodes one 0.8 s step, past its 20 ms TPOT; on P/D the decode
    # worker never prefills, and the one prefill worker is the limit
    costs = StepCosts(0.0, 4e-4, 0.0, 0.01, 0.0, 0.0)
    rng, t, rows = random.Random(0), 0.0, []
    for _ in range(400):
        t += rng.expovariate(1.0)
        long = rng.random() < 0.25
        rows.append((t, 2000 if long else 16, 0, 2 if long else 32, ""))
    trace, slo, node = Trace.of(rows), SLO(3.0, 0.02), kind(costs)
    pd_goodput = goodput(Handoff(0.0, 0.0).spec(node, 1, node, 1), trace, slo)
    assert pd_goodput > 1.3 * goodput(colocated(node, 2), trace, slo)


def test_goodput_stops_where_the_trace_is_too_short_to_tell() -> None:
    # 64 fast workers absorb a 21-request burst at any rate: the answer is the trace's limit
    # (20 requests over 20 TTFT SLOs), a lower bound, not an unbounded rate
    from planner.search import max_rate

    trace = Trace.of([(i * 1.0, 10, 0, 2, "") for i in range(21)])
    slo = SLO(1.0, 1.0)
    assert max_rate(trace, slo) == 1.0
    assert goodput(colocated(kind(COSTS), 64), trace, slo) == pytest.approx(1.0)
