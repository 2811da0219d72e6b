"""`tandem bench engine`: our engine against HF transformers (and `--peer llamacpp|openvino`), same model,
dtype, threads, prompts."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from bench import peers
from bench.json_out import print_json
from engine.config import PREFILL_ATTENTION, EngineConfig
from engine.engine import Engine
from engine.model_files import default_model_path
from engine.prefill_kernels import kernel_name
from engine.sampling_params import SamplingParams

PASSAGE = (
    "The history of computing is a story of people trying to make machines do arithmetic faster, "
    "and then discovering that the machines could do far more than arithmetic. Early mechanical "
    "calculators gave way to relays, vacuum tubes, transistors and integrated circuits; each step "
    "made computers smaller, cheaper and more reliable. "
)


def make_prompts(engine: Engine, n: int, length: int, first: int = 0) -> list[list[int]]:
    """n distinct prompts of exactly `length` tokens: prompt i opens with token 100 + first + i
    (first + n <= 1000), so prompts of different numbers share no prefix-cache block, whatever
    their lengths. Rows measured one after another take disjoint numbers (Prompts), or a row's
    prompts would find the last row's, their prefixes, cached: a 4K prompt is the first half of
    the 8K prompt of the same number."""
    assert engine.tokenizer is not None and first >= 0 and first + n <= 1000
    base = engine.tokenizer.encode(PASSAGE * (length // 40 + 2))
    return [[100 + first + i] + base[i : i + length - 1] for i in range(n)]


class Prompts:
    """Hands out make_prompts rows that share no prefix with any row handed out before."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.used = 0

    def take(self, n: int, length: int) -> list[list[int]]:
        rows = make_prompts(self.engine, n, length, self.used)
        self.used += n
        return rows


def timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def ours(engine: Engine, prompts: list[list[int]], new: int) -> float:
    params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True)
    return timed(lambda: engine.generate(prompts, params))


def theirs(hf: Any, prompts: list[list[int]], new: int) -> float:
    ids = torch.tensor(prompts, device=hf.device)

    def run() -> None:
        with torch.inference_mode():
            hf.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new,
                min_new_tokens=new,
                do_sample=False,
                pad_token_id=0,
            )
        if ids.is_cuda:
            torch.cuda.synchronize()  # generate returns before the GPU is done

    return timed(run)


def decode_rate(run: Callable[[list[list[int]], int], float], prompts: list[list[int]], new: int) -> float:
    """Decode tok/s with the prefill's cost taken out: (new - 1) tokens over t(new) - t(1).

    A first untimed run puts the prompts in the prefix cache, so both timed runs hit it alike."""
    run(prompts, 1)
    t1 = run(prompts, 1)
    tn = run(prompts, new)
    return len(prompts) * (new - 1) / max(tn - t1, 1e-9)


