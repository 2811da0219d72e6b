"""`tandem profile`: measure this machine's engine profile (prefill time by uncached and cached
tokens, decode step time by batch and context, KV transfer GB/s per transport), save it as JSON
and in Redis under its node class; `--compare` sets the roofline estimator beside it.

`--beside-busy-peer` measures the same grid while a second engine of the same threads decodes a
batch without pause on the host's other cores: what a worker's steps cost while a peer on its
host is busy too (memory bandwidth and caches are shared, cores are not). The simulator uses it
for workers that share a host (planner.simulator, WorkerSpec.contended).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import multiprocessing
import os
import platform
import statistics
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from bench.engine_bench import ours
from bench.json_out import print_json
from engine.config import EngineConfig
from engine.engine import Engine
from engine.model_files import default_model_path
from engine.sampling_params import SamplingParams
from planner.hardware import measure_cpu
from planner.profile import PEER_SOURCE, DecodePoint, EngineProfile, PrefillPoint, store
from planner.roofline import attention_dtype, estimate, relative_errors


@dataclass(frozen=True)
class Grid:
    prefill: tuple[tuple[int, int], ...]  # (uncached, cached)
    decode: tuple[tuple[int, int], ...]  # (batch, prompt tokens each)
    steps: int = 16  # decode steps timed per point


FULL = Grid(
    ((128, 0), (512, 0), (2048, 0), (128, 2048), (512, 2048)), ((1, 128), (4, 128), (16, 128), (1, 2048), (8, 1024))
)
QUICK = Grid(((64, 0), (256, 0), (64, 256)), ((1, 64), (4, 64)), steps=8)


def _tokens(seed: int, n: int, vocab: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, min(vocab, 30000), (n,), generator=g).tolist()


def measure_profile(engine: Engine, grid: Grid, node_class: str, model: str) -> EngineProfile:
    """Time each grid point on `engine`: fresh random tokens each time, so no prefix hit but the
    intended one (the `cached` tokens, run once before the timed prompt)."""
    vocab, seed = engine.model.config.vocab_size, iter(range(1, 10**6))
    ours(engine, [_tokens(0, 32, vocab)], 2)  # warm-up
    prefill = []
    for uncached, cached in grid.prefill:
        prefix = _tokens(next(seed), cached, vocab)
        if cached:
            ours(engine, [prefix], 1)
        prompt = prefix + _tokens(next(seed), uncached, vocab)
        prefill.append(PrefillPoint(uncached, cached, ours(engine, [prompt], 1)))
    decode = []
    for batch, length in grid.decode:
        prompts = [_tokens(next(seed), length, vocab) for _ in range(batch)]
        ours(engine, prompts, 1)  # cached now: both timed runs below prefill nothing but the last token
        one, many = ours(engine, prompts, 1), ours(engine, prompts, grid.steps + 1)
        context = batch * (length + grid.steps // 2)
        decode.append(DecodePoint(batch, context, max(many - one, 1e-9) / grid.steps))
    engine.check_integrity()
    cfg = engine.config
    kv = engine.cache.codec.kind
    return EngineProfile(node_class, "measured", model, cfg.weight_dtype, kv, tuple(prefill), tuple(decode),
                         threads=torch.get_num_threads())  # fmt: skip


PEER_BATCH = 8  # the busy peer's streams: a decode batch as a loaded worker runs
PEER_PROMPT = 128


def _peer(path: str, config: EngineConfig, ready: Any) -> None:
    """The busy peer (a process of its own): decodes PEER_BATCH streams, over and over, until killed."""
    torch.set_num_threads(config.num_threads or 1)
    engine = Engine.from_path(path, config)
    vocab = engine.model.config.vocab_size
    prompts = [_tokens(10**6 + i, PEER_PROMPT, vocab) for i in range(PEER_BATCH)]
    params = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
    engine.generate(prompts, params)  # cached from here on: each round is 64 decode steps
    ready.set()
    while True:
        engine.generate(prompts, params)


@contextlib.contextmanager
def busy_peer(path: str, config: EngineConfig) -> Iterator[None]:
    """A second engine with `config` decoding in its own process while the block runs. Raises
    RuntimeError if it dies before it starts decoding."""
    ctx = multiprocessing.get_context("spawn")
    ready = ctx.Event()
    proc = ctx.Process(target=_peer, args=(path, config, ready), name="tandem-busy-peer", daemon=True)
    proc.start()
    try:
        while not ready.wait(1.0):  # as long as its model takes to load
            if not proc.is_alive():
                raise RuntimeError(f"the busy peer exited ({proc.exitcode}) before it decoded")
        yield
    finally:
        proc.kill()  # it holds nothing worth finishing
        proc.join()


def default_node_class() -> str:
    if name := os.environ.get("TANDEM_NODE_CLASS"):
        return name
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    return f"cpu:{model}:{torch.get_num_threads()}t".replace(" ", "-")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem profile", description=__doc__)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16", "int8"])
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "bf16", "int8", "fp8"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--node-class", default=None, help="default: TANDEM_NODE_CLASS, else the CPU model and threads")
    ap.add_argument("--out", default=None, help="JSON path (default: profile-<node class>.json)")
    ap.add_argument("--redis", default=os.environ.get("REDIS_URL", ""), help="also store it there (or REDIS_URL)")
    ap.add_argument("--namespace", default=os.environ.get("TANDEM_NAMESPACE", "default"))
    ap.add_argument("--transports", default="grpc,shm", help="KV transfer GB/s to measure ('' skips)")
    ap.add_argument("--quick", action="store_true", help="a small grid (a smoke check)")
    ap.add_argument("--beside-busy-peer", action="store_true", help="measure while a second engine of the same "
                    "threads decodes on the other cores (its node class gets ':busy-peer')")  # fmt: skip
    ap.add_argument("--compare", action="store_true", help="print the roofline estimate of this CPU beside it")
    ap.add_argument("--json", action="store_true", help="print the profile (and the comparison) as JSON")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = args.model or str(default_model_path())
    node_class = (args.node_class or default_node_class()) + (":busy-peer" if args.beside_busy_peer else "")
    config = EngineConfig(dtype=args.dtype, kv_dtype=args.kv_dtype, num_blocks=2048)
    engine = Engine.from_path(path, config)
    grid = QUICK if args.quick else FULL
    if args.beside_busy_peer:
        with busy_peer(path, replace(config, num_threads=args.threads, num_blocks=256)):
            profile = replace(measure_profile(engine, grid, node_class, os.path.basename(path)), source=PEER_SOURCE)
    else:
        profile = measure_profile(engine, grid, node_class, os.path.basename(path))
    transports = [t for t in args.transports.split(",") if t]
    if transports:
        from planner.transfer_profile import transfer_gbps

        profile = transfer_gbps(profile, engine, path, transports)
    out = args.out or f"profile-{node_class.replace(':', '_').replace('/', '_')}.json"
    profile.save(out)
    if args.redis:
        import redis

        store(redis.Redis.from_url(args.redis), args.namespace, profile)
    report: dict[str, object] = {"profile": out, "node_class": node_class}
    if args.compare:
        mem = float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
        hw = measure_cpu(tuple({profile.dtype, attention_dtype(profile.dtype)}), mem)
        est = estimate(profile, engine.model.config, hw, profile.dtype)
        errors = relative_errors(est, profile)
        # the step's fixed cost (Python, op dispatch) calibrated on one point, the first decode;
        # the error is then stated over the others
        overhead = profile.decode[0].seconds - est.decode[0].seconds
        calibrated = estimate(profile, engine.model.config, replace(hw, step_overhead_s=overhead), profile.dtype)
        rest = relative_errors(calibrated, profile)
        rest.pop(len(profile.prefill))
        Point = PrefillPoint | DecodePoint
        measured: list[Point] = [*profile.prefill, *profile.decode]
        estimated: list[Point] = [*est.prefill, *est.decode]
        with_cost: list[Point] = [*calibrated.prefill, *calibrated.decode]
        report |= {
            "cpu_peak_flops": hw.peak_flops,
            "cpu_mem_bw": hw.mem_bw,
            "roofline_error_median": statistics.median(errors),
            "roofline_error_max": max(errors),
            "step_overhead_s": overhead,
            "calibrated_error_median": statistics.median(rest),
            "calibrated_error_max": max(rest),
            "points": [
                {"measured_s": m.seconds, "estimated_s": e.seconds, "calibrated_s": c.seconds, **_label(m)}
                for m, e, c in zip(measured, estimated, with_cost, strict=True)
            ],
        }
    if args.json:
        print_json(report | {"measured": json.loads(profile.to_json())})
    else:
        _print(profile, report)
    return 0


def _label(p: PrefillPoint | DecodePoint) -> dict[str, object]:
    if isinstance(p, PrefillPoint):
        return {"phase": "prefill", "uncached": p.uncached, "cached": p.cached}
    return {"phase": "decode", "batch": p.batch, "context": p.context}


def _print(profile: EngineProfile, report: dict[str, object]) -> None:
    print(f"profile of {profile.node_class} ({profile.dtype}, KV {profile.kv_dtype}) -> {report['profile']}")
    for p in profile.prefill:
        print(f"  prefill {p.uncached:>5} new after {p.cached:>5} cached: {p.seconds * 1e3:8.1f} ms")
    for d in profile.decode:
        print(f"  decode step, batch {d.batch:>3}, context {d.context:>6}: {d.seconds * 1e3:8.1f} ms")
    for t, gbps in profile.transfer_gbps.items():
        print(f"  KV transfer over {t}: {gbps:.2f} GB/s")
    if "points" in report:
        print(f"roofline of this CPU vs measured: median error {report['roofline_error_median']:.0%}, "
              f"max {report['roofline_error_max']:.0%}; with a step cost of {report['step_overhead_s']:.4f} s "
              f"calibrated on the first decode point: median {report['calibrated_error_median']:.0%}, "
              f"max {report['calibrated_error_max']:.0%} over the others")  # fmt: skip
