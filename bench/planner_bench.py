"""`tandem bench planner`: the simulator (planner.simulator) against what `tandem bench compare`
measured, and the simulator's speed at cluster scale.

validation  Each mix and system of a compare.json, each measured rate replayed in the simulator
            on the very requests and arrival times the sweep sent: simulated vs measured goodput
            and its error (bench/replay.py). Without --compare it runs `tandem bench compare
            --quick` on the two mixes first; without profiles it measures them (`tandem profile`,
            1 and 2 threads); --profile-busy-peer models workers that share a host while both
            are busy.
scale       1,000 workers (500 prefill H100 + 500 decode H200, a Llama-3.1-8B roofline) and 1M
            chat requests: the wall time of one simulation (--no-scale skips it).

load step  With --load-step: bench/load_step.py (the prefill-heavy to decode-heavy step, static
            and autoscaled on the same hardware; recovery_s_static, recovery_s_autoscale, and
            the attainment timelines as a plot; --step-reverse: decode-heavy to prefill-heavy).
            --no-validation skips the replay.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.json_out import print_json, sub_command
from bench.replay import VALIDATED, Row, replay
from bench.workloads import MIXES
from engine.model_files import default_model_path
from engine.tokenizer import Tokenizer
from planner.kinds import model_config
from planner.profile import EngineProfile
from planner.roofline import ModelShape
from planner.search import Handoff
from planner.simulator import simulate
from planner.trace import synthetic


def scale_seconds(requests: int = 1_000_000, workers: int = 1000) -> float:
    """Wall time of one simulation of `requests` chat requests on workers/2 prefill H100s and
    workers/2 decode H200s serving Llama-3.1-8B (roofline profiles), at 70% of their capacity."""
    from planner.hardware import known
    from planner.kinds import from_hardware

    config, hw = model_config("llama-3.1-8b"), known()
    h100 = from_hardware(hw["H100-SXM"], config, "llama-3.1-8b", "bf16", "bf16", 0.0, workers // 2)
    h200 = from_hardware(hw["H200-SXM"], config, "llama-3.1-8b", "bf16", "bf16", 0.0, workers // 2)
    handoff = Handoff(0.002, ModelShape.of(config, "bf16", "bf16").kv_bytes_per_token)
    trace = synthetic(MIXES["chat"], 40.0 * workers, requests, seed=1)
    t = time.perf_counter()
    simulate(handoff.spec(h100, workers // 2, h200, workers // 2), trace)
    return time.perf_counter() - t


def _profiles(args: argparse.Namespace, out: Path) -> dict[int, EngineProfile]:
    from planner.measure import main as profile_main

    paths = {1: args.profile_1t, 2: args.profile_2t}
    for threads, path in paths.items():
        if path is None:
            paths[threads] = str(out / f"profile-{threads}t.json")
            with sub_command():  # its report goes to stderr, not into this command's JSON
                profile_main(["--threads", str(threads), "--transports", "grpc", "--out", paths[threads], "--json"])
    return {t: EngineProfile.load(p) for t, p in paths.items() if p is not None}


def main(argv: list[str] | None = None) -> int:
    raw = argparse.RawDescriptionHelpFormatter
    ap = argparse.ArgumentParser(prog="tandem bench planner", description=__doc__, formatter_class=raw)
    ap.add_argument("--compare", help="a `tandem bench compare --json` result (default: run it, quick)")
    ap.add_argument("--profile-1t", help="`tandem profile --threads 1` JSON (default: measure it)")
    ap.add_argument("--profile-2t", help="`tandem profile --threads 2` JSON (default: measure it)")
    ap.add_argument("--profile-busy-peer", help="`tandem profile --threads 1 --beside-busy-peer` JSON: the "
                    "1-thread workers of a host while a peer is busy (default: not modeled)")  # fmt: skip
    ap.add_argument("--no-scale", action="store_true", help="skip the 1,000-worker, 1M-request timing")
    ap.add_argument("--load-step", action="store_true", help="also the autoscaler's load step (live, minutes)")
    ap.add_argument("--no-validation", action="store_true", help="skip the replay of a compare")
    ap.add_argument("--step-before", type=float, help="the load step's rate before it, x that mix's one-at-a-time "
                    "rate (default: half of what the static sizes hold, measured first)")  # fmt: skip
    ap.add_argument("--step-after", type=float, help="and after, x that mix's (default: between what the static "
                    "sizes and those with a worker flipped hold, measured first)")  # fmt: skip
    ap.add_argument("--step-reverse", action="store_true", help="the load step the other way: decode-heavy to "
                    "prefill-heavy, from 1P+2D")  # fmt: skip
    ap.add_argument("--out", default="out/bench/planner", help="directory for the load step's plot")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    if any(x is not None and x <= 0 for x in (args.step_before, args.step_after)):
        ap.error(f"--step-before and --step-after must be positive (got {args.step_before}, {args.step_after})")
    out = Path(tempfile.mkdtemp(prefix="tandem-bench-planner-"))
    report: dict[str, Any] = {"points": [], "sim_error_max": None, "attainment_error_mean": None,
                              "recovery_s_static": None, "recovery_s_autoscale": None}  # fmt: skip
    rows: list[Row] = []
    if not args.no_validation:
        rows = _validate(args, out, report)
    if args.load_step:
        from bench.load_step import StepPlan, measure
        from bench.plots import attainment_timeline

        plan = StepPlan(before_x=args.step_before, after_x=args.step_after)
        step = measure(plan.reversed() if args.step_reverse else plan)
        report |= step
        lines = {m: step[f"timeline_{m}"] for m in ("static", "autoscale")}
        report["files"] = [str(attainment_timeline(lines, step["step_s"], Path(args.out) / "load_step.png"))]
    if not args.no_scale:
        report["sim_1000_workers_s"] = scale_seconds()
    if args.json:
        print_json(report)
        return 0
    _print(rows, report)
    return 0


def _validate(args: argparse.Namespace, out: Path, report: dict[str, Any]) -> list[Row]:
    if args.compare:
        compare = json.loads(Path(args.compare).read_text())
    else:
        from bench.compare import main as compare_main

        mixes = [a for m in VALIDATED for a in ("--mix", m)]
        with sub_command():
            compare_main(["--quick", *mixes, "--out", str(out), "--no-progress", "--json"])
        compare = json.loads((out / "compare.json").read_text())
    busy_peer = EngineProfile.load(args.profile_busy_peer) if args.profile_busy_peer else None
    rows = replay(compare, _profiles(args, out), Tokenizer.load(default_model_path()), busy_peer)
    points = [{"mix": r.mix, "system": r.system, "measured_rps": r.measured, "simulated_rps": r.simulated,
               "error": r.error, "prefill_scale": r.prefill_scale, "decode_offset_ms": 1e3 * r.decode_offset_s,
               "attainment": [{"rate": a, "measured": m, "simulated": s} for a, m, s in r.attainment]}
              for r in rows]  # fmt: skip
    diffs = [abs(m - s) for r in rows for _, m, s in r.attainment]
    report["points"] = points
    report["sim_error_max"] = max((r.error for r in rows if r.error is not None), default=None)
    report["sim_errors_undefined"] = sum(r.error is None for r in rows)  # measured 0, simulated not
    report["attainment_error_mean"] = statistics.fmean(diffs) if diffs else None
    return rows


def _print(rows: list[Row], report: dict[str, Any]) -> None:
    if rows:
        print(f"{'mix':<16}{'system':<18}{'measured req/s':>16}{'simulated':>12}{'error':>8}"
              f"{'prefill x':>11}{'decode +ms':>11}")  # fmt: skip
    for r in rows:
        err = "-" if r.error is None else f"{r.error:.0%}"
        print(f"{r.mix:<16}{r.system:<18}{r.measured:>16.3f}{r.simulated:>12.3f}{err:>8}"
              f"{r.prefill_scale:>11.2f}{1e3 * r.decode_offset_s:>11.2f}")  # fmt: skip
    if rows:
        n = sum(len(r.attainment) for r in rows)
        worst = "-" if report["sim_error_max"] is None else f"{report['sim_error_max']:.0%}"
        print(f"largest error: {worst} (target <= 25%; {report['sim_errors_undefined']} undefined: measured 0); "
              "attainment, simulated vs measured, "
              f"differs by {report['attainment_error_mean']:.1%} a point on average ({n} points)")  # fmt: skip
    if "step_slo" in report:
        slo = report["step_slo"]
        print(f"load step at {report['step_s']:.0f} s (SLO TTFT {slo['ttft_s']:.2f} s, "
              f"TPOT {slo['tpot_s'] * 1e3:.0f} ms): "
              f"recovery to >= 90% static {_secs(report['recovery_s_static'])}, "
              f"autoscaled {_secs(report['recovery_s_autoscale'])}; plot {report['files'][0]}")  # fmt: skip
        rates, held = report["step_rates"], report["step_rates"]["measured"]
        static, flipped = rates.get("static_sizes", "2P+1D"), rates.get("flipped_sizes", "1P+2D")
        print(f"  {rates.get('before_mix', '')} to {rates.get('after_mix', '')}: {rates['before_rps']:.2f} req/s "
              f"before, {rates['after_rps']:.2f} after" + (
              f" (measured first: {static} holds {held['before_held_rps']:.2f} before, {held['after_static_rps']:.2f} "
              f"after; {flipped} {held['after_flipped_rps']:.2f} after)" if held else ""))  # fmt: skip
        if held and held["after_flipped_rps"] < held["after_static_rps"]:
            print(f"  the flip loses here: the step sits where only {static} holds, and the right decision is none")
        for m in ("static", "autoscale"):
            line = " ".join("-" if a is None else f"{a:.0%}" for _, a in report[f"timeline_{m}"])
            print(f"  {m:<10}{line}")
    if "sim_1000_workers_s" in report:
        print(f"1,000 workers, 1M requests simulated in {report['sim_1000_workers_s']:.1f} s (target < 60 s)")


def _secs(v: float | None) -> str:
    return "not within the run" if v is None else f"{v:.0f} s"
