"""`tandem bench spec`: speculative decoding off vs on, same engine weights, threads and prompts.

    single     one request at a time, greedy, the workload's first few prompts in turn (4 by
               default; the global tree learns from the answers before): decode tok/s (output
               tokens after each first / the time after each first), speculation off and on
    batch16    16 requests at once: total output tok/s, off and on; the ratio
    acceptance draft tokens accepted / verified; mean accepted length = accepted / drafts;
               batch16_draft_tokens: draft tokens verified in the batch runs (0: it never drafted)
    staggered  (--staggered GAP_S) 16 prompts, 4 of each workload interleaved, arriving GAP_S
               apart, so steps mix prefills with decodes as a served worker's do: total tok/s,
               mean request latency, and how many requests' greedy tokens are the same on and off

Each figure is the best of `--repeats` rounds (2), off and on alternating which runs first.

Workloads (chat prompts, the model's template):
    summarize   copy the sentences of a passage that mention a word (the answer copies spans)
    code_edit   rewrite a given function with one change
    agentic     the same tool-call-style prompt with small variations, many times
    chat        open questions (little to copy: low acceptance expected)
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, replace
from typing import Any

from bench.json_out import print_json
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_files import default_model_path
from engine.sampling_params import SamplingParams

PASSAGE = (
    "The lighthouse stood on the northern cape. Every evening the keeper climbed its stairs. "
    "Ships passed the cape in the dark and the light kept them off the rocks. The keeper wrote "
    "each ship's name in a log. In winter the storms broke over the cape and the light burned all "
    "night. The keeper's daughter learned to trim the wick. One spring a steamer ran aground on "
    "the southern shoal, far from the light. The keeper rowed out and brought the crew ashore. "
)
FUNCTION = '''def merge_intervals(intervals):
    """Merge overlapping intervals; return them sorted by start."""
    if not intervals:
        return []
    ordered = sorted(intervals, key=lambda pair: pair[0])
    merged = [list(ordered[0])]
    for start, end in ordered[1:]:
        last = merged[-1]
        if start <= last[1]:
            last[1] = max(last[1], end)
        else:
            merged.append([start, end])
    return [tuple(pair) for pair in merged]
'''
TOOL = (
    "You are an agent. Answer with one JSON tool call and nothing else, in this form:\n"
    '{"tool": "get_weather", "arguments": {"city": "<city>", "unit": "celsius", "days": 3}}\n'
    "Task: get the weather for {city} for the next three days in celsius."
)
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Tokyo", "Quito", "Perth", "Dakar"] * 2
QUESTIONS = [
    "Why is the sky blue?", "What makes a good friend?", "How do bees find flowers?",
    "Why do we dream?", "What is the best way to learn a language?", "Why do leaves change colour?",
    "How does a bicycle stay upright?", "What is a black hole?",
] * 2  # fmt: skip


def workloads() -> dict[str, list[str]]:
    """Per workload, 16 user messages (the single-stream run takes the first few, in turn)."""
    summarize = [f"Copy, word for word, every sentence of this text that mentions the {w}:\n\n{PASSAGE}"
                 for w in ("keeper", "cape", "light", "ships") * 4]  # fmt: skip
    renames = (("intervals", "spans"), ("merged", "out"), ("ordered", "by_start"), ("last", "prev")) * 4
    code = [f"Rewrite this Python code, renaming `{a}` to `{b}` everywhere. Output only the code.\n\n{FUNCTION}"
            for a, b in renames]  # fmt: skip
    return {
        "summarize": summarize,
        "code_edit": code,
        "agentic": [TOOL.replace("{city}", c) for c in CITIES],
        "chat": QUESTIONS,
    }


@dataclass
class Timing:
    tokens: int
    decode_s: float  # after each request's first token, summed over requests run alone
    wall_s: float


def run(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> Timing:
    """All prompts at once; a request's decode time runs from its first output to its last."""
    first: dict[str, float] = {}
    last: dict[str, float] = {}
    n = 0
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"b{i}-{t0}", p, params)
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            first.setdefault(o.request_id, now)
            last[o.request_id] = now
            n += len(o.new_token_ids)
    decode = sum(last[r] - first[r] for r in last)
    return Timing(n, decode, time.perf_counter() - t0)


