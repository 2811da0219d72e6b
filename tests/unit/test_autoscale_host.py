"""The autoscaler's planner on one host (`tandem serve` without --join): the profile at each
worker's threads, lent the one at all the host's cores, contended a busy-peer one, and no more
workers than the host has cores for (planner.kinds.host_kind, router.autoscaler)."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from planner.autoscale import Bounds, Host, Memory, Window, decide, fit_bounds
from planner.kinds import host_kind
from planner.profile import PEER_SOURCE, DecodePoint, EngineProfile, PrefillPoint
from planner.search import Handoff
from planner.slo import SLO
from planner.step_costs import StepCosts
from planner.trace import Trace
from router.autoscale_flags import AutoscaleConfig, add_arguments
from router.autoscaler import planner_from_args, profile_planner

PD = {"prefill": 1, "decode": 1, "colocated": 0}


def profile(threads: int, speed: float = 1.0, source: str = "measured", dtype: str = "int8") -> EngineProfile:
    """A toy profile: prefill 1 ms a token, decode 20 ms + 2 ms a request, all over `speed`."""
    prefill = tuple(PrefillPoint(u, 0, 0.001 * u / speed) for u in (64, 256, 1024))
    decode = tuple(DecodePoint(b, 100 * b, (0.02 + 0.002 * b) / speed) for b in (1, 4, 16))
    return EngineProfile(f"toy:{threads}t", source, "m", dtype, "int8", prefill, decode, threads=threads)


ONE, TWO, BUSY = profile(1), profile(2, speed=2.0), profile(1, speed=0.8, source=PEER_SOURCE)


def test_a_host_kind_takes_each_profile_for_its_part() -> None:
    kind = host_kind([TWO, BUSY, ONE], Host(cores=2, threads=1), available=8)
    w = kind.worker
    assert kind.available == 2  # two 1-thread workers fill 2 cores; a third only shares them
    assert w.host == 0 and w.costs == StepCosts.fit(ONE)
    assert w.lent == StepCosts.fit(TWO) and w.contended == StepCosts.fit(BUSY)
    static = host_kind([TWO, BUSY, ONE], Host(cores=2, threads=1, lend=False), available=8).worker
    assert static.lent is None and static.contended == StepCosts.fit(BUSY)
    alone = host_kind([TWO, ONE], Host(cores=2, threads=2), available=8)  # one worker takes the host
    assert alone.available == 1 and alone.worker.host == -1 and alone.worker.costs == StepCosts.fit(TWO)
    assert host_kind([profile(4)], Host(cores=16, threads=4), available=3).available == 3  # the bounds are lower
    legacy = profile(0)  # a profile from before threads were recorded: any, when it is the only one
    assert host_kind([legacy], Host(cores=2, threads=1), available=4).worker.costs == StepCosts.fit(legacy)
    assert host_kind([ONE], None, available=5).available == 5  # nodes of their own: as many as the bounds
    with pytest.raises(ValueError, match="cores and threads >= 1"):
        Host(cores=2, threads=0)


@pytest.mark.parametrize(
    ("profiles", "host", "says"),
    [
        ([TWO], Host(2, 1), r"no profile at 1 thread\(s\).*\[2\]"),
        ([ONE, profile(1, dtype="bf16")], Host(2, 1), "one engine"),
        ([ONE, TWO], None, "one profile"),
        ([ONE, BUSY], None, "one profile"),
        ([profile(0), profile(0)], Host(2, 1), "no profile at 1"),
    ],
)
def test_profiles_that_do_not_fit_the_host_say_why(profiles: list[EngineProfile], host: Host | None, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        host_kind(profiles, host, available=4)


def test_on_one_host_the_bounds_hold_no_more_workers_than_its_cores() -> None:
    wide = Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 4, "decode": 4})
    fitted, said = fit_bounds(wide, Host(cores=2, threads=1))
    assert fitted.max_pd == 2 and fitted.max == wide.max and said == ("prefill + decode at most 2 (pd=2; give "
                                                                      "pd=N to set another)",)  # fmt: skip
    assert fit_bounds(replace(wide, max_pd=3), Host(2, 1)) == (replace(wide, max_pd=3), ())  # the operator's pd=N
    assert fit_bounds(wide, Host(cores=16, threads=2)) == (wide, ())  # 8 workers' room: 4 + 4 fit
    assert fit_bounds(Bounds(max={"prefill": 2}), Host(16, 2))[0].max_pd == 8  # no decode max: no limit
    floors = Bounds(min={"prefill": 2, "decode": 2}, max={"prefill": 3, "decode": 3})
    assert fit_bounds(floors, Host(2, 1))[0].max_pd == 4  # never below the operator's minimums
    colo, said = fit_bounds(Bounds(min={"colocated": 1}, max={"colocated": 4}), Host(cores=2, threads=2))
    assert colo.max == {"colocated": 1} and colo.max_pd is None and said == ("colocated at most 1",)
    # so a missed TPOT at 1P+1D on 2 cores trades (here: holds, prefill at its min) instead of a third worker
    d, _ = decide(0, PD, None, Window(60, 120, 1.0, 0.5), fitted, Memory())
    assert not d.changed and d.held and any("prefill + decode at most 2" in r for r in d.reasons)
    assert decide(0, PD, None, Window(60, 120, 1.0, 0.5), wide, Memory())[0].sizes["decode"] == 2


def steady(n: int, every_s: float, prompt: int, output: int) -> Trace:
    return Trace.of([(i * every_s, prompt, 0, output, "") for i in range(n)])


def test_the_plan_counts_the_cores_lent_and_no_more_workers_than_the_host_has_room_for() -> None:
    chat = steady(60, 0.5, 50, 50)  # the decode worker busy alone most of the time
    slo = SLO(2.0, 0.018)  # a 2-thread decode step meets it (~12 ms), a 1-thread one (~23 ms) does not
    lent = profile_planner(host_kind([ONE, TWO], Host(2, 1), 8), Handoff(0.0, 0.0))
    static = profile_planner(host_kind([ONE, TWO], Host(2, 1, lend=False), 8), Handoff(0.0, 0.0))
    assert lent(chat, slo, PD) == PD
    assert static(chat, slo, PD) is None  # 1P+1D on 1 thread each misses it, and there is no room for more
    long = steady(40, 0.25, 1000, 4)  # ~4 prefill workers' worth (as tests/unit/test_autoscaler.py)
    nodes = profile_planner(host_kind([ONE], None, 8), Handoff(0.0, 0.0))
    on_host = profile_planner(host_kind([ONE], Host(2, 1), 8), Handoff(0.0, 0.0))
    sized = nodes(long, SLO(2.0, 0.1), PD)
    assert sized is not None and sized["prefill"] >= 4
    assert on_host(long, SLO(2.0, 0.1), PD) is None  # 2 cores cannot: more workers would only share them
    colocated = profile_planner(host_kind([TWO], Host(2, 2), 8), Handoff(0.0, 0.0))
    one = {"prefill": 0, "decode": 0, "colocated": 1}
    assert colocated(chat, SLO(2.0, 0.1), one) == one
    assert colocated(long, SLO(2.0, 0.1), one) is None


def test_serve_reads_the_profiles_before_it_starts(tmp_path: Path) -> None:
    ap = argparse.ArgumentParser()
    add_arguments(ap)
    ap.add_argument("--model", default=None)
    paths = []
    for p in (ONE, TWO):
        paths.append(str(tmp_path / f"{p.node_class}.json"))
        p.save(paths[-1])
    config = AutoscaleConfig(SLO(2.0, 0.018), Bounds(min={"prefill": 1, "decode": 1}, max={"prefill": 4, "decode": 4}))
    args = ap.parse_args(["--autoscale-profile", ",".join(paths), "--model", "llama-3.1-8b"])
    plan = planner_from_args(args, config, Host(2, 1))
    assert plan is not None and plan(steady(60, 0.5, 50, 50), config.slo, PD) == PD
    assert planner_from_args(ap.parse_args([]), config, Host(2, 1)) is None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"node_class": "x"}))
    for text, says in ((str(bad), "not a `tandem profile` JSON"), (paths[1], r"no profile at 1 thread")):
        with pytest.raises(ValueError, match=says):
            planner_from_args(ap.parse_args(["--autoscale-profile", text]), config, Host(2, 1))


def test_serve_with_profiles_that_do_not_fit_this_host_is_one_line_before_anything_starts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import ray

    from router.server import main
    from tests.ports import free_port

    monkeypatch.delenv("RAY_ADDRESS", raising=False)  # every worker on this host
    path = tmp_path / "profile-64t.json"
    profile(64).save(path)
    with pytest.raises(SystemExit) as exit_:
        main(["--port", str(free_port()), "--autoscale", "decode=1..2", "--autoscale-profile", str(path)])
    said = str(exit_.value.code)
    assert said.startswith("tandem serve: --autoscale-profile: no profile at ") and "[64]" in said
    assert not ray.is_initialized()
