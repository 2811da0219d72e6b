"""`tandem bench planner`'s replay: a compare.json's sweep points re-run in the simulator."""

from __future__ import annotations

from typing import Any

import pytest

from bench.compare import QUICK
from bench.planner_bench import main
from bench.replay import replay
from engine.tokenizer import Tokenizer
from planner.profile import DecodePoint, EngineProfile, PrefillPoint
from planner.step_costs import StepCosts


def profile(scale: float) -> EngineProfile:
    prefill = tuple(PrefillPoint(u, 0, scale * 0.001 * u) for u in (64, 256, 1024))
    decode = tuple(DecodePoint(b, 100 * b, scale * (0.01 + 0.002 * b)) for b in (1, 4, 16))
    return EngineProfile("toy", "measured", "m", "fp32", "fp32", prefill, decode, {"grpc": 1.0})


ALONE = {"chat-long": {"ttft_s": 0.01, "tpot_s": 0.005}}  # under the toy engine's: no offset


def compare_json() -> dict[str, Any]:
    systems = [s.__dict__ | {"cores": s.cores} for s in QUICK.systems]
    points = [{"rate": r, "attainment": 1.0, "requests": 6} for r in (0.5, 1.0, 2.0)]
    mix = {
        "slo": {"classes": {"chat-long": {"ttft_s": 1.0, "tpot_s": 0.05}}},
        "systems": {s["name"]: {"goodput_rps": 2.0, "points": points, "unloaded": ALONE} for s in systems},
    }
    return {"meta": {"quick": True, "seed": 0, "systems": systems}, "decode_heavy": mix}


def test_replay_simulates_each_measured_point(smollm_tokenizer: Tokenizer) -> None:
    fast = replay(compare_json(), {1: profile(1.0), 2: profile(0.5)}, smollm_tokenizer)
    assert [(r.mix, r.system) for r in fast] == [("decode_heavy", s.name) for s in QUICK.systems]
    assert all(r.simulated == 2.0 and r.error == 0.0 for r in fast)  # every point meets the SLO
    slow = replay(compare_json(), {1: profile(50.0), 2: profile(50.0)}, smollm_tokenizer)
    assert all(r.simulated == 0.0 and r.error == 1.0 for r in slow)  # none does


def test_workers_that_lent_their_cores_share_a_host_in_the_simulator() -> None:
    from bench.compare import PD, static_cores
    from bench.replay import _spec
    from tests.unit.tiny import TINY

    profiles = {1: profile(1.0), 2: profile(0.5)}
    lending = _spec(PD.__dict__ | {"cores": PD.cores}, profiles, 1024, TINY)
    assert {(w.host, w.lent is not None) for w in lending.prefill + lending.decode} == {(0, True)}
    assert lending.decode[0].lent == StepCosts.fit(profiles[2])  # the profile of both cores
    for static in (static_cores(PD).__dict__, {k: v for k, v in PD.__dict__.items() if k != "lend_cores"}):
        spec = _spec(static | {"cores": PD.cores}, profiles, 1024, TINY)  # A/B; a compare from before lending
        assert {(w.host, w.lent) for w in spec.prefill + spec.decode} == {(-1, None)}


def test_workers_of_a_host_step_on_the_busy_peer_profile_while_a_peer_is_busy() -> None:
    from bench.compare import COLOCATED_1X2, PD, static_cores
    from bench.replay import _scaled, _spec
    from tests.unit.tiny import TINY

    profiles, busy = {1: profile(1.0), 2: profile(0.5)}, profile(1.5)
    for system, lent in ((PD, StepCosts.fit(profiles[2])), (static_cores(PD), None)):
        spec = _spec(system.__dict__ | {"cores": PD.cores}, profiles, 1024, TINY, busy)
        assert {(w.host, w.lent, w.contended) for w in spec.prefill + spec.decode} == {(0, lent, StepCosts.fit(busy))}
        offset = _scaled(spec, 1.0, 0.002).decode[0].contended  # the serving path's cost a step: there too
        assert offset is not None and offset.d0 == pytest.approx(StepCosts.fit(busy).d0 + 0.002)
    alone = _spec(COLOCATED_1X2.__dict__ | {"cores": 2}, profiles, 1024, TINY, busy)  # one worker: no peer
    assert {(w.host, w.contended) for w in alone.colocated} == {(-1, None)}


def test_a_measured_zero_has_no_relative_error_unless_the_simulation_agrees() -> None:
    from bench.replay import Row

    assert Row("m", "s", measured=0.0, simulated=0.0).error == 0.0
    assert Row("m", "s", measured=0.0, simulated=0.3).error is None
    assert Row("m", "s", measured=2.0, simulated=1.5).error == 0.25


def test_the_load_steps_timeline_and_recovery_time() -> None:
    from bench.load_step import recovery_s, timeline

    sent = [(t, True) for t in (0.5, 1, 6, 7)] + [(11, False), (12, False), (16, True), (17, False)]
    sent += [(21, True), (22, True), (26, True)]
    line = timeline(sent, 5.0)
    assert line == [(0.0, 1.0), (5.0, 1.0), (10.0, 0.0), (15.0, 0.5), (20.0, 1.0), (25.0, 1.0)]
    assert recovery_s(line, step_s=10.0) == 10.0, "from the step to the window from which all meet"
    assert recovery_s(line, step_s=20.0) == 0.0, "nothing missed after the step"
    assert recovery_s([*line, (30.0, None), (35.0, 0.5)], step_s=10.0) is None, "the run ends missing"
    assert recovery_s([(0.0, 1.0), (5.0, None), (10.0, 1.0)], step_s=5.0) == 5.0, "empty windows are skipped"


def test_load_step_rates_must_be_positive(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:  # refused before any cluster starts
        main(["--load-step", "--no-validation", "--no-scale", "--step-after", "0"])
    assert e.value.code == 2 and "must be positive (got None, 0.0)" in capsys.readouterr().err


def test_the_load_steps_rates_sit_where_the_flip_decides() -> None:
    from bench.step_rates import rates_from

    r = rates_from(before_held=3.0, after_static=2.0, after_flipped=4.5)
    assert (r.before_rps, r.after_rps, r.flip_gain) == (1.5, 3.0, 2.25), "half; the geometric mean, 1.5x each side"
    assert rates_from(3.0, 0.0, 4.0).after_rps == 2.0, "2P+1D holds none of it: half of what 1P+2D holds"
    with pytest.raises(RuntimeError, match="no step to take"):
        rates_from(3.0, 0.0, 0.0)  # not even 1P+2D holds any
    with pytest.raises(RuntimeError, match="no step to take"):
        rates_from(0.0, 2.0, 4.0)


def test_the_reversed_load_step_starts_where_the_forward_flip_ends() -> None:
    from bench.load_step import StepPlan
    from bench.step_rates import Sizes

    forward = StepPlan()
    back = forward.reversed()
    assert (forward.start, forward.grows, forward.start.flipped("decode")) == (Sizes(2, 1), "decode", Sizes(1, 2))
    assert (back.before, back.after) == (forward.after, forward.before)
    assert (back.start, back.grows, str(back.start.flipped(back.grows))) == (Sizes(1, 2), "prefill", "2P+1D")
    assert back.reversed() == forward
