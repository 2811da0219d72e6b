"""`tandem bench efficiency`: what the serving path delivers of what the engine alone does, same run.

    efficiency(C)      served output tok/s at concurrency C / the engine's output tok/s on the same prompts
    tpot_over_step(C)  client TPOT p50 at C / the engine's median step time with all C requests decoding
    serving_efficiency(C)  served output tok/s / the engine's, run with the system up and idle

The last splits what efficiency misses in two: what the cluster costs the cores by being there
(Ray's and Tandem's background: measured 12-16% of the engine at C = 8 on 2 cores), and what
serving the requests costs on top.

The engine baseline runs in this process: the same prompts in waves of C through the engine's
own loop (Engine.generate's add_request + step, each step timed), with the workers' dtype,
threads, KV size and batch limit; right before and right after its system's cluster, the faster
run kept. (The two runs were once minutes apart, before and after both clusters: this machine's
speed drifts 10-20% over minutes, and the faster of two far-apart runs measured the drift.)
It is freed while a cluster runs, so nothing shares the cores. Each system is a real cluster
behind the real router, loaded closed-loop at C:

    colocated  1 worker, T threads                baseline: the engine with T threads
    pd         1 prefill + 1 decode, T' threads   baseline: the engine with T' threads (the decode worker's)

Threads as `tandem serve` gives them: the host's cores split among its workers (on 2 cores,
T = 2 and T' = 1), unless --threads sets one count for all.

Targets (issue 11): efficiency >= 0.85 at C = 8 and 32, TPOT p50 <= 1.2 x the step time.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from bench.efficiency_figures import (
    CONCURRENCIES,
    MODES,
    NUM_BLOCKS,
    OUTPUT_TOKENS,
    PROMPT_WORDS,
    REQUEST_TIMEOUT_S,
    WARMUP_TOKENS,
    best_of,
    engine_figures,
    report,
    served_figures,
)
from bench.harness import (
    ready_to_serve,
    running_cluster,
    serving,
    unique_namespace,
)
from bench.json_out import print_json
from bench.loadgen import Target, first_model, run_load
from bench.stats import SLO, summarize
from bench.workloads import WorkItem, words
from cluster.cluster import ClusterConfig
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_files import default_model_path
from engine.sampling_params import SamplingParams
from engine.torch_threads import on_spent_thread, threads_per_worker


def request_count(c: int, quick: bool) -> int:
    return max(2 * c, 8) if quick else max(4 * c, 48)


def prompts(n: int, seed: int, salt: int) -> list[str]:
    """`n` distinct prompts of PROMPT_WORDS words; a different `salt` shares no prefix."""
    rng = random.Random(f"tandem-efficiency-{seed}-{salt}")
    return [words(rng, PROMPT_WORDS) for _ in range(n)]


# ---- measuring ------------------------------------------------------------------------------


def engine_wave(engine: Engine, batch: Sequence[str | Sequence[int]], max_tokens: int) -> tuple[int, list[float]]:
    """Run `batch` at once through the engine's loop (Engine.generate's, with each step timed).
    Returns the output tokens and the times of the steps in which every request decoded."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    for prompt in batch:
        engine.add_request(f"eff-{uuid.uuid4().hex}", prompt, params)
    tokens, steady = 0, []
    while engine.has_unfinished():
        t0 = time.perf_counter()
        outs = engine.step()
        dt = time.perf_counter() - t0
        tokens += sum(len(o.new_token_ids) for o in outs)
        if len(outs) == len(batch) and all(o.num_output_tokens >= 2 for o in outs):
            steady.append(dt)
    return tokens, steady


def run_engine(
    model: str, config: EngineConfig, threads: int, waves: dict[int, list[str]], progress: bool
) -> tuple[dict[int, dict[str, Any]], dict[str, Any]]:
    """The baseline at every C, then the engine freed. Returns per-C figures and its config."""
    load_1m = os.getloadavg()[0]  # others' work on the cores before ours starts: a noisy run shows here
    t = time.perf_counter()
    # Built off this thread (see engine.torch_threads): this thread's team is then the only one.
    engine = on_spent_thread(lambda: Engine.from_path(model, config))
    load_s = time.perf_counter() - t
    torch.set_num_threads(threads)  # per thread: the engine set it on the spent one
    engine_wave(engine, prompts(max(waves), 0, salt=-1), WARMUP_TOKENS)
    figures: dict[int, dict[str, Any]] = {}
    for c, batch in waves.items():
        if progress:
            print(f"[engine] C={c}: {len(batch)} requests in waves of {c}", file=sys.stderr)
        t0 = time.perf_counter()
        runs = [engine_wave(engine, batch[i : i + c], OUTPUT_TOKENS) for i in range(0, len(batch), c)]
        seconds = time.perf_counter() - t0
        figures[c] = engine_figures(sum(n for n, _ in runs), seconds, [s for _, steps in runs for s in steps])
    meta = {"model": model, "dtype": config.weight_dtype, "threads": threads, "num_blocks": config.num_blocks,
            "max_num_seqs": config.max_num_seqs, "load_s": load_s, "load_avg_1m_before": load_1m}  # fmt: skip
    del engine
    gc.collect()
    return figures, meta