def run_staggered(
    engine: Engine, prompts: list[list[int]], params: SamplingParams, gap_s: float
) -> tuple[Timing, float, list[list[int]]]:
    """Prompt i arrives i * gap_s after the first, while the ones before decode, so steps mix
    prefill chunks with decode rows (and drafts), as a served worker's do. Returns the timing
    (wall: first arrival to last token), the mean time from a request's arrival to its last
    token, and each request's tokens."""
    t0 = time.perf_counter()
    pending, ids = list(enumerate(prompts)), {}
    tokens: list[list[int]] = [[] for _ in prompts]
    done_s = [0.0] * len(prompts)
    while pending or engine.has_unfinished():
        now = time.perf_counter() - t0
        while pending and pending[0][0] * gap_s <= now:
            i, p = pending.pop(0)
            ids[f"s{i}-{t0}"] = i
            engine.add_request(f"s{i}-{t0}", p, params)
        if not engine.has_unfinished():
            time.sleep(max(0.0, pending[0][0] * gap_s - now))
            continue
        for o in engine.step():
            if o.request_id in ids:
                i = ids[o.request_id]
                tokens[i] += o.new_token_ids
                done_s[i] = time.perf_counter() - t0 - i * gap_s
    wall = time.perf_counter() - t0
    return Timing(sum(map(len, tokens)), 0.0, wall), sum(done_s) / len(prompts), tokens