def prefill_rate(run: Callable[[list[list[int]], int], float], prompts: list[list[int]]) -> float:
    """Prompt tok/s of the best of a few runs, each on a distinct prompt (no prefix-cache hits)."""
    run(prompts[:1], 1)  # warm-up
    return len(prompts[1]) / min(run([p], 1) for p in prompts[1:])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tandem bench engine", description=__doc__)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: bundled SmolLM2)")
    ap.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "bf16", "fp32", "fp16", "int8", "int4"],
        help="auto: see engine.linear.auto_dtype; int8: W8A8 (HF quantized alike); int4: 4-bit layers (HF in fp32)",
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--no-ref", action="store_true", help="skip HF transformers")
    ap.add_argument(
        "--device", default="cpu", choices=["cpu", "cuda", "auto"], help="ours and HF's (cuda: bf16 unless --dtype)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--kv-dtype", default="auto", choices=["auto", "fp32", "bf16", "int8", "fp8"], help="KV cache")
    ap.add_argument(
        "--prefill-attention", default="auto", choices=list(PREFILL_ATTENTION), help="prefill chunks' attention kernel"
    )
    ap.add_argument("--no-long", action="store_true", help="skip the 4K/8K prefill and 8K-context decode rows")
    ap.add_argument(
        "--peer", choices=sorted(peers.PEERS), help="also run llama.cpp or OpenVINO GenAI (the peers extra)"
    )
    ap.add_argument(
        "--peer-python", help="a Python with optimum-intel for the one-time OpenVINO export (default: this)"
    )
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = args.model or str(default_model_path())
    peer = None
    if args.peer:  # before our run, so a missing extra or a failed export costs no wait
        try:
            n_ctx = (1024 if args.no_long else 8192) + args.new_tokens
            peer = peers.load(args.peer, Path(path), args.threads, n_ctx, args.peer_python)
        except peers.PeerUnavailable as e:
            print(f"tandem bench engine: {e}", file=sys.stderr)
            return 2
    t = time.perf_counter()
    config = EngineConfig(
        dtype=args.dtype,
        num_blocks=4096,
        max_num_seqs=128,
        kv_dtype=args.kv_dtype,
        device=args.device,
        prefill_attention=args.prefill_attention,
    )
    try:
        engine = Engine.from_path(path, config)
    except ValueError as e:  # e.g. --device cuda where torch sees no GPU
        print(f"tandem bench engine: {e}", file=sys.stderr)
        return 2
    load_s = time.perf_counter() - t
    new = args.new_tokens
    dtype_name = engine.config.weight_dtype

    def run_ours(p: list[list[int]], n: int) -> float:
        return ours(engine, p, n)

    prompts = Prompts(engine)
    short = prompts.take(64, 32)
    long = prompts.take(4, 512)
    ours(engine, short[:4], 4)  # warm-up
    res: dict[str, float | None] = {"load_s": load_s}
    res["decode_tok_s"] = decode_rate(run_ours, short[:1], new)
    res["prefill_tok_s"] = prefill_rate(run_ours, long)
    res["batch16_tok_s"] = 16 * new / ours(engine, short[:16], new)
    res["batch64_tok_s"] = 64 * new / ours(engine, short[:64], new)
    res.update(prefill_4k_tok_s=None, prefill_8k_tok_s=None, decode_8k_tok_s=None)
    long_rows: list[tuple[str, list[list[int]]]] = []
    if not args.no_long:
        long_rows = [
            ("prefill_4k_tok_s", prompts.take(3, 4096)),
            ("prefill_8k_tok_s", prompts.take(3, 8000)),
            ("decode_8k_tok_s", prompts.take(1, 8000)),
        ]
        res["prefill_4k_tok_s"] = prefill_rate(run_ours, long_rows[0][1])
        res["prefill_8k_tok_s"] = prefill_rate(run_ours, long_rows[1][1])
        res["decode_8k_tok_s"] = decode_rate(run_ours, long_rows[2][1], new)
    res.update(peers.measure(peer, decode_rate, prefill_rate, short, long, new, long_rows))
    res.update(ref_decode_tok_s=None, ref_prefill_tok_s=None, ref_batch16_tok_s=None, ref_batch64_tok_s=None)
    if not args.no_ref:
        from transformers import AutoModelForCausalLM

        dtype = engine.config.torch_dtype
        p = default_model_path() if args.model is None else None
        hf = (
            AutoModelForCausalLM.from_pretrained(str(p.parent), gguf_file=p.name, dtype=dtype)
            if p is not None
            else AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
        )
        hf.to(engine.cache.device)  # type: ignore[arg-type]  # (transformers' stubs type .to oddly)
        hf.eval()  # type: ignore[no-untyped-call]
        if dtype_name == "int8":  # the same W8A8 dynamic kernels as ours, on HF's module graph
            hf = torch.ao.quantization.quantize_dynamic(hf, {torch.nn.Linear}, dtype=torch.qint8)  # type: ignore[no-untyped-call]

        def run_ref(pr: list[list[int]], n: int) -> float:
            return theirs(hf, pr, n)

        theirs(hf, short[:4], 4)
        res["ref_decode_tok_s"] = decode_rate(run_ref, short[:1], new)
        res["ref_prefill_tok_s"] = prefill_rate(run_ref, long)
        res["ref_batch16_tok_s"] = 16 * new / theirs(hf, short[:16], new)
        if engine.cache.device.type == "cuda":  # the GPU target's batch (minutes on a CPU)
            res["ref_batch64_tok_s"] = 64 * new / theirs(hf, short[:64], new)
    attention = kernel_name(engine.model.prefill_attention, engine.model.native)
    res_meta = {"dtype": dtype_name, "kv_dtype": engine.cache.codec.kind, "threads": args.threads, "peer": args.peer,
                "device": str(engine.cache.device), "prefill_attention": attention}  # fmt: skip
    if args.json:
        print_json(res_meta | {k: round(v, 2) if v is not None else None for k, v in res.items()})
    else:
        print(f"engine bench: {dtype_name} on {engine.cache.device}, KV {engine.cache.codec.kind}, prefill "
              f"attention {res_meta['prefill_attention']}, {args.threads} threads, model {path} "
              f"(loaded in {load_s:.2f} s)")  # fmt: skip
        print(peers.header(peer.label if peer else None))
        for label, key in [
            ("decode tok/s (1 stream, 32 prompt)", "decode_tok_s"),
            ("prefill tok/s (512 prompt)", "prefill_tok_s"),
            ("batch-16 total tok/s", "batch16_tok_s"),
            ("batch-64 total tok/s", "batch64_tok_s"),
            ("prefill tok/s (4096 prompt)", "prefill_4k_tok_s"),
            ("prefill tok/s (8000 prompt)", "prefill_8k_tok_s"),
            ("decode tok/s (1 stream, 8000 ctx)", "decode_8k_tok_s"),
        ]:
            print(peers.row(label, res[key], res.get("ref_" + key), res.get("peer_" + key), peer is not None))
        for note in peer.notes if peer else []:
            print(note)
        p1, p4, p8 = res["prefill_tok_s"], res["prefill_4k_tok_s"], res["prefill_8k_tok_s"]
        d1, d8 = res["decode_tok_s"], res["decode_8k_tok_s"]
        if p1 and p4 and p8 and d1 and d8:
            print(f"long context: prefill at 4K {p4 / p1:.0%} and at 8K {p8 / p1:.0%} of the 512-token rate; "
                  f"decode at 8K {d8 / d1:.0%} of short-context decode")  # fmt: skip
    return 0
