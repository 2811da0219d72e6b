"""The figures of `tandem bench efficiency` (bench.efficiency), computed from plain measured numbers:
engine and served throughput, the ratios, the report and its JSON keys."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bench.stats import distribution

CONCURRENCIES = (1, 8, 32)
PROMPT_WORDS = 256  # one token each in the bundled vocabulary (bench.workloads.WORDS)
OUTPUT_TOKENS = 64
# `tandem serve` defaults to 512 blocks, which hold only ~24 requests of 256 + 64 tokens: C = 32
# would never run as one batch on either side. 1024 does, and both sides get the same.
NUM_BLOCKS = 1024
EFFICIENCY_TARGET = 0.85
TPOT_OVER_STEP_TARGET = 1.2
REQUEST_TIMEOUT_S = 300.0
# Each side first runs one wave at the largest C: the first batch of a new size pays for its
# allocations (measured: a first wave of 32 at half the tok/s of the next).
WARMUP_TOKENS = 4
MODES = {"colocated": (0, 0, 1), "pd": (1, 1, 0)}  # prefill, decode, colocated workers
DEFINITIONS = {
    "efficiency": "served output tok/s at concurrency C / engine output tok/s on the same prompts, same run",
    "served_output_tok_s": "output tokens of completed requests / (first send to last answer), closed loop at C",
    "engine_output_tok_s": "output tokens / wall time of the same prompts through the engine's step loop "
    "(Engine.generate's add_request + step) in waves of C, in the benchmark's process; the faster of two "
    "runs, one right before the system's cluster and one right after it (runs_output_tok_s)",
    "tpot_over_step": "client TPOT p50, (E2E - TTFT) / (output tokens - 1), over the engine's step p50 at batch C",
    "serving_efficiency": "served output tok/s at C / engine_cluster_up_tok_s: what serving costs beyond the "
    "cluster's standing cost",
    "engine_cluster_up_tok_s": "the engine's loop on the same prompts as engine_output_tok_s, one run, in the "
    "benchmark's process with the system's cluster up and idle (its background shares the cores), right before "
    "the system is loaded at that C",
    "engine_step_s": "wall time of engine.step() in the steps where all C requests of a wave decode (none prefills)",
    "threads": "as tandem serve: the cores split among a system's workers (--threads: one count for all); "
    "colocated's baseline has the colocated worker's threads, pd's the decode worker's (the prefill worker "
    "has as many again)",
    "workload": f"{PROMPT_WORDS}-word prompts (one token a word, distinct per request), "
    f"{OUTPUT_TOKENS} output tokens, ignore_eos, greedy, /v1/completions streamed",
    "targets": f"efficiency >= {EFFICIENCY_TARGET} at C = 8 and 32; tpot_over_step <= {TPOT_OVER_STEP_TARGET}; "
    "no request failed",
}


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


# ---- the arithmetic, on plain measured numbers ----------------------------------------------


def engine_figures(output_tokens: int, seconds: float, steady_steps_s: Sequence[float]) -> dict[str, Any]:
    """The engine baseline at one C: its output tok/s and its step time at batch C."""
    steps = distribution(steady_steps_s)
    return {
        "output_tokens": output_tokens,
        "seconds": seconds,
        "output_tok_s": output_tokens / seconds if seconds > 0 else 0.0,
        "step_p50_s": steps["p50"] if steps else None,
        "step_mean_s": steps["mean"] if steps else None,
        "steady_steps": len(steady_steps_s),
    }


def best_of(*runs: dict[int, dict[str, Any]]) -> dict[int, dict[str, Any]]:
    """Per C, the engine run with the highest output tok/s, every run's tok/s alongside: on shared
    cores, someone else's burst slows one run of the baseline, rarely both."""
    return {
        c: {
            **max((r[c] for r in runs), key=lambda f: f["output_tok_s"]),
            "runs_output_tok_s": [r[c]["output_tok_s"] for r in runs],
        }
        for c in runs[0]
    }


def served_figures(summary: dict[str, Any]) -> dict[str, Any]:
    """What the report keeps of bench.stats.summarize for one C."""
    keep = ("requests", "completed", "failed", "errors", "duration_s", "output_tok_s", "breakdown")
    tpot, ttft = summary["tpot_s"], summary["ttft_s"]
    return {
        **{k: summary[k] for k in keep},
        "tpot_p50_s": tpot["p50"] if tpot else None,
        "ttft_p50_s": ttft["p50"] if ttft else None,
    }


def mode_report(served: dict[int, dict[str, Any]], engine: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """One system's figures against the engine's, per C; the headline ratios at C = 8 and 32."""
    by_c: dict[str, dict[str, Any]] = {}
    for c, s in sorted(served.items()):
        e = engine[c]
        by_c[str(c)] = {
            **s,
            "engine_output_tok_s": e["output_tok_s"],
            "engine_step_p50_s": e["step_p50_s"],
            "efficiency": ratio(s["output_tok_s"], e["output_tok_s"]),
            "tpot_over_step": ratio(s["tpot_p50_s"], e["step_p50_s"]),
            "serving_efficiency": ratio(s["output_tok_s"], s.get("engine_cluster_up_tok_s")),
        }

    def at(c: int, key: str) -> float | None:
        return by_c.get(str(c), {}).get(key)

    eff = [at(c, "efficiency") for c in (8, 32)]
    tps = [at(c, "tpot_over_step") for c in (8, 32)]
    return {
        "efficiency_c8": eff[0],
        "efficiency_c32": eff[1],
        "tpot_over_step_c8": tps[0],
        "tpot_over_step_c32": tps[1],
        "serving_efficiency_c8": at(8, "serving_efficiency"),
        "serving_efficiency_c32": at(32, "serving_efficiency"),
        "meets_targets": all(x is not None and x >= EFFICIENCY_TARGET for x in eff)
        and all(x is not None and x <= TPOT_OVER_STEP_TARGET for x in tps)
        and not any(s["failed"] for s in served.values()),
        "by_concurrency": by_c,
    }


def report(
    engine: dict[str, dict[int, dict[str, Any]]],
    served: dict[str, dict[int, dict[str, Any]]],
    engine_meta: dict[str, dict[str, Any]],
    quick: bool,
    elapsed_s: float,
) -> dict[str, Any]:
    """The JSON: one object per system, each system's engine baseline, definitions, quick, elapsed_s."""
    modes = {mode: mode_report(by_c, engine[mode]) for mode, by_c in served.items()}
    return {
        **modes,
        "engine": {
            mode: {**engine_meta[mode], "by_concurrency": {str(c): f for c, f in sorted(engine[mode].items())}}
            for mode in served
        },
        "definitions": DEFINITIONS,
        "quick": quick,
        "elapsed_s": elapsed_s,
    }