def measure_staggered(
    engines: dict[str, Engine], prompts: list[list[int]], max_tokens: int, gap_s: float, repeats: int = 2
) -> dict[str, Any]:
    """Off against on over `run_staggered`, rounds alternating which goes first, each figure the
    best of its rounds; `identical`: requests whose greedy tokens were the same both ways in
    every round (speculation is exact where a row's bits do not depend on its step's others)."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    best = {mode: {"tok_s": 0.0, "latency_s": float("inf")} for mode in engines}
    identical = [True] * len(prompts)
    s = engines["on"].speculator
    for r in range(repeats):
        if s is not None:
            s.reset()
        out: dict[str, list[list[int]]] = {}
        for mode in list(engines)[:: 1 if r % 2 == 0 else -1]:
            timing, latency, out[mode] = run_staggered(engines[mode], prompts, greedy, gap_s)
            best[mode]["tok_s"] = max(best[mode]["tok_s"], timing.tokens / timing.wall_s)
            best[mode]["latency_s"] = min(best[mode]["latency_s"], latency)
        identical = [x and a == b for x, a, b in zip(identical, out["on"], out["off"], strict=True)]
    return {
        "gap_s": gap_s,
        "speedup": best["on"]["tok_s"] / best["off"]["tok_s"],
        "latency_ratio": best["on"]["latency_s"] / best["off"]["latency_s"],
        "identical": sum(identical),
        "requests": len(prompts),
        **{f"{mode}_{k}": v for mode, figs in best.items() for k, v in figs.items()},
    }


def chat_prompts(engine: Engine, msgs: list[str]) -> list[list[int]]:
    tok = engine.tokenizer
    assert tok is not None
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": m}])) for m in msgs]


def run_alone(engine: Engine, prompts: list[list[int]], params: SamplingParams) -> Timing:
    """Each prompt alone, one after another, as one figure."""
    runs = [run(engine, [p], params) for p in prompts]
    return Timing(sum(r.tokens for r in runs), sum(r.decode_s for r in runs), sum(r.wall_s for r in runs))


def measure(
    engines: dict[str, Engine], prompts: list[list[int]], max_tokens: int, alone: int = 4, repeats: int = 2
) -> dict[str, Any]:
    """Off ("off") against on ("on"): the first `alone` prompts one at a time, then all at once;
    `repeats` rounds, the two modes alternating which goes first, and each figure the best of
    its rounds (others' load on the machine only ever makes a run slower). Each round starts
    with an empty global tree, so no round drafts from the answers of the one before; within a
    round, the prompts run alone teach it what the batch then drafts from. Acceptance counts
    every round."""
    greedy = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)  # every run its full length
    best: dict[str, dict[str, float]] = {mode: {"single_tok_s": 0.0, "batch16_tok_s": 0.0} for mode in engines}
    s = engines["on"].speculator
    before = (s.drafts, s.drafted, s.accepted) if s is not None else (0, 0, 0)
    batch_drafted = 0  # draft tokens verified in the batch runs (their rounds together)
    for r in range(repeats):
        if s is not None:
            s.reset()
        for mode in list(engines)[:: 1 if r % 2 == 0 else -1]:
            e = engines[mode]
            single = run_alone(e, prompts[:alone], greedy)
            drafted_before = e.speculator.drafted if e.speculator is not None else 0
            batch = run(e, prompts, replace(greedy, max_tokens=max_tokens // 2))
            batch_drafted += (e.speculator.drafted if e.speculator is not None else 0) - drafted_before
            figs = best[mode]
            if single.decode_s:
                figs["single_tok_s"] = max(figs["single_tok_s"], (single.tokens - alone) / single.decode_s)
            figs["batch16_tok_s"] = max(figs["batch16_tok_s"], batch.tokens / batch.wall_s)
    after = (s.drafts, s.drafted, s.accepted) if s is not None else (0, 0, 0)
    drafts, drafted, accepted = (a - b for a, b in zip(after, before, strict=True))
    on, off = best["on"], best["off"]
    return {
        "single_speedup": on["single_tok_s"] / off["single_tok_s"] if off["single_tok_s"] else None,
        "batch16_speedup": on["batch16_tok_s"] / off["batch16_tok_s"],
        "acceptance_rate": accepted / drafted if drafted else None,
        "mean_accepted_len": accepted / drafts if drafts else None,
        "batch16_draft_tokens": batch_drafted,
        **{f"{mode}_{k}": v for mode, figs in best.items() for k, v in figs.items()},
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench spec", description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32", "int8", "int4"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128, help="single stream; batch16 runs half of it")
    ap.add_argument("--single", type=int, default=4, help="prompts run one at a time, in turn (1-16)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of off and on; each figure the best")
    ap.add_argument("--only", default="", help="comma-separated workloads (default: all)")
    ap.add_argument("--drafter", default="suffix", choices=["ngram", "suffix"])
    ap.add_argument("--draft-len", type=int, default=EngineConfig.num_speculative_tokens, help="most draft tokens")
    ap.add_argument(
        "--staggered",
        type=float,
        default=0.0,
        metavar="GAP_S",
        help="also run 16 prompts of all workloads arriving GAP_S apart (steps mixing prefills and decodes)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    config = EngineConfig(dtype=args.dtype, num_threads=args.threads, num_blocks=2048)
    base = Engine.from_path(default_model_path(), config)
    on = replace(config, speculative=args.drafter, num_speculative_tokens=args.draft_len)
    engines = {"off": base, "on": Engine(base.model, base.tokenizer, on)}
    warm = SamplingParams(max_tokens=8, temperature=0)
    for e in engines.values():
        e.generate(["Hello there."] * 4, warm)
    chosen = [w for w in args.only.split(",") if w] or list(workloads())
    res: dict[str, Any] = {"dtype": config.weight_dtype, "threads": args.threads, "drafter": args.drafter}
    for name in chosen:
        res[name] = measure(engines, chat_prompts(base, workloads()[name]), args.max_tokens, args.single, args.repeats)
    if args.staggered > 0:
        mixed = [p for group in zip(*(workloads()[n][:4] for n in workloads()), strict=True) for p in group]
        res["staggered"] = measure_staggered(
            engines, chat_prompts(base, mixed), args.max_tokens // 2, args.staggered, args.repeats
        )
    if args.json:
        print_json(res)
        return 0
    print(f"speculative decoding ({args.drafter}) vs off, {res['dtype']}, {args.threads} threads, greedy")
    print(f"{'workload':<11}{'single off':>11}{'on':>8}{'ratio':>7}{'batch16 off':>13}{'on':>8}{'ratio':>7}"
          f"{'accept':>8}{'mean len':>9}{'b16 drafted':>12}")  # fmt: skip
    for name in chosen:
        r = res[name]
        acc = "-" if r["acceptance_rate"] is None else f"{r['acceptance_rate']:.2f}"
        mlen = "-" if r["mean_accepted_len"] is None else f"{r['mean_accepted_len']:.2f}"
        print(f"{name:<11}{r['off_single_tok_s']:>11.1f}{r['on_single_tok_s']:>8.1f}{r['single_speedup']:>6.2f}x"
              f"{r['off_batch16_tok_s']:>13.1f}{r['on_batch16_tok_s']:>8.1f}{r['batch16_speedup']:>6.2f}x"
              f"{acc:>8}{mlen:>9}{r['batch16_draft_tokens']:>12}")  # fmt: skip
    if "staggered" in res:
        st = res["staggered"]
        print(f"staggered, {st['requests']} requests {st['gap_s']} s apart: {st['off_tok_s']:.1f} -> "
              f"{st['on_tok_s']:.1f} tok/s ({st['speedup']:.2f}x), mean request latency {st['off_latency_s']:.2f} -> "
              f"{st['on_latency_s']:.2f} s ({st['latency_ratio']:.2f}x), greedy tokens identical on and off for "
              f"{st['identical']} of {st['requests']}")  # fmt: skip
    return 0
