"""`tandem bench hol`: how long a short prompt waits behind a long one on one engine, with the
prefill chunk cap (EngineConfig.max_prefill_chunk) against without it, in the same run.

Per long-prompt length and cap, on one engine (the model loaded once; caps switched between
rounds, alternating which goes first):

    alone     the long prompt alone: its time to first token
    short     a 64-token prompt added with it (behind it in arrival order): its TTFT
    long      the long prompt's TTFT with the short one beside it

The short prompt's TTFT uncapped over capped is the figure (`short_ttft_ratio` in --json); the
long prompt's alone time, capped over uncapped, is the cost (`long_alone_ratio`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from bench.json_out import print_json
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_files import default_model_path
from engine.sampling_params import SamplingParams

SHORT = 64
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _ttfts(e: Engine, prompts: dict[str, list[int]]) -> dict[str, float]:
    t = time.perf_counter()
    for rid, p in prompts.items():
        e.add_request(rid, p, ONE)
    out: dict[str, float] = {}
    while e.has_unfinished():
        for o in e.step():
            if o.finished:
                out[o.request_id] = time.perf_counter() - t
    return out


def prompts(rng: random.Random, vocab: int, n: int) -> tuple[list[int], list[int], list[int]]:
    """Fresh token ids (no prefix hit between them): a long prompt alone, another one, and the
    SHORT-token prompt that comes with it."""
    ids = [rng.randrange(1, vocab) for _ in range(2 * n + SHORT)]
    return ids[:n], ids[n : 2 * n], ids[2 * n :]


def measure(e: Engine, lengths: list[int], caps: list[int], rounds: int, seed: int = 0) -> dict[str, dict[str, float]]:
    """{f"{length}/{cap}": {alone, short, long}} medians over `rounds`; cap 0 = uncapped."""
    rng, vocab = random.Random(seed), e.model.config.vocab_size
    samples: dict[str, dict[str, list[float]]] = {}
    for r in range(rounds):
        for n in lengths:
            for cap in caps if r % 2 == 0 else caps[::-1]:
                e.scheduler.prefill_chunk = cap
                alone_p, long_p, short_p = prompts(rng, vocab, n)
                alone = _ttfts(e, {"alone": alone_p})["alone"]
                both = _ttfts(e, {"long": long_p, "short": short_p})
                s = samples.setdefault(f"{n}/{cap}", {"alone": [], "short": [], "long": []})
                s["alone"].append(alone)
                s["short"].append(both["short"])
                s["long"].append(both["long"])
    return {k: {f: statistics.median(v) for f, v in s.items()} for k, s in samples.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench hol", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "int8", "int4"])
    ap.add_argument("--threads", type=int, default=1, help="as a worker of 1P+1D on 2 cores")
    ap.add_argument("--cap", type=int, default=None, help="the chunk cap measured (default: EngineConfig's)")
    ap.add_argument("--quick", action="store_true", help="2K and 4K prompts, 1 round (else 2K/4K/8K, 2 rounds)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    config = EngineConfig(dtype=args.dtype, num_threads=args.threads, num_blocks=1280, enable_prefix_caching=False)
    cap = args.cap if args.cap is not None else config.prefill_chunk
    engine = Engine.from_path(default_model_path(), config)
    lengths = [2048, 4096] if args.quick else [2048, 4096, 8000]
    got = measure(engine, lengths, [0, cap], 1 if args.quick else 2)
    rows = {n: (got[f"{n}/0"], got[f"{n}/{cap}"]) for n in lengths}
    result = {
        "dtype": config.weight_dtype,
        "threads": args.threads,
        "cap": cap,
        "lengths": {
            str(n): {
                "uncapped": off,
                "capped": on,
                "short_ttft_ratio": off["short"] / on["short"],
                "long_alone_ratio": on["alone"] / off["alone"],
            }
            for n, (off, on) in rows.items()
        },
    }
    if args.json:
        print_json(result, indent=2)
        return 0
    print(f"{SHORT}-token prompt behind a long one, {config.weight_dtype}, {args.threads} thread(s), cap {cap}:")
    print("| long prompt | short TTFT uncapped | capped | ratio | long alone uncapped | capped | ratio |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n, (off, on) in rows.items():
        print(f"| {n} | {off['short']:.2f} s | {on['short']:.2f} s | **{off['short'] / on['short']:.1f}x** "
              f"| {off['alone']:.2f} s | {on['alone']:.2f} s | {on['alone'] / off['alone']:.2f}x |")  # fmt: skip
    return 0