def run_mode(
    mode: str, model: str, config: EngineConfig, threads: int, waves: dict[int, list[str]], progress: bool
) -> dict[int, dict[str, Any]]:
    """Start the system, warm it up, then at every C: the engine's loop in this process with the
    system up and idle, and the system loaded closed-loop; shut it down."""
    prefill, decode, colocated = MODES[mode]
    spec = ClusterConfig(model, unique_namespace("bench-efficiency"), prefill, decode, colocated, engine=config)
    out: dict[int, dict[str, Any]] = {}
    with running_cluster(spec) as cluster, serving(cluster) as url:
        target = Target(url, asyncio.run(first_model(url)), timeout_s=REQUEST_TIMEOUT_S)
        warm = [WorkItem(WARMUP_TOKENS, prompt=p) for p in prompts(max(waves), 0, salt=-1)]
        asyncio.run(run_load(target, warm, concurrency=len(warm), progress=False))
        for c, batch in waves.items():
            # the engine's loop here first, the cluster up and idle: what sharing the cores with it costs
            shared = run_engine(model, config, threads, {c: batch}, progress)[0][c]
            items = [WorkItem(OUTPUT_TOKENS, prompt=p) for p in batch]
            results, duration = asyncio.run(
                run_load(target, items, concurrency=c, progress=progress, desc=f"{mode} C={c}")
            )
            out[c] = {**served_figures(summarize(results, duration, SLO())),
                      "engine_cluster_up_tok_s": shared["output_tok_s"]}  # fmt: skip
    return out


# ---- the command ----------------------------------------------------------------------------


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="tandem bench efficiency", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke check: fewer requests per concurrency")
    ap.add_argument("--model", default="", help="GGUF file or HF directory (default: bundled SmolLM2)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "fp16", "int8", "int4"],
                    help="both sides (default: tandem serve's, auto)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=0,
                    help="torch threads per worker and engine (0: as tandem serve, the cores split)")  # fmt: skip
    ap.add_argument("--num-blocks", type=int, default=NUM_BLOCKS, help="KV blocks per worker and for the engine")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--out", default="out/bench/efficiency", help="directory for efficiency.json")
    ap.add_argument("--no-progress", action="store_true")
    return ap


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.1f}"


def _tok(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}"


def _x(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_report(res: dict[str, Any]) -> None:
    for mode in MODES:
        r, e = res[mode], res["engine"][mode]
        print(f"{mode}: {e['dtype']}, {e['threads']} threads a worker, {res['definitions']['workload']}")
        print(f"  baseline: the engine alone, {e['threads']} threads, in this run ({e['num_blocks']} blocks, "
              f"max_num_seqs {e['max_num_seqs']}); load average before it {e['load_avg_1m_before']:.2f}")  # fmt: skip
        print(f"{'C':>5}{'ok/sent':>9}{'served tok/s':>14}{'engine tok/s':>14}{'efficiency':>12}"
              f"{'TPOT p50 ms':>13}{'step p50 ms':>13}{'TPOT/step':>11}{'engine, cluster up':>20}"
              f"{'serving eff.':>14}")  # fmt: skip
        for c, f in r["by_concurrency"].items():
            print(f"{c:>5}{f['completed']:>4}/{f['requests']:<4}{f['output_tok_s']:>14.1f}"
                  f"{f['engine_output_tok_s']:>14.1f}{_x(f['efficiency']):>12}{_ms(f['tpot_p50_s']):>13}"
                  f"{_ms(f['engine_step_p50_s']):>13}{_x(f['tpot_over_step']):>11}"
                  f"{_tok(f.get('engine_cluster_up_tok_s')):>20}{_x(f['serving_efficiency']):>14}")  # fmt: skip
            for err in f["errors"]:
                print(f"      error: {err}")
        verdict = "meets" if r["meets_targets"] else "misses"
        print(f"  {verdict} the targets ({res['definitions']['targets']})")


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if args.threads < 0 or args.num_blocks < 1:
        print("tandem bench efficiency: --threads must be >= 0 and --num-blocks >= 1", file=sys.stderr)
        return 2
    if not ready_to_serve("tandem bench efficiency"):
        return 2
    t0 = time.monotonic()
    threads = {m: args.threads or threads_per_worker(os.cpu_count() or 1, sum(MODES[m])) for m in MODES}
    configs = {n: EngineConfig(dtype=args.dtype, num_blocks=args.num_blocks, num_threads=n) for n in threads.values()}
    model = args.model or str(default_model_path())
    waves = {c: prompts(request_count(c, args.quick), args.seed, salt=c) for c in CONCURRENCIES}
    progress = not args.no_progress
    engine, meta, served = {}, {}, {}
    for mode, n in threads.items():  # each system between two runs of its baseline
        before, meta[mode] = run_engine(model, configs[n], n, waves, progress)
        served[mode] = run_mode(mode, model, configs[n], n, waves, progress)
        engine[mode] = best_of(before, run_engine(model, configs[n], n, waves, progress)[0])
    res = report(engine, served, meta, args.quick, time.monotonic() - t0)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "efficiency.json").write_text(json.dumps(res, indent=2))
    if args.json:
        print_json(res)
    else:
        print_report(res)
        print(f"took {res['elapsed_s']:.0f} s" + (f"; wrote {Path(args.out) / 'efficiency.json'}" if args.out else ""))
    failed = any(f["failed"] for mode in MODES for f in res[mode]["by_concurrency"].values())
    return 1 if failed else 0
